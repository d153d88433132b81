"""Accumulation settings of a training run: resolved, validated, then frozen (`resolve`).

Precedence: the hyperparameters artifact (the Tuner's best) over the component's
parameters over the defaults. Everything is checked here, by the same rules twice: when
the pipeline is defined, every value known then (`check_when_defined`, which the
component calls), and when the executor starts, with the tuned values, RuntimeParameters
and replicas (`resolve`), so a bad value fails with a message that names it before any
training starts. Also what
`gradient_cache=True` and `micro_batch_size` change: the batch the run_fn reads, steps
per update, and what they refuse.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Dict, Optional, Union

from tfx.orchestration import data_types

from tfx_gradient_accumulator.accumulator.schedules.auto_batch import AutoAccumulation
from tfx_gradient_accumulator.accumulator.schedules.callbacks import accum_steps_at
from tfx_gradient_accumulator.accumulator.core.options import (
    AUTO, AUTO_START_ACCUM_STEPS, DEFAULT_SMOOTHING, FIT, WindowOptions, integer_at_least, validate_accum_steps,
    validate_bool, validate_lr_ramp_updates, validate_lr_scaling, validate_measure_noise_scale,
    validate_partial_window, validate_schedule, validate_schedule_by, validate_smoothing,
)
from tfx_gradient_accumulator.accumulator.core.distribute import KINDS
from tfx_gradient_accumulator.components.exactness import validate_mode as exactness_mode
from tfx_gradient_accumulator.components.trainer_options import TrainerOptions

ACCUM_STEPS = "accum_steps"
EFFECTIVE_BATCH_SIZE = "effective_batch_size"
MEASURE_NOISE_SCALE = "measure_noise_scale"
NOISE_SCALE_SMOOTHING = "noise_scale_smoothing"
GRADIENT_CACHE = "gradient_cache"
GATHER_ACROSS_REPLICAS = "gather_across_replicas"
MAX_EFFECTIVE_BATCH_SIZE = "max_effective_batch_size"
LR_RAMP_UPDATES = "lr_ramp_updates"
MICRO_BATCH_SIZE = "micro_batch_size"
STRATEGY_CHOICES = ("auto",) + KINDS
# accum_steps="fit" (`options.FIT`): the micro-batch that fits the device, found before
# training (`components.micro_batch_fit`), splits the effective batch.


@dataclasses.dataclass(frozen=True)
class AccumulationSettings:
    """accum_steps, effective batch and replicas of one run, and what follows.

    The Trainer's settings: the wrappers' `WindowOptions` (`window_options`) and
    what only the Trainer has (the effective batch, replicas, the schedule,
    `gradient_cache`, where each value came from)."""

    accum_steps: int
    effective_batch_size: Optional[int]
    replicas: int
    schedule: Optional[Dict[int, int]] = None
    partial_window: str = "apply"
    sources: Dict[str, str] = dataclasses.field(default_factory=dict, compare=False)
    measure_noise_scale: bool = False
    noise_scale_smoothing: float = DEFAULT_SMOOTHING
    merge_duplicate_rows: bool = False
    gradient_cache: bool = False
    schedule_by: str = "epoch"
    lr_scaling: str = "none"
    max_effective_batch_size: Optional[int] = None      # set: accum_steps="auto"
    gather_across_replicas: bool = False                 # only with gradient_cache
    lr_ramp_updates: int = 0                             # "auto" or a schedule by update
    fit_to_device: bool = False                          # accum_steps="fit"
    fitted: Any = dataclasses.field(default=None, compare=False)   # what the fit found (MicroBatchFit)
    # micro_batch_size=b (an int, or "auto"): the run_fn's batch is the effective batch, each
    # `fit` step one update, split into micro-batches of b inside the step; None: off.
    micro_batch_size: Optional[Union[int, str]] = None

    @property
    def splits_in_step(self) -> bool:
        """`micro_batch_size` is set: `fit`'s batch is the effective batch, one update per step."""
        return self.micro_batch_size is not None

    @property
    def auto(self) -> bool:
        """`accum_steps="auto"`: the window starts at 2 and grows with the noise scale."""
        return self.max_effective_batch_size is not None

    @property
    def micro_batch(self) -> Optional[int]:
        """Global micro-batch (over all replicas), or None: the run_fn's own, or with
        `micro_batch_size="auto"` the one the run finds (known only after training)."""
        if self.splits_in_step:
            return None if self.micro_batch_size == AUTO else self.micro_batch_size
        if self.effective_batch_size is None:
            return None
        return self.effective_batch_size // self.accum_steps

    @property
    def train_batch(self) -> Optional[int]:
        """Global batch of the training datasets the run_fn reads, or None: the run_fn's
        own. The micro-batch, or with `gradient_cache` the effective batch (the model
        cuts it into micro-batches; with `micro_batch_size`, each step cuts it)."""
        return self.effective_batch_size if self.gradient_cache or self.splits_in_step else self.micro_batch

    @property
    def steps_per_update(self) -> int:
        """`fit` steps per optimizer update: `accum_steps`, or 1 with `gradient_cache` or
        `micro_batch_size`."""
        return 1 if self.gradient_cache or self.splits_in_step else self.accum_steps

    @property
    def micro_batch_per_replica(self) -> Optional[int]:
        """The micro-batch each replica reads, or None."""
        return None if self.micro_batch is None else self.micro_batch // self.replicas

    @property
    def window_options(self) -> WindowOptions:
        """The options of the run's `GradientAccumulator`s (schedulable with a schedule or "auto")."""
        return WindowOptions(
            accum_steps=self.accum_steps, partial_window=self.partial_window,
            schedulable=self.schedule is not None or self.auto or self.fit_to_device, measure_noise_scale=self.measure_noise_scale,
            noise_scale_smoothing=self.noise_scale_smoothing, merge_duplicate_rows=self.merge_duplicate_rows,
            **({MICRO_BATCH_SIZE: self.micro_batch_size} if self.splits_in_step else {}))

    def compile_arguments(self) -> Dict[str, Any]:
        """The arguments of `accumulator.autowrap.accumulating_compile` for this run."""
        return {
            "options": self.window_options,
            "schedule": self.schedule,
            "gradient_cache": self.gradient_cache,
            "gather_across_replicas": self.gather_across_replicas,
            "schedule_by": self.schedule_by,
            "lr_scaling": self.lr_scaling,
            # The same ramp for "auto" and a schedule: the record (`accum_schedule_taken`,
            # `lr_ramp_updates`) replays exactly as a schedule by update.
            "lr_ramp_updates": 0 if self.auto else self.lr_ramp_updates,
            "auto": ({"micro_batch_size": self.micro_batch,
                      "max_effective_batch_size": self.max_effective_batch_size,
                      "lr_ramp_updates": self.lr_ramp_updates} if self.auto else None),
        }

    def as_properties(self) -> Dict[str, int]:
        """The integers recorded on the output artifacts (0: not set)."""
        return {
            "accum_steps": self.accum_steps,
            "micro_batch_size": self.micro_batch or 0,
            "replicas": self.replicas,
            "effective_batch_size": self.effective_batch_size or 0,
            "measure_noise_scale": int(self.measure_noise_scale),
            "merge_duplicate_rows": int(self.merge_duplicate_rows),
            "gradient_cache": int(self.gradient_cache),
            "accum_steps_auto": int(self.auto),
            "max_effective_batch_size": self.max_effective_batch_size or 0,
            "gather_across_replicas": int(self.gather_across_replicas),
            "lr_ramp_updates": self.lr_ramp_updates,
            "accum_steps_fit": int(self.fit_to_device),
            **({"largest_fitting_micro_batch": self.fitted.largest_fitting} if self.fitted else {}),
            # micro_batch_size: b given (0 with "auto", whose b is recorded after training).
            **({"micro_batch_size_auto": int(self.micro_batch_size == AUTO)} if self.splits_in_step else {}),
        }


