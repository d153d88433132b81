"""Keras callbacks that act on a `GradientAccumulator` between epochs.

`EpochWindows` closes the window left open at an epoch's end (`fit` adds it itself);
`AccumulationSchedule` changes `accum_steps` during training, exactly.
"""

import logging

import keras

from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.schedules.lr_scaling import LearningRateScaler, lr_multiplier
from tfx_gradient_accumulator.accumulator.core.options import (
    validate_lr_ramp_updates, validate_partial_window, validate_schedule)
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow

logger = logging.getLogger(__name__)


def accum_steps_at(schedule: dict, epoch: int) -> int:
    """The accum_steps in force at `epoch`.

    Args:
        schedule: `{epoch (or update): accum_steps}`, sorted.
        epoch: the epoch (or update count).

    Returns:
        The value of the last change at or before `epoch`; 1 before any.
    """
    steps = 1
    for start, value in schedule.items():
        if start <= epoch:
            steps = value
    return steps


class _EpochWindowsRule:
    """Closes the window open when an epoch's training ends.

    It acts when the epoch's last micro-batch has been trained: before `fit`
    validates (so validation sees the weights the large-batch run would have)
    and at the epoch's end. `fit` puts it first among the callbacks, so
    checkpoints and early stopping see the window applied.

    When the optimizer measures the gradient noise scale
    (`GradientAccumulator(..., measure_noise_scale=True)`), it also writes
    `logs["noise_scale"]` (a float, NaN until a window of two or more
    micro-batches has closed) at each training batch's end and at each
    epoch's end (after closing the window): Keras hands every callback the
    same `logs` dict in list order, and this one runs first, so the progress
    bar, `History` (appended after the user's callbacks), TensorBoard,
    `CSVLogger` and early stopping see it.

    Args:
        epoch_end: "apply", "carry" or "drop"; `None` (the default) follows the
            optimizer's `partial_window`.

    Raises:
        ValueError: `epoch_end` is not one of those.
        TypeError: in `fit`, the model's optimizer is not a `GradientAccumulator`.
    """

    def __init__(self, epoch_end=None):
        super().__init__()
        self.epoch_end = None if epoch_end is None else validate_partial_window(epoch_end, "epoch_end")
        self._training_epoch = False
        self._reported = False

    def _optimizer(self):
        """The model's `GradientAccumulator`; TypeError for any other optimizer."""
        optimizer = self.model.optimizer
        if not isinstance(optimizer, AccumulationWindow):
            raise TypeError(
                f"{type(self).__name__} needs a model compiled with a GradientAccumulator; "
                f"its optimizer is {type(optimizer).__name__}."
            )
        return optimizer

    def on_train_begin(self, logs=None):
        """Keras' hook: a new `fit` reports a short window again."""
        self._reported = False

    def on_epoch_begin(self, epoch, logs=None):
        """Keras' hook: an epoch's training begins."""
        self._training_epoch = True

    def on_test_begin(self, logs=None):
        """Keras' hook: inside `fit`, the epoch's window closes before validation."""
        # Inside `fit`, validation follows the epoch's last micro-batch.
        if self._training_epoch:
            self._close_epoch_window()

    def on_epoch_end(self, epoch, logs=None):
        """Keras' hook: the epoch's window closes (unless validation closed it); `noise_scale` logged."""
        if self._training_epoch:
            self._close_epoch_window()
        self._training_epoch = False
        self._log_noise_scale(logs)

    def on_train_batch_end(self, batch, logs=None):
        """Keras' hook: `noise_scale` logged when measured."""
        self._log_noise_scale(logs)

    def _log_noise_scale(self, logs):
        """`logs["noise_scale"]` when the optimizer measures it (and, with an Adam-like
        inner optimizer, `logs["noise_scale_preconditioned"]`)."""
        optimizer = getattr(self.model, "optimizer", None)
        if logs is not None and isinstance(optimizer, AccumulationWindow) and optimizer.measure_noise_scale:
            logs["noise_scale"] = optimizer.noise_scale
            if optimizer.preconditioned_noise_scale_estimate is not None:
                logs["noise_scale_preconditioned"] = optimizer.preconditioned_noise_scale

    def _close_epoch_window(self):
        """Closes the open window as `epoch_end` (or `partial_window`) says; logs a short one once."""
        self._training_epoch = False
        optimizer = self._optimizer()
        mode = self.epoch_end or optimizer.partial_window
        held = optimizer.close_partial_window(mode)
        if held and not self._reported:
            self._reported = True
            logger.info(
                "An epoch ended %d micro-batch(es) into a window of %d; epoch_end=%r %s it. "
                "Make steps_per_epoch a multiple of accum_steps to avoid short windows, or "
                "use partial_window='carry' to let windows run across epochs.",
                held, optimizer.accum_steps, mode,
                {"apply": "applied", "carry": "carried", "drop": "dropped"}[mode],
            )


