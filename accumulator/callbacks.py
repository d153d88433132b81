"""Keras callbacks that act on a `GradientAccumulator` between epochs.

`AccumulationSchedule({epoch: accum_steps})` changes the accumulation during
training (as PyTorch Lightning's GradientAccumulationScheduler and optax's
`every_k_schedule` do). Each change is exact: the window open at the change is
applied first (as the last, short batch of that epoch would be), then the new
`accum_steps` holds from the first micro-batch of the epoch. The accumulator's
step reads `accum_steps` from a variable, so nothing is retraced.

`epoch_end` says what happens to a window still open at the end of every epoch:
"carry" (the default: windows run on across epochs), "apply" or "drop".
"""

import keras

from accumulator.optimizer import PARTIAL_WINDOW_MODES, GradientAccumulator, validate_accum_steps


def validate_schedule(schedule):
    """Returns {int epoch: int accum_steps}, sorted, or raises naming the problem."""
    if not isinstance(schedule, dict) or not schedule:
        raise ValueError(
            f"`schedule` must be a non-empty dict {{epoch: accum_steps}}; received {schedule!r}."
        )
    result = {}
    for epoch, steps in schedule.items():
        try:
            epoch_int = int(epoch)
        except (TypeError, ValueError):
            raise ValueError(f"`schedule` keys must be epochs (ints >= 0); received {epoch!r}.") from None
        if epoch_int < 0 or str(epoch_int) != str(epoch).strip():
            raise ValueError(f"`schedule` keys must be epochs (ints >= 0); received {epoch!r}.")
        result[epoch_int] = validate_accum_steps(steps, name=f"schedule[{epoch!r}]")
    return dict(sorted(result.items()))


def accum_steps_at(schedule, epoch):
    """The accum_steps in force at `epoch` (the last change at or before it; 1 before any)."""
    steps = 1
    for start, value in schedule.items():
        if start <= epoch:
            steps = value
    return steps


class AccumulationSchedule(keras.callbacks.Callback):
    """Changes `accum_steps` at epoch starts; optionally closes windows at epoch ends.

    Args:
        schedule: {epoch: accum_steps}; epochs not listed keep the last value.
            `None`: only `epoch_end` acts.
        epoch_end: "carry", "apply" or "drop": a window open when an epoch ends.
    """

    def __init__(self, schedule=None, epoch_end="carry"):
        super().__init__()
        self.schedule = None if schedule is None else validate_schedule(schedule)
        if epoch_end not in PARTIAL_WINDOW_MODES:
            raise ValueError(f"`epoch_end` must be one of {PARTIAL_WINDOW_MODES}; received {epoch_end!r}.")
        self.epoch_end = epoch_end

    def _optimizer(self):
        optimizer = self.model.optimizer
        if not isinstance(optimizer, GradientAccumulator):
            raise TypeError(
                "AccumulationSchedule needs a model compiled with a GradientAccumulator; "
                f"its optimizer is {type(optimizer).__name__}."
            )
        return optimizer

    def on_epoch_begin(self, epoch, logs=None):
        if self.schedule is None:
            return
        optimizer = self._optimizer()
        steps = accum_steps_at(self.schedule, epoch)
        if steps != optimizer.accum_steps:
            optimizer.close_partial_window("apply")
            optimizer.set_accum_steps(steps)

    def on_epoch_end(self, epoch, logs=None):
        if self.epoch_end != "carry":
            self._optimizer().close_partial_window(self.epoch_end)