def hyperparameter_values(hyperparameters: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """The values of a KerasTuner `HyperParameters.get_config()` dict (or a plain dict).

    Args:
        hyperparameters: the dict, or None.

    Returns:
        `{name: value}` (empty for None).
    """
    if not hyperparameters:
        return {}
    if "values" in hyperparameters and isinstance(hyperparameters["values"], dict):
        return dict(hyperparameters["values"])
    return dict(hyperparameters)


def resolve(
    hyperparameters: Optional[Dict[str, Any]],
    accum_steps: Optional[Union[int, str]],
    effective_batch_size: Optional[int],
    replicas: int,
    options: Optional[TrainerOptions] = None,
    micro_batch_size: Optional[Union[int, str]] = None,
) -> AccumulationSettings:
    """Resolves and validates one run's settings: the Tuner's values over the component's over defaults.

    Args:
        hyperparameters: the Tuner's best (`HyperParameters.get_config()`), or None.
        accum_steps: the component's `accum_steps` (an int, "auto", "fit" or None).
        effective_batch_size: the component's, or None.
        replicas: the replicas of the run's strategy, over all workers.
        options: the component's `TrainerOptions` (None: every option off); a field left
            None takes its default. `backup_dir`, `backup_every` and `verify_exactness`
            are not read here (`check_when_defined` checks them).
        micro_batch_size: None, an int >= 1 or "auto": the batch split inside each step
            instead of by `accum_steps` (`micro_batch_setting`, `micro_batch_for_the_run`).

    Returns:
        The frozen `AccumulationSettings`.

    Raises:
        ValueError: a value out of its allowed values, or values that do not go together;
            each message names the parameter and where its value came from.
        TypeError: a count that is not an integer.
    """
    o = options or TrainerOptions()
    partial_window = validate_partial_window(o.partial_window or "apply")
    cache = boolean_parameter(o.gradient_cache, GRADIENT_CACHE)
    gather = gather_setting(o.gather_across_replicas, cache)
    schedule_by = validate_schedule_by(o.accum_schedule_by or "epoch", "accum_schedule_by")
    lr_scaling = validate_lr_scaling(o.lr_scaling or "none")
    schedule, values = o.accum_schedule, hyperparameter_values(hyperparameters)
    micro_batch_size, values = micro_batch_setting(micro_batch_size, values, accum_steps, schedule, cache,
                                                   partial_window, o.measure_noise_scale, o.max_effective_batch_size)
    fit, accum_steps, values = fit_setting(accum_steps, effective_batch_size, values, schedule, cache)
    accum_steps, max_effective_batch_size = tuned_auto(accum_steps, values, schedule, o.max_effective_batch_size)
    auto = accum_steps == AUTO
    refuse_what_auto_excludes(accum_steps, schedule, cache, max_effective_batch_size)
    if auto or schedule is not None:      # the window's start, not a tuned or given accum_steps
        schedule = None if auto else validate_schedule(schedule)
        accum_steps = AUTO_START_ACCUM_STEPS if auto else accum_steps_at(schedule, 0)
        values = {k: v for k, v in values.items() if k != ACCUM_STEPS}
    sources = {}
    pick = functools.partial(_pick, values, sources)
    accum = validate_accum_steps(pick(ACCUM_STEPS, accum_steps, 1), name=ACCUM_STEPS)
    effective = effective_batch(pick(EFFECTIVE_BATCH_SIZE, effective_batch_size, None), accum, replicas, sources)
    if schedule is not None or fit or auto:
        sources[ACCUM_STEPS] = AUTO if auto else "schedule" if schedule is not None else FIT
    if auto:
        max_effective_batch_size = auto_limit(effective, max_effective_batch_size)
    measure = validate_measure_noise_scale(
        pick(MEASURE_NOISE_SCALE, o.measure_noise_scale, False), name=MEASURE_NOISE_SCALE) or auto
    smoothing = validate_smoothing(
        pick(NOISE_SCALE_SMOOTHING, o.noise_scale_smoothing, DEFAULT_SMOOTHING), name=NOISE_SCALE_SMOOTHING)
    merge = boolean_parameter(o.merge_duplicate_rows, "merge_duplicate_rows")
    if cache:
        refuse_with_gradient_cache(schedule, {"partial_window": partial_window, MEASURE_NOISE_SCALE: measure,
                                              "merge_duplicate_rows": merge}, sources.get(MEASURE_NOISE_SCALE))
    if micro_batch_size is not None:
        micro_batch_size = micro_batch_for_the_run(micro_batch_size, effective, replicas, sources, measure)
    elif measure:
        refuse_measuring_without_windows(schedule, accum, sources)
    return AccumulationSettings(accum, effective, replicas, schedule, partial_window, sources,
                                measure, smoothing, merge, cache, schedule_by, lr_scaling, max_effective_batch_size,
                                gather, ramp_setting(o.lr_ramp_updates, auto, schedule, schedule_by, accum),
                                fit_to_device=fit, micro_batch_size=micro_batch_size)


def _pick(values: Dict[str, Any], sources: Dict[str, str], name: str, parameter, default):
    """A setting's value: the hyperparameters', else the component's, else the default;
    where it came from goes into `sources` (for the messages and the record)."""
    if values.get(name) is not None:
        sources[name] = "hyperparameters"
        return values[name]
    if parameter is not None:
        sources[name] = "component parameter"
        return parameter
    sources[name] = "default"
    return default


def tuned_auto(accum_steps, values: Dict[str, Any], schedule, max_effective_batch_size):
    """`(accum_steps, max_effective_batch_size)`: "auto" and its limit when the Tuner's
    values ask for it (`AccumulatingHyperModel(accum_steps="auto")`), else as given."""
    if values.get(ACCUM_STEPS) == AUTO and schedule is None:
        if values.get(MAX_EFFECTIVE_BATCH_SIZE) is not None:
            max_effective_batch_size = values[MAX_EFFECTIVE_BATCH_SIZE]
        return AUTO, max_effective_batch_size
    return accum_steps, max_effective_batch_size


def effective_batch(effective: Optional[int], accum: int, replicas: int, sources: Dict[str, str]) -> Optional[int]:
    """The effective batch, checked: an int >= 1 that `accum` micro-batches on each replica divide.

    Raises:
        ValueError: it does not divide; the message says where it came from and a value that does.
    """
    if effective is None:
        return None
    effective = integer_at_least(effective, EFFECTIVE_BATCH_SIZE)
    if effective % (accum * replicas):
        raise ValueError(
            f"`{EFFECTIVE_BATCH_SIZE}` ({effective}, from {sources[EFFECTIVE_BATCH_SIZE]}) "
            f"must divide evenly into `{ACCUM_STEPS}` ({accum}) x replicas ({replicas}) "
            f"= {accum * replicas} micro-batches per replica; try "
            f"{(effective // (accum * replicas) or 1) * accum * replicas}."
        )
    return effective


def auto_limit(effective: Optional[int], max_effective_batch_size) -> int:
    """`accum_steps="auto"`'s limit, checked: an int >= the effective batch it starts from.

    Raises:
        ValueError: no effective batch, or no limit, or a limit below the effective batch.
    """
    if effective is None:
        raise ValueError(f"`{ACCUM_STEPS}={AUTO!r}` needs `{EFFECTIVE_BATCH_SIZE}`, the effective batch to "
                         f"start from (2 micro-batches of half of it).")
    if max_effective_batch_size is None:
        raise ValueError(f"`{ACCUM_STEPS}={AUTO!r}` needs `{MAX_EFFECTIVE_BATCH_SIZE}` (an int >= "
                         f"`{EFFECTIVE_BATCH_SIZE}`, {effective}): the largest effective batch to grow to.")
    return integer_at_least(max_effective_batch_size, MAX_EFFECTIVE_BATCH_SIZE, effective)


def check_when_defined(accum_steps, effective_batch_size, micro_batch_size, strategy, options: TrainerOptions,
                       tuned: bool) -> None:
    """Checks, when the pipeline is defined, every value known then, by the executor's own rules.

    A RuntimeParameter is checked when the run starts; so are the replicas (1 here), and,
    with a `hyperparameters` input (`tuned`), whatever tuned values may change.

    Args:
        accum_steps, effective_batch_size, micro_batch_size, strategy: the component's.
        options: the component's `TrainerOptions`.
        tuned: whether a `hyperparameters` input brings values that win.

    Raises:
        ValueError, TypeError: as `resolve`; also `strategy` out of `STRATEGY_CHOICES`, a
            `backup_dir` that is no non-empty path, a `backup_every` < 1, a
            `verify_exactness` other than True, False or "refuse".
    """
    known = options.known_when_defined()
    if accum_steps == AUTO and known.accum_schedule is not None:
        raise ValueError(f"`{ACCUM_STEPS}={AUTO!r}` makes its own schedule: leave `accum_schedule` unset.")
    if known.accum_schedule is not None:
        validate_schedule(known.accum_schedule)
    # Whether measuring has windows, or a ramp a change of the batch, may depend on tuned values.
    measure = None if tuned else known.measure_noise_scale
    ramp = None if tuned and known.accum_schedule is None else known.lr_ramp_updates
    effective_later = isinstance(effective_batch_size, data_types.RuntimeParameter) or (
        effective_batch_size is None and tuned)
    micro = _micro_batch_when_defined(micro_batch_size, _known(accum_steps), effective_later, known)
    _check_backup_and_strategy(known.backup_dir, known.backup_every, strategy)
    exactness_mode(known.verify_exactness)
    schedule = known.accum_schedule if measure or known.gradient_cache or ramp is not None else None
    resolve(None, _known(accum_steps), _known(effective_batch_size), replicas=1, micro_batch_size=micro,
            options=dataclasses.replace(known, measure_noise_scale=measure, lr_ramp_updates=ramp,
                                        accum_schedule=schedule))


def _known(value):
    """`value`, or None for a RuntimeParameter (known when the run starts)."""
    return None if isinstance(value, data_types.RuntimeParameter) else value


def _micro_batch_when_defined(micro_batch_size, accum_steps, effective_later: bool, known: TrainerOptions):
    """`micro_batch_size` checked against what it excludes (`micro_batch_setting`); returned
    for `resolve`, or None when it is a RuntimeParameter (checked when the run starts) or
    when the effective batch it needs may come later (a RuntimeParameter, or tuned)."""
    if micro_batch_size is None or isinstance(micro_batch_size, data_types.RuntimeParameter):
        return None
    micro_batch_setting(
        micro_batch_size, {}, accum_steps=accum_steps, schedule=known.accum_schedule,
        gradient_cache=known.gradient_cache, partial_window=known.partial_window,
        max_effective_batch_size=known.max_effective_batch_size, measure_noise_scale=known.measure_noise_scale)
    return None if effective_later else micro_batch_size


def _check_backup_and_strategy(backup_dir, backup_every, strategy) -> None:
    """`backup_dir` (a non-empty path), `backup_every` (an int >= 1) and `strategy` (one of
    `STRATEGY_CHOICES`), where they are known when the pipeline is defined (None: not set,
    or a RuntimeParameter; `preemption.backup_for` checks those when the run starts)."""
    if backup_dir is not None and (not isinstance(backup_dir, str) or not backup_dir.strip()):
        raise ValueError(f"`backup_dir` must be a non-empty path (local or gs://) or None; "
                         f"received {backup_dir!r}.")
    if backup_every is not None:
        integer_at_least(backup_every, "backup_every")
    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"`strategy` must be one of {STRATEGY_CHOICES}; received {strategy!r}.")


