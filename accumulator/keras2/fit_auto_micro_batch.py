"""`micro_batch_size="auto"` for Keras 2: the largest micro-batch whose step fits, found by the run.

The Keras 2 side of `accumulator.batch.fit_auto_micro_batch` (read its docstring first: the
rule, the records, why a failed step leaves the weights alone, XLA). For a Keras 2 model
(`tf_keras`, or TF 2.15's `keras`) compiled with `GradientAccumulator(inner,
micro_batch_size="auto")`, the `"keras2_fit_auto_micro_batch"` hook of `accumulator.hooks`
makes Keras 2's `make_train_function` return `train_function(model)` here. Keras 2's own
function fetches `next(iterator)` inside its `tf.function`, so a step that ran out of memory
could not have its batch again; this one takes the batch eagerly, then trains it through the
flavour-agnostic pieces of the Keras 3 module (`_Steps`: one compiled step per b, XLA once a
shape has fit; `_Shadows`; `_train`: the retries, the next b, the records), each step Keras 2's
micro-batch `train_step` (`accumulator.keras2.fit_micro_batches`) at the optimizer's
`micro_batch_size`.

What is Keras 2's own, here:

- The shadows. Keras 2 has no `metrics_variables`: the variables a failed step can change
  besides the update are those of `model.metrics` (the compiled loss's `loss` metric and
  the compiled metrics, built lazily by the first step that calls them) and the model's
  non-trainable variables (`BatchNormalization`'s moving statistics). Keras 2 builds its
  compiled metrics (and the optimizer) in the first step's trace, so the step is traced once
  first in a scratch `tf.function`, never run, and the shadows are taken after it.
- `_train_counter`: Keras 2's step adds 1 after each step that trained (callbacks and
  `BackupAndRestore` read it); here after the batch has trained, once, whatever its retries.
- The epoch note is a Keras 2 callback (`with_epoch_note`).
- The refusals (`refuse_unsupported`, before `fit` trains and when the function is made):
  several batches per call (`steps_per_execution` > 1), a `tf.distribute` strategy (several
  replicas come later), loss scaling (float32 only), without the hooks, and an optimizer
  without `track_updates` (the counter that tells an error inside the inner update).
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.batch import fit_auto_micro_batch as auto
from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import state_of
from tfx_gradient_accumulator.accumulator.core import flavours, seam


def refuse_unsupported(model) -> None:
    """Before a Keras 2 "auto" model trains: what "auto" does not take there (the module's
    docstring); nothing for any other model."""
    if not auto.is_auto(model):
        return
    owner = flavours.keras_package_of(model).Model
    if not getattr(owner.make_train_function, "accumulator_hook", False):
        raise RuntimeError(
            "micro_batch_size='auto' needs accumulator's Keras hooks (ACCUMULATOR_KERAS_HOOKS=0 or "
            "hooks.uninstall() left them out): without them `fit` would train each batch whole, and an "
            "out-of-memory error would stop it.")
    if not callable(getattr(model.optimizer, "track_updates", None)):
        raise NotImplementedError(
            "micro_batch_size='auto' needs a Keras 2 GradientAccumulator with `track_updates` (the counter "
            "that tells an out-of-memory error inside the inner update); pass an int micro_batch_size.")
    _refuse_several_batches_per_call(model)
    replicas = model.distribute_strategy.num_replicas_in_sync
    if replicas > 1 or tf.distribute.has_strategy():
        raise NotImplementedError(
            "micro_batch_size='auto' trains a Keras 2 model on one device for now (received a "
            f"{type(model.distribute_strategy).__name__} with {replicas} replica{'s' if replicas != 1 else ''}); "
            "under a tf.distribute strategy pass an int micro_batch_size, or build, compile and fit the model "
            "outside the strategy's scope.")
    if getattr(model.optimizer, "loss_scale_optimizer", None) is not None:
        raise NotImplementedError(
            "micro_batch_size='auto' trains a Keras 2 model in float32 for now; under loss scaling "
            "(mixed_float16) pass an int micro_batch_size.")


def _refuse_several_batches_per_call(model):
    """One batch per call of the train function: the batch it trains again after an error."""
    steps = model.steps_per_execution       # Keras 2's variable (None before compile)
    count = 1 if steps is None else int(steps.numpy())
    if count != 1 or getattr(model, "autotune_steps_per_execution", False):
        raise ValueError(
            f"micro_batch_size='auto' trains one batch per call, to train it again after an out-of-memory "
            f"error; compile with steps_per_execution=1 (received {'auto' if count == 1 else count}), or pass "
            "an int micro_batch_size.")


@functools.lru_cache(maxsize=None)
def _epoch_note_class(keras2):
    """`EpochNote` for the Keras 2 package `keras2` (`tf_keras`, or TF 2.15's `keras`)."""

    class EpochNote(keras2.callbacks.Callback):
        """Tells the optimizer's `AutoMicroBatch` the epoch `fit` is in (for its records)."""

        def __init__(self, state):
            super().__init__()
            self._state = state

        def on_epoch_begin(self, epoch, logs=None):
            self._state.epoch = int(epoch)

    return EpochNote


def with_epoch_note(model, callbacks):
    """`callbacks` with an `EpochNote` added for a Keras 2 "auto" model (unchanged otherwise)."""
    if not auto.is_auto(model):
        return callbacks
    keras2 = flavours.keras_package_of(model)
    note = _epoch_note_class(keras2)(state_of(model.optimizer))
    if isinstance(callbacks, keras2.callbacks.CallbackList):
        note.set_model(model)
        callbacks.callbacks.append(note)
        return callbacks
    return list(callbacks or []) + [note]


def train_function(model):
    """`model.train_function` for a Keras 2 "auto" model (the module's docstring)."""
    optimizer = model.optimizer
    state = state_of(optimizer)
    halves = optimizer.track_updates()
    shadows = []
    steps = auto._Steps(model, shadows)

    def function(iterator):
        data = auto._next_batch(iterator)
        if not shadows:
            shadows.append(_shadows_after_building(model, state, data))
        logs = auto._train(model, state, halves, shadows[0], steps, data)
        seam.keras2_train_counter(model).assign_add(1)
        return logs

    return function


def _shadows_after_building(model, state, data):
    """The shadows of a Keras 2 model, taken once its first step's trace has built the compiled
    loss, the compiled metrics and the optimizer (a scratch trace at the first batch's size,
    never run)."""
    if state.current is None:
        x = flavours.keras_package_of(model).utils.unpack_x_y_sample_weight(data)[0]
        state.current = state.effective_batch = int(auto._first_tensor(x).shape[0])
    tf.function(model.train_step, autograph=False).get_concrete_function(data)
    metrics = [variable for metric in model.metrics for variable in metric.variables]
    return auto._Shadows(metrics + list(model.non_trainable_variables))
