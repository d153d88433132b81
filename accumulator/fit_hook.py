"""What `keras.Model.fit` does first for a model compiled with a `GradientAccumulator`.

An optimizer sees gradients, never epochs, so on its own a `GradientAccumulator`
could not close the window left open when an epoch ends mid-window (the
large-batch run's short last batch). The `fit` hook that `import accumulator`
installs (`accumulator.hooks`) calls `before_fit`, which

* refuses, before any training, the set-ups that would train wrong: a
  `LossScaleOptimizer` that Keras put *around* the accumulator (a
  `mixed_float16` model compiled without `auto_scale_loss=False`), and
  `jit_compile=True` under a multi-replica strategy;
* ties the model's `AccumBatchNormalization` layers to the optimizer's windows;
* puts an `accumulator.callbacks.EpochWindows` callback first in the list (or
  the `AccumulationSchedule` or `AutoAccumulation` that `accumulating_compile`
  asked for), so the
  window is closed, as the optimizer's `partial_window` says, before
  validation, checkpoints, early stopping or any other callback looks at the
  weights. A callback of that kind the user passes is moved to the front
  instead of being doubled.

Models compiled with any other optimizer train exactly as before. The same
hook serves Keras 2's `Model.fit` (`accumulator.keras2`), with Keras 2's
callback classes.
"""

import keras

from tfx_gradient_accumulator.accumulator import seam
from tfx_gradient_accumulator.accumulator._tf import NO_MERGE_CALL_MESSAGE
from tfx_gradient_accumulator.accumulator.callbacks import window_callback_classes
from tfx_gradient_accumulator.accumulator.window import AccumulationWindow


def before_fit(model, callbacks):
    """The checks above, then `callbacks` with the window callback first."""
    optimizer = getattr(model, "optimizer", None)
    if not seam.is_keras2_object(model) and isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and \
            isinstance(optimizer.inner_optimizer, AccumulationWindow):
        raise ValueError(
            "Keras wrapped the GradientAccumulator in its own LossScaleOptimizer "
            "(the model's dtype policy is mixed_float16 and compile() had "
            "auto_scale_loss=True), which would unscale every micro-batch and skip "
            "single micro-batches instead of windows. Put the loss scaling inside "
            "and tell compile not to add one: "
            "model.compile(optimizer=GradientAccumulator(keras.optimizers.LossScaleOptimizer(inner), "
            "accum_steps), ..., auto_scale_loss=False)."
        )
    if not isinstance(optimizer, AccumulationWindow) or optimizer.is_passthrough:
        return callbacks
    if getattr(model, "jit_compile", False) is True and \
            model.distribute_strategy.num_replicas_in_sync > 1:
        raise NotImplementedError(NO_MERGE_CALL_MESSAGE)
    return with_epoch_windows(model, callbacks)


def with_epoch_windows(model, callbacks):
    """`callbacks` with an `EpochWindows` first, if `model` trains with an accumulator."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, AccumulationWindow) or optimizer.is_passthrough:
        return callbacks
    keras_package = seam.keras_package_of(model)
    EpochWindows, _ = window_callback_classes(keras_package)
    if seam.keras_is_3() and not seam.is_keras2_object(model):
        from tfx_gradient_accumulator.accumulator.batch_norm import configure_batch_norm

        # Window-pooling layers follow the optimizer's windows.
        configure_batch_norm(model, optimizer.accum_steps, optimizer)
    as_list = isinstance(callbacks, keras_package.callbacks.CallbackList)
    items = callbacks.callbacks if as_list else list(callbacks or [])
    ours = [c for c in items if isinstance(c, EpochWindows)]
    if not ours:
        ours = [EpochWindows() if optimizer.fit_callback is None else optimizer.fit_callback()]
        if as_list:     # Keras configured the others already
            ours[0].set_model(model)
            ours[0].set_params(getattr(callbacks, "params", None) or {})
    ordered = ours + [c for c in items if not isinstance(c, EpochWindows)]
    if as_list:
        items[:] = ordered
        return callbacks
    return ordered
