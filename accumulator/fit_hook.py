"""What `keras.Model.fit` does first for a model compiled with a `GradientAccumulator`.

`before_fit` (called by the `fit` hook of `accumulator.hooks`, for Keras 3 and Keras 2)
refuses set-ups that would train wrong (also those `micro_batch_size` does not take yet:
`fit_micro_batches.refuse_unsupported`, and `fit_auto_micro_batch.refuse_unsupported` for
`micro_batch_size="auto"`, whose epochs it notes; for Keras 2 their `accumulator.keras2`
twins), builds a `micro_batch_size` model's optimizer before `fit` traces its step
(`fit_micro_batches.build_before_tracing`: traced once, not twice), warns where the batch
size would make windows other than the effective batch `find_micro_batch` set the window for
(`micro_batch.warn_of_windows_off_the_effective_batch`), ties `AccumBatchNormalization` layers to the
optimizer, and puts the window callback first, so the window closes before any other
callback reads the weights. Models compiled with any other optimizer are left alone.
"""

import keras

from tfx_gradient_accumulator.accumulator.batch import fit_auto_micro_batch, fit_micro_batches, micro_batch
from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.rows import row_room
from tfx_gradient_accumulator.accumulator.window import weighting
from tfx_gradient_accumulator.accumulator.core.replicas import NO_MERGE_CALL_MESSAGE
from tfx_gradient_accumulator.accumulator.schedules.auto_batch import AutoAccumulation, auto_rule_of
from tfx_gradient_accumulator.accumulator.schedules.callbacks import EpochWindows
from tfx_gradient_accumulator.accumulator.core.options import SUMMED_NOISE_SCALE_MESSAGE
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow


def before_fit(model, callbacks, fit_arguments=None):
    """The checks above, then `callbacks` with the window callback first.
    `fit_arguments` ({name: value} of the `fit` call) tell an "auto" window its micro-batch."""
    optimizer = getattr(model, "optimizer", None)
    if not flavours.is_keras2_object(model) and isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and \
            isinstance(optimizer.inner_optimizer, AccumulationWindow):
        raise ValueError(
            "The GradientAccumulator is inside a LossScaleOptimizer, which would unscale "
            "every micro-batch and skip single micro-batches instead of windows. Pass the "
            "GradientAccumulator itself to compile: under mixed_float16, compile puts the "
            "loss scaling inside it (or write GradientAccumulator("
            "keras.optimizers.LossScaleOptimizer(inner), accum_steps)). An accumulator that "
            "was already built without loss scaling cannot take it: compile a new one."
        )
    if not flavours.is_keras2_object(model):
        fit_auto_micro_batch.refuse_unsupported(model)
        fit_micro_batches.refuse_unsupported(model)
        fit_micro_batches.build_before_tracing(model)
        callbacks = fit_auto_micro_batch.with_epoch_note(model, callbacks)
    else:
        from tfx_gradient_accumulator.accumulator.keras2 import fit_auto_micro_batch as keras2_fit_auto_micro_batch
        from tfx_gradient_accumulator.accumulator.keras2 import fit_micro_batches as keras2_fit_micro_batches

        keras2_fit_auto_micro_batch.refuse_unsupported(model)
        keras2_fit_micro_batches.refuse_unsupported(model)
        callbacks = keras2_fit_auto_micro_batch.with_epoch_note(model, callbacks)
    if not isinstance(optimizer, AccumulationWindow) or optimizer.is_passthrough:
        return callbacks
    if getattr(model, "jit_compile", False) is True and \
            model.distribute_strategy.num_replicas_in_sync > 1:
        raise NotImplementedError(NO_MERGE_CALL_MESSAGE)
    if getattr(model, "jit_compile", False) is True and not flavours.is_keras2_object(model):
        row_room.make_room_before_fit(model, optimizer, fit_arguments or {})
    _refuse_a_summed_loss_for_the_noise_scale(model, optimizer)
    if not flavours.is_keras2_object(model):
        micro_batch.warn_of_windows_off_the_effective_batch(model, fit_arguments or {})
    return with_epoch_windows(model, callbacks, fit_arguments)


def _refuse_a_summed_loss_for_the_noise_scale(model, optimizer):
    """Before any batch: the step would refuse it too (`AccumulationWindow`), but only once
    `fit` has prepared the data and traced the step."""
    if not optimizer.measure_noise_scale or optimizer.loss_reduction != "auto":
        return
    loss = weighting.summed_loss(model)
    if loss is not None:
        name = getattr(loss, "name", None) or getattr(loss, "__name__", None) or type(loss).__name__
        raise ValueError(
            f"{SUMMED_NOISE_SCALE_MESSAGE} The model is compiled with the loss {name!r}, reduction "
            f"{getattr(loss, 'reduction', None)!r}; `measure_noise_scale=True` (which accum_steps='auto' "
            "turns on) allows 'sum_over_batch_size' or 'mean_with_sample_weight'.")


def with_epoch_windows(model, callbacks, fit_arguments=None):
    """`callbacks` with an `EpochWindows` first, if `model` trains with an accumulator."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, AccumulationWindow) or optimizer.is_passthrough:
        return callbacks
    keras_package = flavours.keras_package_of(model)
    epoch_windows = EpochWindows.for_keras(keras_package)
    if flavours.keras_is_3() and not flavours.is_keras2_object(model):
        from tfx_gradient_accumulator.accumulator.batch_norm import configure_batch_norm

        # Window-pooling layers follow the optimizer's windows.
        configure_batch_norm(model, optimizer.accum_steps, optimizer)
    as_list = isinstance(callbacks, keras_package.callbacks.CallbackList)
    items = callbacks.callbacks if as_list else list(callbacks or [])
    ours = [c for c in items if isinstance(c, epoch_windows)]
    if ours and optimizer.auto is not None and isinstance(ours[0], AutoAccumulation.for_keras(keras_package)):
        optimizer.auto_accumulation = ours[0]      # the user's own: kept for the next fit and backups
    if not ours and optimizer.auto is not None:
        ours = [auto_rule_of(optimizer, keras_package, fit_arguments or {})]
    if not ours:
        ours = [epoch_windows() if optimizer.fit_callback is None else optimizer.fit_callback()]
        if as_list:     # Keras configured the others already
            ours[0].set_model(model)
            ours[0].set_params(getattr(callbacks, "params", None) or {})
    ordered = ours + [c for c in items if not isinstance(c, epoch_windows)]
    if as_list:
        items[:] = ordered
        return callbacks
    return ordered

