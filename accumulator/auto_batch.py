"""`AutoAccumulation`: the effective batch that grows with the measured critical batch.

At each window boundary it compares the measured noise scale B_simple with the effective
batch and grows `accum_steps` by `growth` when B_simple stays above it; it never shrinks.
Its decisions are a by-update schedule that `AccumulationSchedule` replays.
"""

import math

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.callbacks import AccumulationSchedule, EpochWindows, _AccumulationScheduleRule


def _positive_int(value, name):
    """`value` if it is an int >= 1 (not a bool); ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1; received {value!r}.")
    return value


class _AutoAccumulationRule(_AccumulationScheduleRule):
    """Grows `accum_steps` at window boundaries while B_simple says the batch is small.

    The optimizer measures the gradient noise scale B_simple, an estimate of the
    critical batch. At each window boundary this callback compares it with the
    effective batch (`accum_steps` x the global micro-batch): when B_simple is at least
    `margin` times the effective batch for `patience` boundaries in a row, it
    multiplies `accum_steps` by `growth` (up to `max_effective_batch_size`); it never
    shrinks the batch, and each growth changes the learning rate by `lr_scaling`.
    Every decision lands in `schedule` ({optimizer update: accum_steps}), which
    `AccumulationSchedule(schedule, by="update")` replays exactly in a later run;
    `state()` / `restore_state()` carry the decisions across a preemption. The logs
    carry `effective_batch_size`, `accum_steps`, `lr_multiplier` and `noise_scale`.
    Under `tf.distribute` every worker reads the same B_simple at the same window,
    so all take the same decision.

    Args:
        micro_batch_size: the global micro-batch (fit's `batch_size`), in samples.
        max_effective_batch_size: the effective batch never goes above this.
        start_accum_steps: the starting window (the optimizer's `accum_steps`).
        growth: the factor `accum_steps` grows by (an int >= 2).
        margin: grow when B_simple >= margin x effective batch.
        patience: ... for this many window boundaries in a row (hysteresis).
        lr_scaling: "none", "linear" or "sqrt" (see `AccumulationSchedule`).
        epoch_end: as `EpochWindows`.

    Raises:
        ValueError: a count is not an int >= 1, `growth` < 2, `margin` not > 0, or
            `lr_scaling`/`epoch_end` out of its values; in `fit`, an optimizer that
            does not measure the noise scale.
    """

    def __init__(self, micro_batch_size: int, max_effective_batch_size: int, start_accum_steps: int = 1,
                 growth: int = 2, margin: float = 2.0, patience: int = 3, lr_scaling: str = "none",
                 epoch_end=None):
        start_accum_steps = _positive_int(start_accum_steps, "start_accum_steps")
        super().__init__({0: start_accum_steps}, epoch_end, by="update", lr_scaling=lr_scaling)
        self.micro_batch_size = _positive_int(micro_batch_size, "micro_batch_size")
        self.max_effective_batch_size = _positive_int(max_effective_batch_size, "max_effective_batch_size")
        if _positive_int(growth, "growth") < 2:
            raise ValueError(f"`growth` must be an int >= 2; received {growth!r}.")
        self.growth = growth
        if not isinstance(margin, (int, float)) or not margin > 0:
            raise ValueError(f"`margin` must be a number > 0; received {margin!r}.")
        self.margin = float(margin)
        self.patience = _positive_int(patience, "patience")
        self._streak = 0
        self._last_seen = -1

    def on_train_begin(self, logs=None):
        """Keras' hook: refuses an optimizer that does not measure the noise scale."""
        if not self._optimizer().measure_noise_scale:
            raise ValueError("AutoAccumulation needs GradientAccumulator(..., measure_noise_scale=True, "
                             "schedulable=True).")
        super().on_train_begin(logs)

    def _follow_updates(self):
        """At a window boundary: decide, then follow the schedule."""
        optimizer = self._optimizer()
        if not optimizer.held_micro_batches:
            self._decide(int(optimizer.iterations.numpy()), optimizer.accum_steps, optimizer.noise_scale)
        super()._follow_updates()

    def _decide(self, update, accum_steps, noise_scale):
        """One look per window boundary: extends `schedule` when the rule says grow."""
        if update == self._last_seen:
            return
        self._last_seen = update
        effective = accum_steps * self.micro_batch_size
        larger = accum_steps * self.growth * self.micro_batch_size
        if math.isfinite(noise_scale) and noise_scale >= self.margin * effective \
                and larger <= self.max_effective_batch_size:
            self._streak += 1
        else:
            self._streak = 0
        if self._streak >= self.patience:
            self.schedule[update] = accum_steps * self.growth
            self._streak = 0

    def _log_schedule(self, logs):
        """The schedule's logs, and `effective_batch_size`."""
        super()._log_schedule(logs)
        if logs is not None:
            logs["effective_batch_size"] = self._optimizer().accum_steps * self.micro_batch_size

    def state(self) -> dict:
        """The decisions so far and the rule's counters, for a resumed run.

        Returns:
            A JSON-able dict that `restore_state` takes.
        """
        return {"schedule": {str(k): v for k, v in self.schedule.items()},
                "streak": self._streak, "last_seen": self._last_seen}

    def restore_state(self, state: dict) -> None:
        """Puts back what `state()` returned.

        Args:
            state: the dict `state()` returned (read back from JSON).
        """
        self.schedule = {int(k): int(v) for k, v in state["schedule"].items()}
        self._streak = int(state["streak"])
        self._last_seen = int(state["last_seen"])


class AutoAccumulation(_AutoAccumulationRule, EpochWindows):
    __doc__ = _AutoAccumulationRule.__doc__

    @staticmethod
    def _make_keras2_class(keras2):
        if keras2 is keras:     # TF <= 2.15: `keras` is Keras 2, and this class is its
            return AutoAccumulation

        class Keras2(_AutoAccumulationRule, AccumulationSchedule.for_keras(keras2)):
            __doc__ = _AutoAccumulationRule.__doc__

        Keras2.__name__ = Keras2.__qualname__ = "AutoAccumulation"
        return Keras2


def auto_accumulation_class(keras_package) -> type:
    """Deprecated: `AutoAccumulation.for_keras(keras_package)`.

    Args:
        keras_package: the `keras` module, or Keras 2's (`tf_keras`).

    Returns:
        `AutoAccumulation` for that Keras.
    """
    return AutoAccumulation.for_keras(keras_package)


def auto_rule_of(optimizer, keras_package, fit_arguments: dict):
    """The `AutoAccumulation` of a `GradientAccumulator(accum_steps="auto")`.

    Made by its first `fit` (whose arguments tell the micro-batch) and kept on the
    optimizer (`auto_accumulation`).

    Args:
        optimizer: the `GradientAccumulator`.
        keras_package: the model's Keras.
        fit_arguments: `fit`'s arguments by name.

    Returns:
        The `AutoAccumulation` callback.
    """
    if optimizer.auto_accumulation is None:
        optimizer.auto_accumulation = AutoAccumulation.for_keras(keras_package)(
            micro_batch_size=global_micro_batch_size(fit_arguments),
            start_accum_steps=optimizer.accum_steps, **optimizer.auto)
    return optimizer.auto_accumulation


def global_micro_batch_size(fit_arguments: dict) -> int:
    """The samples of one step of `fit` (all replicas').

    Args:
        fit_arguments: `fit`'s arguments by name.

    Returns:
        Its `batch_size` for arrays (Keras' default 32), or a dataset's batch (static,
        else read from its first batch).
    """
    x = fit_arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        shape = tf.nest.flatten(x.element_spec)[0].shape
        if shape.rank and shape[0] is not None:
            return int(shape[0])
        for first in x.take(1):
            return int(tf.shape(tf.nest.flatten(first)[0])[0])
        raise ValueError("GradientAccumulator(accum_steps='auto'): the dataset given to fit is empty.")
    if x is None or not (hasattr(x, "shape") or isinstance(x, (dict, list, tuple))):
        raise ValueError(
            "GradientAccumulator(accum_steps='auto') reads the micro-batch from fit's `batch_size` or "
            f"from a tf.data.Dataset; fit got a {type(x).__name__}. Pass the rule yourself: "
            "fit(..., callbacks=[AutoAccumulation(micro_batch_size=<samples per step>, "
            "max_effective_batch_size=...)]).")
    return int(fit_arguments.get("batch_size") or 32)
