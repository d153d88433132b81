"""`AutoAccumulation`: the effective batch that grows with the measured critical batch.

At each window boundary it bounds the noise scale B_simple from below with the windows
measured at the current batch (`batch_target`), and grows `accum_steps` on a fine grid to
the largest batch whose sample overhead stays within budget; it never shrinks, and the
learning rate ramps. Its decisions are a by-update schedule that `AccumulationSchedule` replays.
"""


import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.schedules import batch_target
from tfx_gradient_accumulator.accumulator.schedules.callbacks import (
    AccumulationSchedule, EpochWindows, _AccumulationScheduleRule, accum_steps_at)

GEOMETRIES = ("auto", "raw", "preconditioned")
RETIRED = ("margin", "patience", "growth")


def _positive_int(value, name):
    """`value` if it is an int >= 1 (not a bool); ValueError naming `name` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"`{name}` must be an int >= 1; received {value!r}.")
    return value


def _in_open_interval(value, name, low, high, closed_high=False):
    """`value` as a float if low < value < high (<= high with `closed_high`); ValueError otherwise."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low < value and (
        value <= high if closed_high else value < high)
    if not ok:
        raise ValueError(f"`{name}` must be a number in ({low}, {high}{']' if closed_high else ')'}; "
                         f"received {value!r}.")
    return float(value)