class _AccumulationScheduleRule(_EpochWindowsRule):
    """Changes `accum_steps` at epoch starts or after given updates, and closes windows at epoch ends.

    With `by="epoch"` each change happens at an epoch's start (a window still
    open is applied first). With `by="update"` the keys count optimizer
    updates (the inner optimizer's `iterations`): the change happens at the
    first window boundary once that many updates are done, so the run equals
    Keras' own `fit`s at the corresponding batch sizes, chained. Boundaries
    are seen at each training batch's end: keep `steps_per_execution=1`.

    `lr_scaling` multiplies the inner optimizer's learning rate (constant or
    schedule) by the ratio of the effective batch to the starting one
    ("linear"), its square root ("sqrt") or leaves it ("none"). Each batch's
    and epoch's logs carry `accum_steps` and `lr_multiplier` (so `History`,
    TensorBoard and `CSVLogger` see them). With `lr_ramp_updates` (by update)
    the multiplier moves to its new value linearly over that many updates after
    each change, instead of jumping while Adam's moments still reflect the old batch.

    Args:
        schedule: {epoch or update: accum_steps}; the value at 0 is the
            starting effective batch. The optimizer must be `schedulable`
            (or have `accum_steps > 1`).
        epoch_end: "apply", "carry" or "drop": a window open when an epoch
            ends; `None` follows the optimizer's `partial_window`.
        by: "epoch" (the default) or "update".
        lr_scaling: "none" (the default), "linear" or "sqrt".
        lr_ramp_updates: with `by="update"`: the updates over which the multiplier
            ramps to its new value after a change (an int >= 0; 0 jumps).

    Raises:
        ValueError: `schedule`, `epoch_end`, `by`, `lr_scaling` or `lr_ramp_updates`
            out of its allowed values.
        TypeError: a schedule value is not an integer; in `fit`, the model's
            optimizer is not a `GradientAccumulator`.
    """

    def __init__(self, schedule: dict, epoch_end=None, by: str = "epoch", lr_scaling: str = "none",
                 lr_ramp_updates: int = 0):
        super().__init__(epoch_end)
        self.schedule = validate_schedule(schedule)
        if by not in ("epoch", "update"):
            raise ValueError(f"`by` must be 'epoch' or 'update'; received {by!r}.")
        self.by = by
        self.scaler = LearningRateScaler(lr_scaling, accum_steps_at(self.schedule, 0))
        self.lr_ramp_updates = validate_lr_ramp_updates(lr_ramp_updates, by)

    def set_model(self, model):
        """Keras' hook: the learning-rate rule attached to the model's optimizer."""
        super().set_model(model)
        optimizer = getattr(model, "optimizer", None)
        if not isinstance(optimizer, AccumulationWindow):
            return
        if self.scaler.attach(optimizer.inner_optimizer, optimizer.accum_steps):
            # The step reads the scaled schedule; a step traced before must be traced again.
            model.train_function = None

    def on_train_begin(self, logs=None):
        """Keras' hook: the rule attached; with `by="update"`, the schedule's value now."""
        super().on_train_begin(logs)
        optimizer = self._optimizer()
        self.scaler.attach(optimizer.inner_optimizer, optimizer.accum_steps)
        if self.by == "update":
            self._follow_updates()

    def on_epoch_begin(self, epoch, logs=None):
        """Keras' hook: the schedule's `accum_steps` for this epoch (or update count)."""
        super().on_epoch_begin(epoch, logs)
        if self.by == "epoch":
            self._change_to(accum_steps_at(self.schedule, epoch))
        else:
            self._follow_updates()

    def on_train_batch_end(self, batch, logs=None):
        """Keras' hook: with `by="update"`, a change at a window boundary; the logs."""
        super().on_train_batch_end(batch, logs)
        if self.by == "update":
            self._follow_updates()
        self._log_schedule(logs)

    def on_epoch_end(self, epoch, logs=None):
        """Keras' hook: the window closed; `accum_steps` and `lr_multiplier` logged."""
        super().on_epoch_end(epoch, logs)
        self._log_schedule(logs)

    def _follow_updates(self):
        """At a window boundary, the schedule's value for the updates done."""
        optimizer = self._optimizer()
        if optimizer.held_micro_batches:
            return
        update = int(optimizer.iterations.numpy())
        self._change_to(accum_steps_at(self.schedule, update), self._ramped_multiplier(update))

    def _ramped_multiplier(self, update):
        """The learning-rate multiplier after `update` updates: the schedule's, ramped
        linearly from the one before over `lr_ramp_updates` after its last change."""
        rule, start = self.scaler.rule, self.scaler.start_accum_steps
        target = lr_multiplier(rule, accum_steps_at(self.schedule, update), start)
        changed = max((u for u in self.schedule if 0 < u <= update), default=None)
        if not self.lr_ramp_updates or changed is None or update - changed >= self.lr_ramp_updates:
            return target
        before = lr_multiplier(rule, accum_steps_at(self.schedule, changed - 1), start)
        return before + (target - before) * (update - changed) / self.lr_ramp_updates

    def _change_to(self, steps, multiplier=None):
        """`accum_steps = steps` (an open window applied first) and the learning rate
        scaled (to `multiplier`, else the rule's value for `steps`)."""
        optimizer = self._optimizer()
        if steps != optimizer.accum_steps:
            optimizer.close_partial_window("apply")
            optimizer.set_accum_steps(steps)
        if multiplier is None:
            multiplier = lr_multiplier(self.scaler.rule, steps, self.scaler.start_accum_steps)
        if self.scaler.multiplier != multiplier:
            self.scaler.set_multiplier(multiplier)

    def _log_schedule(self, logs):
        """`accum_steps` and `lr_multiplier` into `logs`."""
        if logs is not None:
            logs["accum_steps"] = self._optimizer().accum_steps
            logs["lr_multiplier"] = self.scaler.multiplier