def refuse_what_auto_excludes(accum_steps, schedule, cache: bool, max_effective_batch_size) -> None:
    """Refuses a string `accum_steps` other than "auto" (after "fit" was taken), "auto" with a
    schedule or `gradient_cache`, and `max_effective_batch_size` without "auto".

    Raises:
        ValueError: the message names the parameters.
    """
    auto = accum_steps == AUTO
    if accum_steps is not None and isinstance(accum_steps, str) and not auto:
        raise ValueError(f"`{ACCUM_STEPS}` must be an int >= 1, {AUTO!r} or {FIT!r}; received {accum_steps!r}.")
    if auto and schedule is not None:
        raise ValueError(f"`{ACCUM_STEPS}={AUTO!r}` makes its own schedule: leave `accum_schedule` unset.")
    if auto and cache:
        raise ValueError(f"`{ACCUM_STEPS}={AUTO!r}` is not supported with `{GRADIENT_CACHE}=True`: GradientCache "
                         "has no windows and measures no noise scale. Set an int `accum_steps`.")
    if not auto and max_effective_batch_size is not None:
        raise ValueError(f"`{MAX_EFFECTIVE_BATCH_SIZE}` is the limit of `{ACCUM_STEPS}={AUTO!r}`; "
                         f"`{ACCUM_STEPS}` is {accum_steps!r}. Set accum_steps='auto', or leave it unset.")


