"""`TrainerOptions`: the `AccumulatingTrainer`'s less common options, as one value.

The Trainer's signature keeps what most pipelines set (the stock Trainer's parameters,
`accum_steps`, `effective_batch_size`, `micro_batch_size`, `strategy`); the rest,
grouped by what they are for, travel in one `options=TrainerOptions(...)`. Nothing is
checked here: `settings.check_when_defined` and `settings.resolve` check every value,
in one place.

This module is also how the Trainer's values travel as execution properties: the
component writes them (`exec_properties`), the executor reads them back
(`from_exec_properties`). They travel as they always have, one property per value
(bools as 0/1, "auto" as a flag, the schedule as JSON), so a pipeline's compiled IR,
its cache keys and its RuntimeParameters are the same as when every option was a
parameter of its own.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Any, Dict, Optional, Union

from tfx.orchestration import data_types

from tfx_gradient_accumulator.accumulator.core.options import AUTO, FIT, validate_schedule

# The execution properties, by name. `accum_steps="auto"`/"fit" and `micro_batch_size="auto"`
# travel as 0/1 flags beside the ints, as SchemaGen's `infer_feature_shape` carries a bool.
ACCUM_STEPS_KEY = "accum_steps"
EFFECTIVE_BATCH_SIZE_KEY = "effective_batch_size"
MICRO_BATCH_SIZE_KEY = "micro_batch_size"
STRATEGY_KEY = "strategy"
ACCUM_STEPS_AUTO_KEY = "accum_steps_auto"
ACCUM_STEPS_FIT_KEY = "accum_steps_fit"
MICRO_BATCH_SIZE_AUTO_KEY = "micro_batch_size_auto"
# Options stored as 0/1 ints, and the one stored as JSON.
_INT_FLAGS = ("measure_noise_scale", "merge_duplicate_rows", "gradient_cache", "gather_across_replicas")
_JSON = "accum_schedule"

Runtime = data_types.RuntimeParameter


@dataclasses.dataclass(frozen=True)
class TrainerOptions:
    """The `AccumulatingTrainer`'s less common options: `options=TrainerOptions(...)`.

    Every option defaults to off (`TrainerOptions()` trains as without it); each is
    checked, with the Trainer's other values, when the pipeline is defined (a value
    known then) and again when the executor starts (a RuntimeParameter's, a tuned one,
    the replicas). `measure_noise_scale`, `noise_scale_smoothing`, `backup_dir` and
    `backup_every` may be RuntimeParameters.

    Attributes:
        partial_window: "apply" (the default), "carry" or "drop": what the end
            of an epoch and of training does with a window still open.
        merge_duplicate_rows: sum each looked-up row's gradients in a window
            before the optimizer sees them (`GradientAccumulator(
            merge_duplicate_rows=True)`: the densified gradient) instead of
            Keras' own large-batch update (the default, under XLA too).
        accum_schedule: {epoch: accum_steps}: accumulation that changes at
            epoch starts (each change exact); it replaces `accum_steps`, the
            micro-batch stays fixed.
        accum_schedule_by: "epoch" (the default) or "update": the schedule's
            keys count optimizer updates, each change at the first window
            boundary after that many (exact: Keras' own `fit`s at each batch
            size, chained).
        max_effective_batch_size: the limit of `accum_steps="auto"` (required
            with it, refused without it).
        lr_scaling: "none" (the default), "linear" or "sqrt": the inner
            optimizer's learning rate (constant or schedule) times the ratio of
            the effective batch to the starting one, or its square root, at
            every change (`accum_schedule` or "auto").
        lr_ramp_updates: the optimizer updates over which that learning rate
            moves linearly to its new value after each change, instead of
            jumping (`AccumulationSchedule(..., lr_ramp_updates=...)`). Default:
            `AutoAccumulation`'s own (50) with "auto", 0 (a jump) with an
            `accum_schedule`. Needs "auto" or `accum_schedule_by="update"`
            (refused with a fixed `accum_steps` and with a schedule by epoch).
            Recorded as `lr_ramp_updates`: with the same value, replaying
            `accum_schedule_taken` gives the same run.
        measure_noise_scale: estimate the gradient noise scale B_simple (the
            critical batch, in samples) from the accumulation windows
            (`GradientAccumulator(measure_noise_scale=True)`), and record the
            final estimate on the `model` and `model_run` artifacts
            (`noise_scale`, `noise_scale_windows`, `noise_scale_status`) and in
            TensorBoard. Needs windows of 2 or more micro-batches (`accum_steps`
            >= 2 or a schedule reaching it). The `hyperparameters` input's
            `measure_noise_scale` wins.
        noise_scale_smoothing: the decay, in [0, 1), of the estimate's moving
            averages over windows (default 0.99, about 100 windows).
        gradient_cache: for losses that couple the batch (in-batch negatives,
            contrastive), where accumulating micro-batch gradients would be wrong
            (each micro-batch would have only its own negatives). The run_fn wraps
            its model in `accumulator.GradientCache(model, accum_steps=1)` and
            compiles it with a plain optimizer; the Trainer sets its
            `accum_steps` (no `GradientAccumulator`: one update per batch),
            training datasets from `fn_args.data_accessor` come batched at the
            *effective* batch (which `GradientCache` cuts into micro-batches,
            holding one micro-batch's activations at a time), and
            `fn_args.train_steps` stays `num_steps`. Compiling any other model
            is refused; so is a `GradientCache` compiled without this flag (it
            would accumulate twice), and `measure_noise_scale`,
            `accum_schedule`, `partial_window` other than "apply" and
            `merge_duplicate_rows` with it. Default False.
        gather_across_replicas: with `gradient_cache`, under a strategy of R
            replicas: False (the default) scores each replica's share of the
            batch alone, as Keras' own large batch does under the strategy (each
            sample meets the negatives of its share: 1/R of the batch); True
            scores the whole global batch on every replica
            (`GradientCache(..., gather_across_replicas=True)`), so the run trains
            like one device on the effective batch, at the cost of one
            all-reduce of the representations, inputs and targets per step. Needs
            a model with its own `compute_loss` (Keras 3 or Keras 2), or a
            TensorFlow Recommenders retrieval model (its task scores the global
            batch); refused otherwise, before training. Recorded as
            `gather_across_replicas` (0/1). Refused without `gradient_cache`.
        backup_dir: back training up under this folder (local, or a bucket
            every worker reads) and resume from it when the executor is
            restarted: a preempted worker, a retried component. The run's
            backups go to `<backup_dir>/<run key>`, a digest of the inputs, the
            parameters and the module file, so only the same training resumes;
            the resumed run ends with the weights of an uninterrupted one (no
            micro-batch lost or trained twice) when the run_fn's training data
            come in a fixed order. Needs a Keras 3 run_fn that calls `fit` once
            on a tf.data.Dataset. Recorded: `backup_resumes`,
            `resumed_at_step`, `resumed_at_update`, `backup_dir`. The backups
            are removed once the model is published. Default None: no backup.
        backup_every: optimizer updates between backups (default 100); epoch
            ends are backed up too.
        verify_exactness: True: before training, check on the run_fn's model
            and first batches that accumulation trains like Keras' large batch
            (`accumulator.check_exact`, 2 updates, one device), and record the
            verdict (`exactness`, `exactness_max_delta`, `exactness_detail`);
            "refuse": the same, and stop before training unless it is exact;
            False (the default): no check (components.exactness).
    """

    partial_window: str = "apply"
    merge_duplicate_rows: bool = False
    accum_schedule: Optional[Dict[int, int]] = None
    accum_schedule_by: str = "epoch"
    max_effective_batch_size: Optional[int] = None
    lr_scaling: str = "none"
    lr_ramp_updates: Optional[int] = None
    measure_noise_scale: Optional[Union[bool, Runtime]] = None     # None: off (or the Tuner's value)
    noise_scale_smoothing: Optional[Union[float, Runtime]] = None
    gradient_cache: bool = False
    gather_across_replicas: bool = False
    backup_dir: Optional[Union[str, Runtime]] = None
    backup_every: Optional[Union[int, Runtime]] = None
    verify_exactness: Union[bool, str] = False

    def known_when_defined(self) -> "TrainerOptions":
        """These options with each RuntimeParameter as None (its value comes when the run starts)."""
        return dataclasses.replace(self, **{field.name: None for field in dataclasses.fields(self)
                                            if isinstance(getattr(self, field.name), Runtime)})


FIELDS = tuple(field.name for field in dataclasses.fields(TrainerOptions))


def with_moved(options: Optional[TrainerOptions], moved: Dict[str, Any], owner: str) -> TrainerOptions:
    """`options`, with the options given the old way, as keywords of the component.

    Earlier versions took every option as a parameter of the Trainer; they still work,
    with a FutureWarning that names where each went.

    Args:
        options: the `options` given, or None.
        moved: the other keyword arguments given.
        owner: the component's class name (for the messages).

    Returns:
        The `TrainerOptions` to use.

    Raises:
        TypeError: a keyword that is no option (as Python says of any unknown keyword),
            or `options` that is no `TrainerOptions`.
        ValueError: an option given both ways.
    """
    if options is not None and not isinstance(options, TrainerOptions):
        raise TypeError(f"{owner}(options=...) takes a TrainerOptions (from tfx_gradient_accumulator.components "
                        f"import TrainerOptions); received {type(options).__name__}.")
    options = options or TrainerOptions()
    for name, value in moved.items():
        if name not in FIELDS:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}; its options are "
                            f"TrainerOptions' fields: {', '.join(FIELDS)}.")
        if getattr(options, name) != getattr(TrainerOptions(), name):
            raise ValueError(f"`{name}` was given twice: as {owner}({name}=...) and in `options`. Give it in "
                             f"`options` alone: options=TrainerOptions({name}=...).")
        warnings.warn(f"{owner}({name}=...) moved into the Trainer's `options`: pass "
                      f"options=TrainerOptions({name}={value!r}) (from tfx_gradient_accumulator.components "
                      "import TrainerOptions). The keyword still works, and will be removed.",
                      FutureWarning, stacklevel=3)
    return dataclasses.replace(options, **moved)


def exec_properties(accum_steps, effective_batch_size, micro_batch_size, strategy: str,
                    options: TrainerOptions, verify_exactness: Optional[str]) -> Dict[str, Any]:
    """The component's accumulation values as execution properties (checked before, not here).

    Args:
        accum_steps, effective_batch_size, micro_batch_size, strategy: the component's.
        options: its `TrainerOptions`.
        verify_exactness: `options.verify_exactness` as stored (`exactness.validate_mode`).

    Returns:
        `{property: value}`: one property per value, a RuntimeParameter left as it is.
    """
    properties = {name: getattr(options, name) for name in FIELDS}
    for name in _INT_FLAGS:
        if isinstance(properties[name], bool) or properties[name] is None:
            properties[name] = int(bool(properties[name]))
    if options.accum_schedule is not None:
        properties[_JSON] = json.dumps(validate_schedule(options.accum_schedule))
    properties.update({
        ACCUM_STEPS_KEY: None if accum_steps in (AUTO, FIT) else accum_steps,
        ACCUM_STEPS_AUTO_KEY: int(accum_steps == AUTO),
        ACCUM_STEPS_FIT_KEY: int(accum_steps == FIT),
        EFFECTIVE_BATCH_SIZE_KEY: effective_batch_size,
        MICRO_BATCH_SIZE_KEY: None if micro_batch_size == AUTO else micro_batch_size,
        MICRO_BATCH_SIZE_AUTO_KEY: int(micro_batch_size == AUTO),
        STRATEGY_KEY: strategy,
        "verify_exactness": verify_exactness,
    })
    return properties


def from_exec_properties(properties: Dict[str, Any]):
    """What `exec_properties` wrote, read back: `(accum_steps, effective_batch_size,
    micro_batch_size, options)` as `settings.resolve` takes them.

    Args:
        properties: the execution properties (a missing one: its default).

    Returns:
        The four values; "auto"/"fit" and the schedule as they were given, 0/1 flags as bools.
    """
    accum_steps = properties.get(ACCUM_STEPS_KEY)
    if _flag(properties.get(ACCUM_STEPS_AUTO_KEY)):
        accum_steps = AUTO
    if _flag(properties.get(ACCUM_STEPS_FIT_KEY)):
        accum_steps = FIT
    micro_batch_size = AUTO if _flag(properties.get(MICRO_BATCH_SIZE_AUTO_KEY)) else \
        properties.get(MICRO_BATCH_SIZE_KEY)
    stored = {name: properties[name] for name in FIELDS if properties.get(name) is not None}
    stored.update({name: _flag(stored[name]) for name in _INT_FLAGS if name in stored})
    if stored.get(_JSON):
        stored[_JSON] = json.loads(stored[_JSON])
    else:
        stored.pop(_JSON, None)
    return accum_steps, properties.get(EFFECTIVE_BATCH_SIZE_KEY), micro_batch_size, TrainerOptions(**stored)


def _flag(value):
    """A stored 0/1 as a bool; any other value unchanged (for its check to name it)."""
    return bool(value) if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1) else value