def window_callback_classes(keras_package) -> tuple:
    """Deprecated: `EpochWindows.for_keras(keras_package)`, `AccumulationSchedule.for_keras(...)`.

    Args:
        keras_package: the `keras` module, or Keras 2's (`tf_keras`).

    Returns:
        `(EpochWindows, AccumulationSchedule)` of that Keras.
    """
    return EpochWindows.for_keras(keras_package), AccumulationSchedule.for_keras(keras_package)


class EpochWindows(_EpochWindowsRule, keras.callbacks.Callback, metaclass=flavours.OneNameForBothKeras):
    __doc__ = _EpochWindowsRule.__doc__

    @staticmethod
    def _make_keras2_class(keras2):
        if keras2 is keras:     # TF <= 2.15: `keras` is Keras 2, and this class is its
            return EpochWindows

        class Keras2(_EpochWindowsRule, keras2.callbacks.Callback):
            __doc__ = _EpochWindowsRule.__doc__

        Keras2.__name__ = Keras2.__qualname__ = "EpochWindows"
        return Keras2


class AccumulationSchedule(_AccumulationScheduleRule, EpochWindows):
    __doc__ = _AccumulationScheduleRule.__doc__

    @staticmethod
    def _make_keras2_class(keras2):
        if keras2 is keras:     # TF <= 2.15: `keras` is Keras 2, and this class is its
            return AccumulationSchedule

        class Keras2(_AccumulationScheduleRule, EpochWindows.for_keras(keras2)):
            __doc__ = _AccumulationScheduleRule.__doc__

        Keras2.__name__ = Keras2.__qualname__ = "AccumulationSchedule"
        return Keras2