def micro_batch_setting(micro_batch_size, values: Dict[str, Any], accum_steps=None, schedule=None,
                        gradient_cache: bool = False, partial_window: str = "apply", measure_noise_scale=None,
                        max_effective_batch_size=None):
    """`micro_batch_size`, checked against what it cannot go with: `(micro_batch_size, values)`.

    With `micro_batch_size` the effective batch is the one number the run_fn's data are
    batched at; each `fit` step trains it as one update, split into micro-batches of b
    inside the step (`GradientAccumulator(inner, micro_batch_size=b)`). `accum_steps` is
    the other way to split it (the run_fn's batch the micro-batch, N steps an update), so
    the two exclude each other, and so do what only windows across steps have: a schedule,
    "auto"/"fit", `gradient_cache`, the noise scale, `partial_window`. A tuned int
    `accum_steps` (the Tuner's way to split its trials' batches) is dropped: how the batch
    splits is the device's concern, said by `micro_batch_size`; a tuned `effective_batch_size`
    applies.

    Args:
        micro_batch_size: the component's: None, an int >= 1, or "auto".
        values: the hyperparameters' values.
        accum_steps: the component's `accum_steps` (None or 1 go with it).
        schedule, gradient_cache, partial_window, measure_noise_scale, max_effective_batch_size:
            the component's.

    Returns:
        `(micro_batch_size, values)`: None and `values` unchanged without it; else the int or
        "auto", and `values` without a tuned `accum_steps`.

    Raises:
        ValueError: a value other than an int >= 1 or "auto", or a setting it excludes
            (the message names both).
        TypeError: a number that is not an integer.
    """
    if micro_batch_size is None:
        return None, values
    if isinstance(micro_batch_size, str):
        if micro_batch_size != AUTO:
            raise ValueError(f"`{MICRO_BATCH_SIZE}` must be an int >= 1 or {AUTO!r} (found by the run on its "
                             f"device); received {micro_batch_size!r}.")
    else:
        micro_batch_size = integer_at_least(micro_batch_size, MICRO_BATCH_SIZE)
    given = f"`{MICRO_BATCH_SIZE}={micro_batch_size!r}`"
    both = (f"{given} makes the effective batch one `fit` step and splits it inside the step; "
            f"`{ACCUM_STEPS}` splits it into N `fit` steps instead. They are two ways to say how the batch "
            "splits: pass one")
    if accum_steps not in (None, 1):
        raise ValueError(f"{both}. Received {ACCUM_STEPS}={accum_steps!r}: leave `{ACCUM_STEPS}` unset (or 1), "
                         f"or leave `{MICRO_BATCH_SIZE}` unset.")
    if values.get(ACCUM_STEPS) == AUTO:
        raise ValueError(f"{given} keeps the effective batch fixed; the hyperparameters' {ACCUM_STEPS}={AUTO!r} "
                         f"(AccumulatingHyperModel(accum_steps={AUTO!r})) grows it. Tune the effective batch "
                         f"alone, or leave `{MICRO_BATCH_SIZE}` unset.")
    # What each excluded setting needs that a step holding the whole update does not have.
    excluded = {"accum_schedule": (schedule is not None, "a schedule changes windows across `fit` steps"),
                GRADIENT_CACHE: (bool(gradient_cache), "GradientCache splits each batch itself"),
                "partial_window": ((partial_window or "apply") != "apply",
                                   "no window is ever left open to carry or drop"),
                MEASURE_NOISE_SCALE: (bool(measure_noise_scale), "the noise scale is measured over windows of "
                                      "several `fit` steps"),
                MAX_EFFECTIVE_BATCH_SIZE: (max_effective_batch_size is not None,
                                           f"it is the limit of {ACCUM_STEPS}={AUTO!r}, which grows the window")}
    for name, (set_, why) in excluded.items():
        if set_:
            raise ValueError(
                f"{given} does not go with `{name}`: each `fit` step is one whole update, and {why}. Leave "
                f"`{name}` unset, or use `{ACCUM_STEPS}` instead of `{MICRO_BATCH_SIZE}`.")
    return micro_batch_size, {k: v for k, v in values.items() if k != ACCUM_STEPS}


