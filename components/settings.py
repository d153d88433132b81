"""Accumulation settings of a training run: resolved, validated, then frozen.

Precedence: the hyperparameters artifact (the Tuner's best) over the
component's parameters over the defaults. Everything is checked here, before
any training starts, so a bad value fails the component with a message that
names it.
"""

import dataclasses
from typing import Any, Dict, Optional

from accumulator import validate_accum_steps
from accumulator.callbacks import accum_steps_at, validate_schedule
from accumulator.noise_scale import DEFAULT_SMOOTHING, validate_smoothing
from accumulator.optimizer import validate_measure_noise_scale, validate_partial_window
from accumulator.window import validate_merge_duplicate_rows
from accumulator.validation import integer_at_least

ACCUM_STEPS = "accum_steps"
EFFECTIVE_BATCH_SIZE = "effective_batch_size"
MEASURE_NOISE_SCALE = "measure_noise_scale"
NOISE_SCALE_SMOOTHING = "noise_scale_smoothing"


@dataclasses.dataclass(frozen=True)
class AccumulationSettings:
    """accum_steps, effective batch and replicas of one run, and what follows."""

    accum_steps: int
    effective_batch_size: Optional[int]
    replicas: int
    schedule: Optional[Dict[int, int]] = None
    partial_window: str = "apply"
    sources: Dict[str, str] = dataclasses.field(default_factory=dict, compare=False)
    measure_noise_scale: bool = False
    noise_scale_smoothing: float = DEFAULT_SMOOTHING
    merge_duplicate_rows: bool = False

    @property
    def micro_batch(self) -> Optional[int]:
        """Global micro-batch (over all replicas), or None: the run_fn's own."""
        if self.effective_batch_size is None:
            return None
        return self.effective_batch_size // self.accum_steps

    @property
    def micro_batch_per_replica(self) -> Optional[int]:
        return None if self.micro_batch is None else self.micro_batch // self.replicas

    def compile_arguments(self) -> Dict[str, Any]:
        """The arguments of `accumulator.autowrap.accumulating_compile` for this run."""
        return {
            "accum_steps": self.accum_steps,
            "schedule": self.schedule,
            "partial_window": self.partial_window,
            "measure_noise_scale": self.measure_noise_scale,
            "noise_scale_smoothing": self.noise_scale_smoothing,
            "merge_duplicate_rows": self.merge_duplicate_rows,
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
        }


def hyperparameter_values(hyperparameters: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Values from a KerasTuner `HyperParameters.get_config()` dict (or a plain dict)."""
    if not hyperparameters:
        return {}
    if "values" in hyperparameters and isinstance(hyperparameters["values"], dict):
        return dict(hyperparameters["values"])
    return dict(hyperparameters)


def resolve(
    hyperparameters: Optional[Dict[str, Any]],
    accum_steps: Optional[int],
    effective_batch_size: Optional[int],
    replicas: int,
    schedule: Optional[Dict[Any, int]] = None,
    partial_window: Optional[str] = None,
    measure_noise_scale: Optional[bool] = None,
    noise_scale_smoothing: Optional[float] = None,
    merge_duplicate_rows: Optional[bool] = None,
) -> AccumulationSettings:
    """Resolves and validates the settings of one run.

    With a `schedule` ({epoch: accum_steps}), `accum_steps` is the schedule's
    value at epoch 0, the micro-batch stays fixed, and the effective batch is
    that of epoch 0. `partial_window` (default "apply") is what epoch and
    training ends do with an open window (see `GradientAccumulator`).
    `measure_noise_scale` (default False) and `noise_scale_smoothing` (default
    0.99) follow the same precedence as `accum_steps`; measuring needs windows
    of two or more micro-batches: `accum_steps >= 2`, or a schedule that
    reaches 2. `merge_duplicate_rows` (default False) is the component's alone.
    """
    partial_window = validate_partial_window(partial_window or "apply")
    values = hyperparameter_values(hyperparameters)
    sources = {}
    if schedule is not None:
        schedule = validate_schedule(schedule)
        accum_steps = accum_steps_at(schedule, 0)
        values = {k: v for k, v in values.items() if k != ACCUM_STEPS}

    def pick(name, parameter, default):
        if values.get(name) is not None:
            sources[name] = "hyperparameters"
            return values[name]
        if parameter is not None:
            sources[name] = "component parameter"
            return parameter
        sources[name] = "default"
        return default

    accum = validate_accum_steps(pick(ACCUM_STEPS, accum_steps, 1), name=ACCUM_STEPS)
    effective = pick(EFFECTIVE_BATCH_SIZE, effective_batch_size, None)
    if effective is not None:
        effective = integer_at_least(effective, EFFECTIVE_BATCH_SIZE)
        if effective % (accum * replicas):
            raise ValueError(
                f"`{EFFECTIVE_BATCH_SIZE}` ({effective}, from {sources[EFFECTIVE_BATCH_SIZE]}) "
                f"must divide evenly into `{ACCUM_STEPS}` ({accum}) x replicas ({replicas}) "
                f"= {accum * replicas} micro-batches per replica; try "
                f"{(effective // (accum * replicas) or 1) * accum * replicas}."
            )
    if schedule is not None:
        sources[ACCUM_STEPS] = "schedule"
    measure = validate_measure_noise_scale(
        pick(MEASURE_NOISE_SCALE, measure_noise_scale, False), name=MEASURE_NOISE_SCALE)
    smoothing = validate_smoothing(
        pick(NOISE_SCALE_SMOOTHING, noise_scale_smoothing, DEFAULT_SMOOTHING), name=NOISE_SCALE_SMOOTHING)
    if measure and max(schedule.values() if schedule else [accum]) < 2:
        where = ("`accum_schedule` never goes above 1" if schedule else
                 f"`{ACCUM_STEPS}` is 1 (from {sources[ACCUM_STEPS]})")
        raise ValueError(
            f"`{MEASURE_NOISE_SCALE}=True` (from {sources[MEASURE_NOISE_SCALE]}) needs windows of "
            f"two or more micro-batches, but {where}: the noise scale compares each "
            f"micro-batch's gradient with its window's. Set `{ACCUM_STEPS}` >= 2 (or a schedule "
            f"that reaches it), or leave `{MEASURE_NOISE_SCALE}` off."
        )
    # Stored as an int (0/1) by the pipeline; unset means False.
    merge = merge_duplicate_rows if merge_duplicate_rows is not None else False
    merge = validate_merge_duplicate_rows(bool(merge) if merge in (0, 1) else merge, name="merge_duplicate_rows")
    return AccumulationSettings(accum, effective, replicas, schedule, partial_window, sources,
                                measure, smoothing, merge)
