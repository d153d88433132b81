"""The learning-rate rule that goes with a change of the effective batch.

When a schedule changes `accum_steps`, the effective batch changes by the ratio
r = accum_steps / starting accum_steps. `lr_scaling` says what happens to the
inner optimizer's learning rate: "none" keeps it, "linear" multiplies it by r
(Goyal et al. 2017, for SGD), "sqrt" by sqrt(r) (Hoffer et al. 2017; Adam-like
optimizers). The multiplier applies to whatever the inner optimizer has: a
constant learning rate (its variable is reassigned) or a `LearningRateSchedule`
or callable (wrapped once, before the step is traced, in `ScaledSchedule`, whose
multiplier is a variable, so a change needs no retracing).
"""

import functools
import math

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import flavours, seam
from tfx_gradient_accumulator.accumulator.core.options import LR_SCALINGS, validate_lr_scaling  # noqa: F401  (its names here before)


def lr_multiplier(rule: str, accum_steps: int, start_accum_steps: int) -> float:
    """The learning-rate multiplier for `accum_steps` relative to `start_accum_steps`.

    Args:
        rule: "none", "linear" or "sqrt".
        accum_steps: the window's micro-batches now.
        start_accum_steps: those the given learning rate is for.

    Returns:
        1, r or sqrt(r), with r = accum_steps / start_accum_steps.
    """
    ratio = accum_steps / start_accum_steps
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[rule]


class _ScaledScheduleRule:
    """`schedule(step) * multiplier`, the multiplier a variable set between windows."""

    def __init__(self, schedule, multiplier: float = 1.0):
        """Wraps `schedule` (a `LearningRateSchedule` or a callable) with a variable multiplier."""
        self.schedule = schedule
        self.multiplier = tf.Variable(float(multiplier), trainable=False, dtype=tf.float32,
                                      name="lr_multiplier")

    def __call__(self, step):
        """The learning rate at `step`, times the multiplier."""
        value = self.schedule(step) if hasattr(self.schedule, "get_config") else self.schedule()
        return tf.cast(value, tf.float32) * self.multiplier

    def get_config(self) -> dict:
        """The wrapped schedule (serialized) and the multiplier."""
        schedules = flavours.keras_package_of(self).optimizers.schedules
        return {"schedule": schedules.serialize(self.schedule),
                "multiplier": float(self.multiplier.numpy())}

    @classmethod
    def from_config(cls, config: dict):
        """Rebuilds it from `get_config()`."""
        keras_3 = issubclass(cls, keras.optimizers.schedules.LearningRateSchedule)
        schedules = (keras if keras_3 else flavours.keras2_module()).optimizers.schedules
        return cls(schedules.deserialize(config["schedule"]), config["multiplier"])


@functools.lru_cache(maxsize=None)
def scaled_schedule_class(keras_package) -> type:
    """`ScaledSchedule` for `keras_package` (Keras 3 or Keras 2): each checks its own base class.

    Args:
        keras_package: the `keras` module, or Keras 2's (`tf_keras`).

    Returns:
        The class (made once per package).
    """
    if keras_package is keras:
        return ScaledSchedule
    return type("ScaledSchedule", (_ScaledScheduleRule, keras_package.optimizers.schedules.LearningRateSchedule),
                {"__doc__": _ScaledScheduleRule.__doc__, "__module__": __name__})


class ScaledSchedule(_ScaledScheduleRule, keras.optimizers.schedules.LearningRateSchedule):
    __doc__ = _ScaledScheduleRule.__doc__


class LearningRateScaler:
    """Holds the inner optimizer's unscaled learning rate and sets the multiplier.

    Args:
        rule: "none", "linear" or "sqrt".
        start_accum_steps: the accum_steps whose learning rate is the one given.

    Raises:
        ValueError: `rule` is not one of those.
    """

    def __init__(self, rule: str, start_accum_steps: int):
        self.rule = validate_lr_scaling(rule)
        self.start_accum_steps = int(start_accum_steps)
        self.multiplier = 1.0
        self._inner = None
        self._base = None

    def attach(self, inner_optimizer, accum_steps: int) -> bool:
        """Prepares `inner_optimizer` (before its step is traced).

        A constant learning rate is taken as the one for the optimizer's current
        `accum_steps` (already scaled when a run resumes after a change), so the
        unscaled one is that divided by the multiplier for `accum_steps`. A schedule
        is wrapped once in a `ScaledSchedule`.

        Args:
            inner_optimizer: the optimizer whose learning rate is scaled.
            accum_steps: the window's micro-batches now.

        Returns:
            True when its learning rate was replaced (by a `ScaledSchedule`).
        """
        if self.rule == "none" or self._inner is inner_optimizer:
            return False
        self._inner = inner_optimizer
        given = seam.given_learning_rate(inner_optimizer)
        if isinstance(given, _ScaledScheduleRule):
            self._base = given
            self.multiplier = float(given.multiplier.numpy())
            return False
        if callable(given) and not isinstance(given, tf.Variable) and not hasattr(given, "assign"):
            package = flavours.keras_package_of(inner_optimizer)
            self._base = scaled_schedule_class(package)(given, self.multiplier)
            inner_optimizer.learning_rate = self._base
            if package is not keras:
                # Keras 2 saves the optimizer's traced functions in a SavedModel: the
                # multiplier they read must be reachable from it (a tracked attribute).
                inner_optimizer.lr_scaling_multiplier = self._base.multiplier
            return True
        self.multiplier = lr_multiplier(self.rule, accum_steps, self.start_accum_steps)
        # A constant (a float, or a variable of either Keras: TF 2.15's `keras` has no `ops`).
        self._base = float(given.numpy() if hasattr(given, "numpy") else given) / self.multiplier
        return False

    def set(self, accum_steps: int) -> float:
        """Scales the learning rate for `accum_steps`.

        Args:
            accum_steps: the window's micro-batches from now on.

        Returns:
            The multiplier.
        """
        return self.set_multiplier(lr_multiplier(self.rule, accum_steps, self.start_accum_steps))

    def set_multiplier(self, multiplier: float) -> float:
        """Sets the learning rate to the unscaled one times `multiplier` (a ramp's step).

        Args:
            multiplier: the factor.

        Returns:
            The multiplier.
        """
        self.multiplier = float(multiplier)
        if self._inner is None or self.rule == "none":
            return self.multiplier
        if isinstance(self._base, _ScaledScheduleRule):
            self._base.multiplier.assign(self.multiplier)
        else:
            self._inner.learning_rate = self._base * self.multiplier
        return self.multiplier