def micro_batch_for_the_run(micro_batch_size, effective: Optional[int], replicas: int, sources: dict,
                            measure: bool):
    """The `micro_batch_size` the run's `GradientAccumulator`s get, once the effective batch is known.

    An int larger than the effective batch trains the batch whole (one micro-batch, not one
    filled up to b with repeated, masked samples): b = min(b, E).

    Args:
        micro_batch_size: the checked int, or "auto".
        effective: the resolved effective batch (needed).
        replicas: the run's replicas: the micro-batch is global, like `fit`'s batch, so
            each replica's loop takes b / replicas samples.
        sources: where each setting came from (for the messages).
        measure: the resolved `measure_noise_scale` (tuned values included).

    Returns:
        The int b (at most E) or "auto".

    Raises:
        ValueError: no effective batch, the noise scale asked for (by the hyperparameters),
            or an int b that the replicas do not divide.
    """
    given = f"`{MICRO_BATCH_SIZE}={micro_batch_size!r}`"
    if effective is None:
        raise ValueError(f"{given} needs `{EFFECTIVE_BATCH_SIZE}` (the component's, or a tuned one): the "
                         "samples per update, the batch the run_fn's training data come at, which each "
                         "`fit` step splits into micro-batches.")
    if measure:
        raise ValueError(f"{given} does not go with `{MEASURE_NOISE_SCALE}=True` (from "
                         f"{sources.get(MEASURE_NOISE_SCALE)}): the noise scale is measured over windows of "
                         f"several `fit` steps, and here each step is one whole update. Leave it off.")
    if micro_batch_size == AUTO:
        return AUTO
    micro_batch_size = min(micro_batch_size, effective)
    if micro_batch_size % replicas:
        raise ValueError(f"{given} is global, like `fit`'s batch: each of the {replicas} replicas takes an "
                         f"equal share, so it must divide by {replicas}; try "
                         f"{max(micro_batch_size // replicas, 1) * replicas}.")
    return micro_batch_size