class _AutoAccumulationRule(_AccumulationScheduleRule):
    """Grows `accum_steps` while the measured noise scale says the batch is small.

    The optimizer measures the gradient noise scale B_simple (in samples), an
    estimate of the critical batch. After `min_windows` windows at the current
    batch, this callback takes a one-sided lower confidence bound on B_simple
    from those windows' own spread (`batch_target.lower_bound`), and grows
    `accum_steps`, on the grid 1, 2, 3, 4, 6, 8, 12, ..., to the largest batch
    that, by McCandlish et al.'s model with the bound for B_simple, needs at most
    `max_sample_overhead` more samples than the starting batch B0 (B <= (1 +
    overhead) B0 + overhead x bound), in fewer updates. A growth at most doubles the batch, forgets the windows
    measured before it (so the next decision rests on windows at the new batch:
    no cascade). It looks once per `min_windows` windows, which keeps false
    growths rare over many looks, and ramps the learning-rate multiplier (`lr_scaling`) over
    `lr_ramp_updates`; the batch never shrinks, and never passes
    `max_effective_batch_size`. Since the batch stays at most B_simple, the
    learning rate never rises past what B_simple supports.

    With Adam-like optimizers (`geometry="auto"`) it reads the noise scale of
    the preconditioned gradient g / (sqrt(v) + eps), the one Adam's steps
    follow (Pollux/AdaptDL's choice); the raw one is logged beside it.

    Every decision lands in `schedule` ({optimizer update: accum_steps}), which
    `AccumulationSchedule(schedule, by="update", lr_scaling=..., lr_ramp_updates=...)`
    replays exactly; `state()` / `restore_state()` carry it across a preemption.
    Batch logs carry `effective_batch_size`, `accum_steps`, `lr_multiplier`,
    `noise_scale` (raw, samples), `noise_scale_preconditioned`,
    `noise_scale_lower` (the bound) and `target_effective_batch_size`. Under
    `tf.distribute` every worker reads the same moments, so all decide alike.

    Args:
        micro_batch_size: the global micro-batch (fit's `batch_size`), in samples.
        max_effective_batch_size: the effective batch never goes above this.
        start_accum_steps: the starting window (the optimizer's `accum_steps`).
        max_sample_overhead: the budget of extra samples a batch may cost over
            the starting batch, in (0, 1] (0.1: at most ~10% more).
        confidence: the one-sided level of the bound at each look, in (0.5, 1).
        min_windows: windows at the current batch before a decision (an int >= 2).
        lr_scaling: "none", "linear" or "sqrt" (see `AccumulationSchedule`).
        lr_ramp_updates: the updates the learning rate takes to its new value.
        geometry: "auto" (preconditioned where the inner optimizer has a second
            moment, else raw), "raw" or "preconditioned".
        epoch_end: as `EpochWindows`.

    Raises:
        ValueError: a setting out of its values; in `fit`, an optimizer that does
            not measure the noise scale, averages it over fewer than
            `min_windows` windows, or lacks the preconditioned estimate asked for.
        TypeError: `margin`, `patience` or `growth` (the retired rule's settings).
    """

    def __init__(self, micro_batch_size: int, max_effective_batch_size: int, start_accum_steps: int = 1,
                 *, max_sample_overhead: float = 0.1, confidence: float = 0.975, min_windows: int = 10,
                 lr_scaling: str = "none", lr_ramp_updates: int = 50, geometry: str = "auto",
                 epoch_end=None, **retired):
        if retired:
            raise TypeError(
                f"AutoAccumulation got {sorted(retired)}: the rule no longer grows by a margin and a "
                "patience; it grows to the largest batch within `max_sample_overhead` of a lower "
                "confidence bound on the noise scale. Its settings: max_sample_overhead, confidence, "
                "min_windows, lr_ramp_updates, geometry.")
        start_accum_steps = _positive_int(start_accum_steps, "start_accum_steps")
        super().__init__({0: start_accum_steps}, epoch_end, by="update", lr_scaling=lr_scaling,
                         lr_ramp_updates=lr_ramp_updates)
        self.micro_batch_size = _positive_int(micro_batch_size, "micro_batch_size")
        self.max_effective_batch_size = _positive_int(max_effective_batch_size, "max_effective_batch_size")
        self.max_sample_overhead = _in_open_interval(max_sample_overhead, "max_sample_overhead", 0, 1, True)
        self.confidence = _in_open_interval(confidence, "confidence", 0.5, 1)
        if _positive_int(min_windows, "min_windows") < 2:
            raise ValueError(f"`min_windows` must be an int >= 2; received {min_windows!r}.")
        self.min_windows = min_windows
        if geometry not in GEOMETRIES:
            raise ValueError(f"`geometry` must be one of {GEOMETRIES}; received {geometry!r}.")
        self.geometry = geometry
        self.readings = {}
        self._last_seen = -1
        self._looked_at = 0

    def on_train_begin(self, logs=None):
        """Keras' hook: refuses an optimizer whose estimate cannot feed the rule."""
        optimizer = self._optimizer()
        if not optimizer.measure_noise_scale:
            raise ValueError("AutoAccumulation needs GradientAccumulator(..., measure_noise_scale=True, "
                             "schedulable=True).")
        if optimizer.noise_scale_smoothing < 1.0 - 1.0 / self.min_windows:
            raise ValueError(
                f"AutoAccumulation(min_windows={self.min_windows}) needs the optimizer's "
                f"noise_scale_smoothing >= {1.0 - 1.0 / self.min_windows:g} (it remembers about "
                f"1 / (1 - smoothing) windows); received {optimizer.noise_scale_smoothing!r}.")
        super().on_train_begin(logs)

    def _follow_updates(self):
        """At a window boundary: decide, then follow the schedule."""
        optimizer = self._optimizer()
        if not optimizer.held_micro_batches:
            self._decide(int(optimizer.iterations.numpy()), optimizer)
        super()._follow_updates()

    def _estimates(self, optimizer):
        """(the estimate the rule reads, the preconditioned one or None)."""
        preconditioned = getattr(optimizer, "preconditioned_noise_scale_estimate", None)
        if self.geometry == "preconditioned" and preconditioned is None:
            raise ValueError("AutoAccumulation(geometry='preconditioned') needs an inner optimizer with "
                             "a second moment (Adam, AdamW, RMSprop, Adagrad, ...); use geometry='raw'.")
        use = preconditioned if preconditioned is not None and self.geometry != "raw" else None
        return (use or optimizer.noise_scale_estimate), preconditioned

    def _decide(self, update, optimizer):
        """One look per `min_windows` windows: extends `schedule` when the bound says grow."""
        if update == self._last_seen:
            return
        self._last_seen = update
        estimate, preconditioned = self._estimates(optimizer)
        if estimate is None:        # not built yet: no window seen
            return
        windows = int(estimate.window_count.numpy())
        if windows - self._looked_at < self.min_windows:
            return
        # Looks every `min_windows` windows, not every window: fewer chances of a false growth.
        self._looked_at = windows
        largest = max(1, self.max_effective_batch_size // self.micro_batch_size)
        # The schedule's value, which a resumed run's optimizer takes only after this look.
        current = accum_steps_at(self.schedule, update)
        grown, bound, target = batch_target.next_accum_steps(
            estimate.moments.values(), current, self.micro_batch_size, largest,
            self.max_sample_overhead, self.confidence, self.scaler.start_accum_steps)
        self.readings = {
            "noise_scale": optimizer.noise_scale,
            "noise_scale_preconditioned": (preconditioned.noise_scale_value() if preconditioned is not None
                                           else float("nan")),
            "noise_scale_lower": bound, "target_effective_batch_size": target * self.micro_batch_size}
        if grown is not None:
            self.schedule[update] = grown
            for each in (optimizer.noise_scale_estimate, preconditioned):
                if each is not None:
                    each.moments.reset()

    def _log_schedule(self, logs):
        """The schedule's logs, `effective_batch_size` and the rule's readings."""
        super()._log_schedule(logs)
        if logs is not None:
            logs["effective_batch_size"] = self._optimizer().accum_steps * self.micro_batch_size
            logs.update(self.readings)

    def state(self) -> dict:
        """The decisions so far, for a resumed run (the windows' moments are optimizer variables).

        Returns:
            A JSON-able dict that `restore_state` takes.
        """
        return {"schedule": {str(k): v for k, v in self.schedule.items()}, "last_seen": self._last_seen,
                "looked_at": self._looked_at}

    def restore_state(self, state: dict) -> None:
        """Puts back what `state()` returned.

        Args:
            state: the dict `state()` returned (read back from JSON).
        """
        # Sorted: JSON gives "12" before "4", and the schedule is read in key order.
        self.schedule = dict(sorted((int(k), int(v)) for k, v in state["schedule"].items()))
        self._last_seen = int(state["last_seen"])
        self._looked_at = int(state.get("looked_at", 0))


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
