"""The accumulation options, checked once: `WindowOptions` and `CacheOptions`.

Every option of `GradientAccumulator` (both Keras), `accumulating_compile`, the
TFX Trainer's settings, `check_exact` and the tuning helpers is validated here,
and nowhere else: each error names the parameter and the values it allows.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional, Union

from tfx_gradient_accumulator.accumulator.core.validation import DEFAULT_SMOOTHING, validate_smoothing
from tfx_gradient_accumulator.accumulator.core.validation import integer_at_least

PARTIAL_WINDOW_MODES = ("apply", "carry", "drop")
# "auto": read the compiled loss's reduction in `fit` (a mean otherwise); "mean": the
# window's gradient is the micro-batches' mean, each weighing its loss's denominator;
# "sum": the loss sums over its samples, and so does the window (see `accumulator.window.weighting`).
LOSS_REDUCTIONS = ("auto", "mean", "sum")
LR_SCALINGS = ("none", "linear", "sqrt")
SCHEDULE_UNITS = ("epoch", "update")
AUTO = "auto"
MICRO_BATCH_AUTO = "auto"     # micro_batch_size="auto": the largest micro-batch that fits, found by the run
# accum_steps="auto" starts at the smallest window that measures the noise scale.
AUTO_START_ACCUM_STEPS = 2
# accum_steps="fit": the micro-batch that fits the device, found by trying (`find_micro_batch`),
# splits the effective batch (the Trainer's option, and `AccumulatingHyperModel`'s).
FIT = "fit"

SUMMED_NOISE_SCALE_MESSAGE = (
    "`measure_noise_scale=True` needs a loss that is a mean over its samples: the noise scale "
    "compares micro-batch gradients that are means, each weighed by its samples (the loss's "
    "denominator). This loss sums over its samples (reduction 'sum' or 'none', or "
    "loss_reduction='sum'): its micro-batches carry no sample count, and the estimate would "
    "be off by the micro-batch size. Use a mean loss (Keras' default "
    "'sum_over_batch_size'), or leave `measure_noise_scale` off.")

__all__ = [
    "AUTO", "AUTO_START_ACCUM_STEPS", "CacheOptions", "FIT", "DEFAULT_SMOOTHING", "LOSS_REDUCTIONS",
    "LR_SCALINGS", "PARTIAL_WINDOW_MODES", "SUMMED_NOISE_SCALE_MESSAGE", "WindowOptions", "integer_at_least",
    "refuse_unknown_arguments", "validate_accum_steps", "validate_auto", "validate_bool",
    "validate_loss_reduction", "validate_lr_scaling", "validate_measure_noise_scale",
    "validate_merge_duplicate_rows", "validate_micro_batch_search", "validate_partial_window", "validate_schedule",
    "validate_schedule_by", "validate_smoothing", "validate_micro_batch_size",
]


# ------------------------------------------------------------------ one option each
def validate_accum_steps(accum_steps: Any, name: str = "accum_steps") -> int:
    """Checks `accum_steps`: micro-batches per window.

    Args:
        accum_steps: the value given.
        name: the parameter's name, for the error message.

    Returns:
        `accum_steps` as an int.

    Raises:
        TypeError: not an integer (2.5, "4", True).
        ValueError: below 1.
    """
    return integer_at_least(accum_steps, name)


def _one_of(value: Any, allowed: tuple, name: str) -> Any:
    """`value` if it is one of `allowed`; ValueError naming `name` otherwise."""
    if value not in allowed:
        raise ValueError(f"`{name}` must be one of {allowed}; received {value!r}.")
    return value


def validate_partial_window(mode: Any, name: str = "partial_window") -> str:
    """Checks `mode`: what an open window does at an epoch's end.

    Args:
        mode: the value given.
        name: the parameter's name, for the error message.

    Returns:
        `mode`.

    Raises:
        ValueError: `mode` is not one of `PARTIAL_WINDOW_MODES` ("apply", "carry", "drop").
    """
    return _one_of(mode, PARTIAL_WINDOW_MODES, name)


def validate_loss_reduction(reduction: Any, name: str = "loss_reduction") -> str:
    """Checks `reduction`: how the loss reduces over its samples.

    Args:
        reduction: the value given.
        name: the parameter's name, for the error message.

    Returns:
        `reduction`.

    Raises:
        ValueError: `reduction` is not one of `LOSS_REDUCTIONS` ("auto", "mean", "sum").
    """
    return _one_of(reduction, LOSS_REDUCTIONS, name)


def validate_lr_scaling(rule: Any, name: str = "lr_scaling") -> str:
    """Checks `rule`: the learning-rate rule as the window grows.

    Args:
        rule: the value given.
        name: the parameter's name, for the error message.

    Returns:
        `rule`.

    Raises:
        ValueError: `rule` is not one of `LR_SCALINGS` ("none", "linear", "sqrt").
    """
    return _one_of(rule, LR_SCALINGS, name)


def validate_bool(value: Any, name: str) -> bool:
    """Checks a flag.

    Args:
        value: the value given.
        name: the parameter's name, for the error message.

    Returns:
        `value`.

    Raises:
        ValueError: `value` is not True or False.
    """
    if not isinstance(value, bool):
        raise ValueError(f"`{name}` must be True or False; received {value!r}.")
    return value


def validate_measure_noise_scale(measure: Any, name: str = "measure_noise_scale") -> bool:
    """Checks `measure`: whether to measure the gradient noise scale.

    Args:
        measure: the value given.
        name: the parameter's name, for the error message.

    Returns:
        `measure`.

    Raises:
        ValueError: `measure` is not True or False.
    """
    return validate_bool(measure, name)


def validate_merge_duplicate_rows(merge: Any, name: str = "merge_duplicate_rows") -> bool:
    """Checks `merge`: whether a sparse gradient's rows are summed per index.

    Args:
        merge: the value given.
        name: the parameter's name, for the error message.

    Returns:
        `merge`.

    Raises:
        ValueError: `merge` is not True or False.
    """
    return validate_bool(merge, name)


def validate_schedule_by(unit: Any, name: str = "schedule_by") -> str:
    """Checks `unit`: what a schedule's keys count.

    Args:
        unit: the value given.
        name: the parameter's name, for the error message.

    Returns:
        `unit`.

    Raises:
        ValueError: `unit` is not "epoch" or "update".
    """
    if unit not in SCHEDULE_UNITS:
        raise ValueError(f"`{name}` must be 'epoch' or 'update'; received {unit!r}.")
    return unit


def validate_schedule(schedule: Any) -> Dict[int, int]:
    """Checks an accumulation schedule.

    Args:
        schedule: `{epoch: accum_steps}` (keys may be strings of ints, as JSON gives them).

    Returns:
        `{int epoch: int accum_steps}`, sorted.

    Raises:
        ValueError: not a non-empty dict, a key not an int >= 0, or a value below 1.
        TypeError: a value is not an integer.
    """
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


def validate_auto(accum_steps: Any, max_effective_batch_size: Any,
                  lr_scaling: Any) -> Optional[Dict[str, Any]]:
    """Checks the settings of `accum_steps="auto"`.

    Args:
        accum_steps: an int, or "auto".
        max_effective_batch_size: the effective batch "auto" may grow to (an int >= 2;
            with "auto" only, and needed then).
        lr_scaling: the learning-rate rule ("none" without "auto").

    Returns:
        `{"max_effective_batch_size", "lr_scaling"}` with "auto", None for a fixed
        `accum_steps`.

    Raises:
        TypeError: `accum_steps` is a string other than "auto".
        ValueError: a setting that goes only with "auto" is given without it, or
            "auto" lacks `max_effective_batch_size` or has a bad one.
    """
    if isinstance(accum_steps, str) and accum_steps != AUTO:
        raise TypeError(f"`accum_steps` must be an integer >= 1 or 'auto'; received {accum_steps!r}.")
    if accum_steps != AUTO:
        if max_effective_batch_size is not None or lr_scaling != "none":
            raise ValueError(
                "`max_effective_batch_size` and `lr_scaling` go with accum_steps='auto'; received "
                f"accum_steps={accum_steps!r}. A fixed schedule takes its own "
                "(AccumulationSchedule(schedule, lr_scaling=...)).")
        return None
    if max_effective_batch_size is None:
        raise ValueError("accum_steps='auto' needs `max_effective_batch_size`: the effective batch "
                         "(samples per update) it may grow to, an int >= 2.")
    integer_at_least(max_effective_batch_size, "max_effective_batch_size", 2)
    validate_lr_scaling(lr_scaling)
    return {"max_effective_batch_size": int(max_effective_batch_size), "lr_scaling": lr_scaling}


def validate_lr_ramp_updates(lr_ramp_updates: Any, by: str = "update", changes: bool = True,
                             advice: str = "") -> int:
    """Checks the length of a learning-rate ramp, and that something can ramp.

    The one place of the rule "a ramp needs a change of the batch": `accumulating_compile`
    and the Trainer's settings pass `changes` and say, in `advice`, what goes with a ramp
    in their own parameters.

    Args:
        lr_ramp_updates: the updates over which the learning rate moves to its new
            value after a change of the batch (an int >= 0).
        by: the schedule's keys: a ramp counts updates, so it needs "update".
        changes: whether the batch changes during the run (a schedule, or "auto"):
            without a change a ramp > 0 would never run, so it is refused.
        advice: the refusal's second half when nothing changes the batch: what goes
            with a ramp, in the caller's words (default: the library's names).

    Returns:
        `lr_ramp_updates` as an int.

    Raises:
        ValueError: not an int >= 0, or > 0 without `changes`, or > 0 with `by="epoch"`.
    """
    if isinstance(lr_ramp_updates, bool) or not isinstance(lr_ramp_updates, int) or lr_ramp_updates < 0:
        raise ValueError(f"`lr_ramp_updates` must be an int >= 0; received {lr_ramp_updates!r}.")
    if lr_ramp_updates and not changes:
        raise ValueError("`lr_ramp_updates` ramps the learning rate after a change of the batch: " + (
            advice or "it goes with a schedule by update or `accum_steps=\"auto\"`; nothing changes the batch "
                      "here. Leave it 0."))
    if lr_ramp_updates and by != "update":
        raise ValueError("`lr_ramp_updates` counts updates: it goes with by='update'; received "
                         f"by={by!r}.")
    return lr_ramp_updates


def validate_micro_batch_search(effective_batch_size: Any, headroom: Any,
                                max_micro_batch: Any = None, uniform: Any = False) -> tuple:
    """Checks `find_micro_batch`'s options (`accumulator.batch.micro_batch`).

    Args:
        effective_batch_size: the samples per update the run trains with, an int >= 1.
        headroom: the share of the largest micro-batch that fit to leave unused, a number
            in [0, 1).
        max_micro_batch: None, or the largest micro-batch to try, an int >= 1.
        uniform: True or False: every micro-batch of a window the same size (b divides E).

    Returns:
        `(effective_batch_size, headroom, max_micro_batch, uniform)` as int, float, int or
        None, bool.

    Raises:
        TypeError: an integer option that is no integer.
        ValueError: a value out of its range.
    """
    effective_batch_size = integer_at_least(effective_batch_size, "effective_batch_size")
    if (isinstance(headroom, bool) or not isinstance(headroom, (int, float))
            or not 0 <= headroom < 1):
        raise ValueError(f"`headroom` must be a number in [0, 1) (the share of the largest micro-batch "
                         f"that fit left unused); received {headroom!r}.")
    if max_micro_batch is not None:
        max_micro_batch = integer_at_least(max_micro_batch, "max_micro_batch")
    return effective_batch_size, float(headroom), max_micro_batch, validate_bool(uniform, "uniform")


def validate_micro_batch_size(micro_batch_size: Any, name: str = "micro_batch_size") -> Optional[Union[int, str]]:
    """Checks `micro_batch_size`: the samples of each micro-batch `fit` splits its batch into.

    Args:
        micro_batch_size: None (`fit`'s batch is one micro-batch, or `accum_steps` of them
            make a window), an int >= 1, or "auto" (the largest that fits, found by the run:
            `accumulator.batch.fit_auto_micro_batch`).
        name: the parameter's name, for the error message.

    Returns:
        `micro_batch_size` as an int, "auto", or None.

    Raises:
        TypeError: neither None, an integer nor a string (2.5, True).
        ValueError: below 1, or a string other than "auto".
    """
    if micro_batch_size is None:
        return None
    if isinstance(micro_batch_size, str):
        if micro_batch_size.strip().lower() == MICRO_BATCH_AUTO:
            return MICRO_BATCH_AUTO
        raise ValueError(f"`{name}` must be None, a positive integer (1, 2, 3, ...) or {MICRO_BATCH_AUTO!r} "
                         f"(the largest that fits, found by the run); received {micro_batch_size!r}.")
    return integer_at_least(micro_batch_size, name)


def refuse_unknown_arguments(kwargs: Mapping[str, Any], advice: str = "") -> None:
    """Refuses `GradientAccumulator` arguments it does not know (both Keras).

    Args:
        kwargs: the constructor's keyword arguments left over.
        advice: a sentence added to the message.

    Raises:
        ValueError: `kwargs` is not empty; the message names them and the arguments taken.
    """
    if kwargs:
        raise ValueError(
            f"GradientAccumulator got unknown arguments: {sorted(kwargs)}. "
            "It takes `optimizer`, `accum_steps`, `partial_window`, `schedulable`, "
            "`measure_noise_scale`, `noise_scale_smoothing`, `merge_duplicate_rows`, `loss_reduction`, "
            "`max_effective_batch_size`, `lr_scaling` (with accum_steps='auto'), `micro_batch_size` and `name`"
            + (f"; {advice}" if advice else ".")
        )


# ------------------------------------------------------------------ the options
@dataclasses.dataclass(frozen=True)
class WindowOptions:
    """Every option of a `GradientAccumulator`'s windows, checked once, frozen.

    `GradientAccumulator(optimizer, options=WindowOptions(accum_steps=4))` is
    `GradientAccumulator(optimizer, accum_steps=4)`; the wrapper's `options` is the
    object it was built with. Building one raises, naming the parameter and the
    values it allows, for any value the accumulator would refuse.

    `accum_steps="auto"` is resolved here: the fields then say what it trains
    with (`accum_steps=2`, `schedulable=True`, `measure_noise_scale=True`), and
    `auto` is True; `get_config()` still writes `"accum_steps": "auto"`, so a
    saved model loads as it was made.

    Attributes:
        accum_steps: micro-batches per window, an int >= 1 (1 without
            `schedulable`: a pass-through), or "auto" when building (resolved to
            2, the window `fit` then grows with the measured noise scale).
        partial_window: what epoch ends and the end of `fit` do with an open
            window: "apply" (one update from what it holds), "carry" (keep it
            open) or "drop" (discard it).
        schedulable: True or False: keep the accumulating path at
            `accum_steps=1`, so a schedule can change it.
        measure_noise_scale: True or False: estimate the gradient noise scale
            from each window's micro-batches (needs windows of two or more
            micro-batches, and a loss that is a mean).
        noise_scale_smoothing: the decay of the noise scale's moving averages,
            a float in [0, 1) (0.99: about 100 windows).
        merge_duplicate_rows: True or False: sum a sparse gradient's rows per
            index before the inner optimizer (False: one row per lookup, as
            Keras' large batch).
        loss_reduction: "auto", "mean" or "sum": how the loss reduces over its
            samples.
        max_effective_batch_size: with accum_steps="auto" only (and needed
            then): the effective batch, in samples per update, it may grow to,
            an int >= 2; None otherwise.
        lr_scaling: with accum_steps="auto" only: "none", "linear" or "sqrt",
            the learning-rate rule as the effective batch grows.
        auto: True when built with accum_steps="auto" (set by it; a copy made
            by `dataclasses.replace` keeps it).
        micro_batch_size: None, an int >= 1, or "auto": `fit`'s batch is the effective
            batch, one update, trained as ceil(len / micro_batch_size)
            micro-batches inside one training step (`accumulator.batch.fit_micro_batches`);
            "auto": the largest that fits, found by the run (`accumulator.batch.fit_auto_micro_batch`).
            Not with `accum_steps` > 1, "auto", `schedulable` or
            `measure_noise_scale` (the window counts micro-batches across steps;
            here one step holds them all). An int: Keras 3 and Keras 2, under
            strategies and mixed precision (Keras 3); "auto": Keras 3, one device.

    Raises:
        TypeError: `accum_steps` is not an integer or "auto".
        ValueError: an option is out of its allowed values (the message names it and
            them), `measure_noise_scale` with windows of 1 or a summed loss, or a
            setting of "auto" without it.
    """

    accum_steps: Union[int, str] = 1
    partial_window: str = "apply"
    schedulable: bool = False
    measure_noise_scale: bool = False
    noise_scale_smoothing: float = DEFAULT_SMOOTHING
    merge_duplicate_rows: bool = False
    loss_reduction: str = "auto"
    max_effective_batch_size: Optional[int] = None
    lr_scaling: str = "none"
    auto: bool = False
    micro_batch_size: Optional[Union[int, str]] = None

    def __post_init__(self):
        given = AUTO if self._resolved_auto() else self.accum_steps
        auto = validate_auto(given, self.max_effective_batch_size, self.lr_scaling)
        if auto is not None:
            # Starts at 2 micro-batches (the noise scale needs windows of several),
            # schedulable (the window's size changes) and measuring.
            self._set(accum_steps=AUTO_START_ACCUM_STEPS, schedulable=True, measure_noise_scale=True,
                      auto=True, max_effective_batch_size=auto["max_effective_batch_size"])
        self._set(accum_steps=validate_accum_steps(self.accum_steps),
                  loss_reduction=validate_loss_reduction(self.loss_reduction),
                  merge_duplicate_rows=validate_merge_duplicate_rows(self.merge_duplicate_rows),
                  partial_window=validate_partial_window(self.partial_window),
                  measure_noise_scale=validate_measure_noise_scale(self.measure_noise_scale),
                  noise_scale_smoothing=validate_smoothing(self.noise_scale_smoothing, "noise_scale_smoothing"),
                  schedulable=bool(self.schedulable),
                  micro_batch_size=validate_micro_batch_size(self.micro_batch_size))
        self._check_consistent()

    def _resolved_auto(self) -> bool:
        # `auto=True` comes from a resolved "auto" (a `dataclasses.replace` copy): take it as "auto" again.
        if not self.auto:
            return False
        if self.accum_steps not in (AUTO, AUTO_START_ACCUM_STEPS):
            raise ValueError("`auto` is set by accum_steps='auto' (which starts at "
                             f"{AUTO_START_ACCUM_STEPS}); received auto=True with accum_steps={self.accum_steps!r}. "
                             "Pass accum_steps='auto' instead.")
        return True

    def _set(self, **values):
        """Sets fields of the frozen dataclass (while it is being built)."""
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _check_consistent(self):
        """Refuses options that are valid alone but not together."""
        if self.measure_noise_scale and self.accum_steps == 1 and not self.schedulable:
            raise ValueError(
                "`measure_noise_scale=True` needs windows of several micro-batches: the "
                "noise scale compares the micro-batches' gradients with their window's, "
                "and `accum_steps=1` (without `schedulable=True`) makes a pass-through "
                "with windows of 1, which give no estimate. Use accum_steps >= 2."
            )
        if self.measure_noise_scale and self.loss_reduction == "sum":
            raise ValueError(SUMMED_NOISE_SCALE_MESSAGE)
        if self.micro_batch_size is not None and (self.auto or self.accum_steps != 1 or self.schedulable
                                                  or self.measure_noise_scale):
            given = "'auto'" if self.auto else self.accum_steps
            raise ValueError(
                "`micro_batch_size` and `accum_steps` are two ways to say the same thing: pass one. "
                f"Received micro_batch_size={self.micro_batch_size} with accum_steps={given}, "
                f"schedulable={self.schedulable}, measure_noise_scale={self.measure_noise_scale}. With "
                "`micro_batch_size`, `fit`'s batch is the effective batch and each training step "
                "splits it; with `accum_steps`, `fit`'s batch is the micro-batch and N steps make a "
                "window. `micro_batch_size` takes accum_steps=1 and no schedule or noise scale.")

    @property
    def is_passthrough(self) -> bool:
        """`accum_steps=1` without `schedulable`: no buffers, no windows (also with
        `micro_batch_size`: `fit`'s step sums the micro-batches, the optimizer updates once)."""
        return self.accum_steps == 1 and not self.schedulable

    @property
    def auto_settings(self) -> Optional[Dict[str, Any]]:
        """{"max_effective_batch_size", "lr_scaling"} with accum_steps="auto", else None."""
        if not self.auto:
            return None
        return {"max_effective_batch_size": self.max_effective_batch_size, "lr_scaling": self.lr_scaling}

    def get_config(self) -> Dict[str, Any]:
        """The keyword arguments that rebuild these options (what a saved optimizer holds)."""
        if self.auto:
            return {"accum_steps": AUTO, **self.auto_settings, "partial_window": self.partial_window,
                    "noise_scale_smoothing": self.noise_scale_smoothing,
                    "merge_duplicate_rows": self.merge_duplicate_rows, "loss_reduction": self.loss_reduction}
        config = {
            "accum_steps": self.accum_steps,
            "partial_window": self.partial_window,
            "schedulable": self.schedulable,
            "measure_noise_scale": self.measure_noise_scale,
            "noise_scale_smoothing": self.noise_scale_smoothing,
            "merge_duplicate_rows": self.merge_duplicate_rows,
            "loss_reduction": self.loss_reduction,
        }
        if self.micro_batch_size is not None:
            config["micro_batch_size"] = self.micro_batch_size
        return config

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "WindowOptions":
        """The options `get_config()` wrote.

        Args:
            config: `get_config()`'s dict, or any of its keyword arguments.

        Returns:
            The `WindowOptions`.

        Raises:
            TypeError, ValueError: as the constructor.
        """
        return cls(**config)

    @classmethod
    def from_arguments(cls, options: Optional["WindowOptions"] = None, **arguments: Any) -> "WindowOptions":
        """`options`, or the options `arguments` (the accumulator's keywords) make; not both.

        Args:
            options: the options given as an object, or None.
            **arguments: the options given as keywords (their defaults when unused).

        Returns:
            The `WindowOptions`.

        Raises:
            TypeError: `options` is not a `WindowOptions`.
            ValueError: `options` given with keywords that differ from their defaults.
        """
        if options is None:
            return cls(**arguments)
        if not isinstance(options, WindowOptions):
            raise TypeError(f"`options` must be a WindowOptions; received {options!r} of type "
                            f"{type(options).__name__}.")
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        given = sorted(name for name, value in arguments.items()
                       if type(value) is not type(defaults[name]) or value != defaults[name])
        if given:
            raise ValueError(f"Pass the window's options as `options` or as keywords, not both; received "
                             f"`options` and {given}.")
        return options


@dataclasses.dataclass(frozen=True)
class CacheOptions:
    """The options of a `GradientCache`, checked once, frozen.

    Attributes:
        accum_steps: micro-batches per batch, an int >= 1.
        gather_across_replicas: True or False: under a strategy, score the whole
            global batch on every replica (Keras 3 models with their own
            `compute_loss` only; the model is checked by `GradientCache`).

    Raises:
        TypeError: `accum_steps` is not an integer, or `gather_across_replicas` not a bool.
        ValueError: `accum_steps` < 1.
    """

    accum_steps: int = 1
    gather_across_replicas: bool = False

    def __post_init__(self):
        object.__setattr__(self, "accum_steps", validate_accum_steps(self.accum_steps))
        if not isinstance(self.gather_across_replicas, bool):
            raise TypeError("GradientCache: `gather_across_replicas` must be True or False; "
                            f"received {self.gather_across_replicas!r}.")