def fit_setting(accum_steps, effective_batch_size, values: Dict[str, Any], schedule, cache: bool):
    """`accum_steps="fit"`, checked: (whether to fit, the `accum_steps` to resolve, `values`).

    "fit" comes from the component, or from the hyperparameters (tuned with
    `AccumulatingHyperModel(accum_steps="fit")`, which wins over the component's
    `accum_steps`, as hyperparameters do; then the tuned `effective_batch_size`).
    The effective batch is then the one number that matters: the micro-batch that fits
    the device, found before training, splits it (1 until then). So it needs
    `effective_batch_size`, and refuses what sets the window otherwise.

    Args:
        accum_steps: the component's `accum_steps`.
        effective_batch_size: the component's.
        values: the hyperparameters' values (their `accum_steps` is dropped with "fit";
            "fit" there asks for it).
        schedule: the component's `accum_schedule`, or None.
        cache: `gradient_cache`.

    Raises:
        ValueError: "fit" without an effective batch, or with a schedule, "auto" or
            `gradient_cache`.
    """
    tuned = values.get(ACCUM_STEPS) == FIT
    if accum_steps != FIT and not tuned:
        return False, accum_steps, values
    where = " (from hyperparameters: AccumulatingHyperModel(accum_steps='fit'))" if tuned else ""
    if values.get(EFFECTIVE_BATCH_SIZE, effective_batch_size) is None:
        raise ValueError(f"`{ACCUM_STEPS}={FIT!r}`{where} needs `{EFFECTIVE_BATCH_SIZE}`: the samples per "
                         "update, which the micro-batch that fits the device splits.")
    if schedule is not None or cache or values.get(ACCUM_STEPS) == AUTO:
        raise ValueError(f"`{ACCUM_STEPS}={FIT!r}`{where} finds the window's length itself: leave "
                         f"`accum_schedule`, `{GRADIENT_CACHE}` and accum_steps={AUTO!r} unset (received "
                         f"{'accum_schedule' if schedule is not None else GRADIENT_CACHE if cache else AUTO}).")
    return True, 1, {k: v for k, v in values.items() if k != ACCUM_STEPS}


def default_lr_ramp_updates() -> int:
    """`AutoAccumulation`'s own `lr_ramp_updates` default, read from the library (not copied).

    Read at each call, not at import, so the run takes the library's default of the day.

    Returns:
        The default, an int.
    """
    return inspect.signature(AutoAccumulation.__init__).parameters[LR_RAMP_UPDATES].default


def ramp_setting(lr_ramp_updates: int | None, auto: bool, schedule: dict | None, schedule_by: str,
                 accum_steps: int) -> int:
    """The run's learning-rate ramp: only where the batch changes during the run.

    Refused (> 0) with a fixed `accum_steps`, as `max_effective_batch_size` is without
    "auto": nothing would ramp, so a value is a mistake worth naming.

    Args:
        lr_ramp_updates: the component's, or None.
        auto: `accum_steps="auto"`.
        schedule: the run's schedule, or None.
        schedule_by: "epoch" or "update".
        accum_steps: the run's `accum_steps` (for the message).

    Returns:
        The ramp, in updates (None: `AutoAccumulation`'s default with "auto", else 0).

    Raises:
        ValueError: not an int >= 0, or > 0 without "auto" or a schedule, or with a
            schedule by epoch (`options.validate_lr_ramp_updates`).
    """
    if lr_ramp_updates is None:
        return default_lr_ramp_updates() if auto else 0
    ramp = validate_lr_ramp_updates(lr_ramp_updates, changes=auto or schedule is not None, advice=(
        f"it goes with `{ACCUM_STEPS}={AUTO!r}` or an `accum_schedule` by update; `{ACCUM_STEPS}` is "
        f"{accum_steps} with no schedule. Leave `{LR_RAMP_UPDATES}` unset (or 0)."))
    try:
        return validate_lr_ramp_updates(ramp, "update" if auto else schedule_by)
    except ValueError as err:    # the library's rule, in the Trainer's words
        raise ValueError(f"{err} Set `accum_schedule_by='update'`, or leave `{LR_RAMP_UPDATES}` "
                         "unset.") from None


def refuse_measuring_without_windows(schedule: dict | None, accum_steps: int, sources: dict) -> None:
    """Refuses measuring the noise scale unless some window holds two or more micro-batches.

    The noise scale compares each micro-batch's gradient with its window's.

    Args:
        schedule: the run's schedule, or None.
        accum_steps: the run's `accum_steps`.
        sources: where each setting came from, by name (for the message).

    Raises:
        ValueError: no window of two or more micro-batches.
    """
    if max(schedule.values() if schedule else [accum_steps]) >= 2:
        return
    where = ("`accum_schedule` never goes above 1" if schedule else
             f"`{ACCUM_STEPS}` is 1 (from {sources[ACCUM_STEPS]})")
    raise ValueError(
        f"`{MEASURE_NOISE_SCALE}=True` (from {sources[MEASURE_NOISE_SCALE]}) needs windows of "
        f"two or more micro-batches, but {where}: the noise scale compares each "
        f"micro-batch's gradient with its window's. Set `{ACCUM_STEPS}` >= 2 (or a schedule "
        f"that reaches it), or leave `{MEASURE_NOISE_SCALE}` off."
    )


def gather_setting(gather_across_replicas: bool | int | None, gradient_cache: bool) -> bool:
    """`gather_across_replicas`, which only `GradientCache` has.

    Its loss then scores the whole global batch on every replica instead of each share.

    Args:
        gather_across_replicas: the component's (unset: False).
        gradient_cache: the run's `gradient_cache`.

    Returns:
        The setting, a bool.

    Raises:
        ValueError: not a bool (or 0/1), or True without `gradient_cache`.
    """
    gather = boolean_parameter(gather_across_replicas, GATHER_ACROSS_REPLICAS)
    if gather and not gradient_cache:
        raise ValueError(
            f"`{GATHER_ACROSS_REPLICAS}=True` needs `{GRADIENT_CACHE}=True`: it is how GradientCache "
            "scores a loss that couples the batch (in-batch negatives) under a strategy, over the "
            "global batch instead of each replica's share. GradientAccumulator's losses are per "
            "sample and need no gathering. Set both, or leave it off.")
    return gather


def boolean_parameter(value: bool | int | None, name: str) -> bool:
    """A component's True/False parameter.

    Stored as an int (0/1) by the pipeline, as SchemaGen's `infer_feature_shape`.

    Args:
        value: True, False, 0, 1, or None (False).
        name: the parameter's name, for the message.

    Returns:
        The bool.

    Raises:
        ValueError: any other value.
    """
    value = False if value is None else value
    return validate_bool(bool(value) if value in (0, 1) else value, name)


def refuse_with_gradient_cache(schedule: dict | None, window: dict, measure_source: str | None = None) -> None:
    """Refuses what `gradient_cache=True` cannot honour.

    `GradientCache` makes one update of every batch `fit` gives it and holds
    nothing between steps, so the options of `GradientAccumulator`'s windows
    mean nothing there, and the gradient noise scale has no honest estimate.

    Args:
        schedule: the run's schedule, or None.
        window: the window options (`partial_window`, `measure_noise_scale`,
            `merge_duplicate_rows`).
        measure_source: where `measure_noise_scale` came from (for the message).

    Raises:
        ValueError: a schedule, or a window option other than its default; the
            message names it.
    """
    def refuse(what, why):
        raise ValueError(f"{what} is not supported with `{GRADIENT_CACHE}=True`: {why}")

    partial_window = window.get("partial_window", "apply")
    if window.get(MEASURE_NOISE_SCALE):
        refuse(f"`{MEASURE_NOISE_SCALE}=True`" + (f" (from {measure_source})" if measure_source else ""),
               "the noise scale compares each micro-batch's gradient, an independent estimate of "
               "the gradient, with its window's; under GradientCache a micro-batch's gradient is "
               "its share of the whole batch's loss (its negatives are the whole batch), which is "
               f"no such estimate. Leave `{MEASURE_NOISE_SCALE}` off.")
    if schedule is not None:
        refuse("`accum_schedule`",
               "GradientCache trains each batch `fit` gives it as one update, so changing the "
               "effective batch at an epoch would need the dataset's batch to change. Set "
               f"`{ACCUM_STEPS}` (micro-batches per batch) instead.")
    if partial_window != "apply":
        refuse(f"`partial_window={partial_window!r}`",
               "nothing is held between steps (every batch is one whole update), so there is no "
               "open window to carry or drop. Leave `partial_window` at 'apply'.")
    if window.get("merge_duplicate_rows"):
        refuse("`merge_duplicate_rows=True`",
               "it is an option of GradientAccumulator's windows; GradientCache hands the "
               "optimizer the large batch's gradient as Keras' own large batch would (sparse "
               "rows concatenated). Leave `merge_duplicate_rows` off.")
