"""`AccumulatingTrainer`: a drop-in `tfx.components.Trainer` that accumulates gradients.

Same inputs, same outputs (`model`, `model_run`), same run_fn contract as the
stock Trainer, plus the accumulation's parameters (`accum_steps`, `effective_batch_size`,
`strategy`, `accum_schedule`, `accum_schedule_by`, `lr_scaling`, `lr_ramp_updates`,
`max_effective_batch_size`, `partial_window`, `measure_noise_scale`, `merge_duplicate_rows`,
`gradient_cache`, `gather_across_replicas`, `backup_dir`, `backup_every`, `micro_batch_size`). On a cluster the chief
alone exports and records (components.cluster).
Change the class name in a pipeline and it trains with
accumulation; feed `hyperparameters=tuner.outputs["best_hyperparameters"]` and
the tuned values win over the parameters.
"""

import json
from typing import Any, Dict, Optional, Union

from tfx import types
from tfx.components.trainer import component as tfx_trainer_component
from tfx.components.util import udf_utils
from tfx.dsl.components.base import base_component, executor_spec
from tfx.orchestration import data_types
from tfx.proto import trainer_pb2
from tfx.types import standard_artifacts, standard_component_specs
from tfx.types.component_spec import ExecutionParameter
from tfx.utils import json_utils

from tfx_gradient_accumulator.accumulator.core.distribute import KINDS
from tfx_gradient_accumulator.accumulator.core.options import integer_at_least, validate_schedule
from tfx_gradient_accumulator.components import exactness, executor, settings as settings_lib

STRATEGY_CHOICES = ("auto",) + KINDS


class AccumulatingTrainerSpec(standard_component_specs.TrainerSpec):
    """The stock TrainerSpec plus the accumulation parameters."""

    PARAMETERS = {
        **standard_component_specs.TrainerSpec.PARAMETERS,
        executor.ACCUM_STEPS_KEY: ExecutionParameter(type=int, optional=True),
        executor.EFFECTIVE_BATCH_SIZE_KEY: ExecutionParameter(type=int, optional=True),
        executor.STRATEGY_KEY: ExecutionParameter(type=str, optional=True),
        executor.ACCUM_SCHEDULE_KEY: ExecutionParameter(type=str, optional=True),
        executor.PARTIAL_WINDOW_KEY: ExecutionParameter(type=str, optional=True),
        # 0/1, as SchemaGen's infer_feature_shape: bools travel as ints everywhere.
        executor.MEASURE_NOISE_SCALE_KEY: ExecutionParameter(type=int, optional=True),
        executor.NOISE_SCALE_SMOOTHING_KEY: ExecutionParameter(type=float, optional=True),
        executor.MERGE_DUPLICATE_ROWS_KEY: ExecutionParameter(type=int, optional=True),
        executor.GRADIENT_CACHE_KEY: ExecutionParameter(type=int, optional=True),
        executor.GATHER_ACROSS_REPLICAS_KEY: ExecutionParameter(type=int, optional=True),
        executor.ACCUM_STEPS_AUTO_KEY: ExecutionParameter(type=int, optional=True),
        executor.ACCUM_STEPS_FIT_KEY: ExecutionParameter(type=int, optional=True),
        executor.MAX_EFFECTIVE_BATCH_SIZE_KEY: ExecutionParameter(type=int, optional=True),
        executor.ACCUM_SCHEDULE_BY_KEY: ExecutionParameter(type=str, optional=True),
        executor.LR_SCALING_KEY: ExecutionParameter(type=str, optional=True),
        executor.LR_RAMP_UPDATES_KEY: ExecutionParameter(type=int, optional=True),
        executor.BACKUP_DIR_KEY: ExecutionParameter(type=str, optional=True),
        # An int; "auto" travels as micro_batch_size_auto=1 (as accum_steps="auto" does).
        executor.MICRO_BATCH_SIZE_KEY: ExecutionParameter(type=int, optional=True),
        executor.MICRO_BATCH_SIZE_AUTO_KEY: ExecutionParameter(type=int, optional=True),
        executor.BACKUP_EVERY_KEY: ExecutionParameter(type=int, optional=True),
        exactness.VERIFY_EXACTNESS_KEY: ExecutionParameter(type=str, optional=True),
    }


class AccumulatingTrainer(tfx_trainer_component.Trainer):
    """Trains the user's run_fn with `GradientAccumulator` under a strategy.

    Args:
        examples: a Channel of type `Examples` to train on (as the stock Trainer's).
        transformed_examples: the Transform component's `Examples` (instead of
            `examples`; needs `transform_graph`).
        transform_graph: a Channel of type `TransformGraph`.
        schema: a Channel of type `Schema`.
        base_model: a Channel of type `Model` to warm-start from.
        hyperparameters: a Channel of type `HyperParameters` (a Tuner's best); its
            `accum_steps`, `effective_batch_size`, `measure_noise_scale` and
            `noise_scale_smoothing` win over the arguments.
        module_file: the file holding the user's `run_fn` (or `run_fn`, not both).
        run_fn: the path of the user's `run_fn` (or `module_file`, not both).
        train_args: `trainer_pb2.TrainArgs`; `num_steps` counts optimizer updates.
        eval_args: `trainer_pb2.EvalArgs`.
        custom_config: a dict handed to the run_fn (`fn_args.custom_config`).
        accum_steps: micro-batches per optimizer update (default 1), unless the
            `hyperparameters` input holds `accum_steps`. "auto": grow it during
            training with the measured gradient noise scale
            (`accumulator.AutoAccumulation`: doubled at a window boundary while
            B_simple stays at least twice the effective batch, never shrunk),
            from 2 micro-batches of `effective_batch_size / 2` samples up to
            `max_effective_batch_size`; the noise scale is measured. Recorded:
            `accum_schedule_taken` (the decisions, {update: accum_steps}, which
            `accum_schedule=..., accum_schedule_by="update"` replays exactly),
            `final_accum_steps`, `final_effective_batch_size`; TensorBoard
            shows each decision (`accumulation/effective_batch_size_taken`) and
            the run_fn's own TensorBoard callback the logs `accum_steps`,
            `effective_batch_size`, `noise_scale`, `lr_multiplier`. "fit": the
            largest micro-batch that trains a step on the worker's device, found
            before training by real steps of the run_fn's model on its data
            (`accumulator.find_micro_batch`, 10% headroom, then a divisor of
            `effective_batch_size`), sets it: accum_steps = effective_batch_size
            / micro-batch; needs `effective_batch_size` (which may be tuned alone);
            on a cluster every worker probes its own device and all take the
            smallest micro-batch found. Recorded: `accum_steps_fit`, `accum_steps`,
            `micro_batch_size`, `largest_fitting_micro_batch`, `micro_batch_probes`.
            The run_fn's `fit` then survives an out-of-memory error mid-run,
            exactly (`components.out_of_memory`: the micro-batch halves), on one
            device without `backup_dir`; recorded: `out_of_memory_recovery`,
            `micro_batch_switches`, and after a switch `final_micro_batch_size`,
            `final_accum_steps`.
        effective_batch_size: samples per optimizer update over all replicas;
            when set, training datasets from `fn_args.data_accessor` come batched
            at `effective_batch_size // accum_steps` (at `effective_batch_size`
            with `micro_batch_size` or `gradient_cache`). The `hyperparameters`
            input's value wins. Must divide into accum_steps x replicas.
        micro_batch_size: the other way to split the effective batch, instead
            of `accum_steps`: an int b, or "auto". Training datasets from
            `fn_args.data_accessor` come batched at `effective_batch_size`
            (needed; it may be tuned alone), every `fit` step is one optimizer
            update, and the run_fn's optimizer is wrapped in
            `GradientAccumulator(optimizer, micro_batch_size=b)`: each step
            trains its batch as ceil(E / b) micro-batches inside the step
            (`accumulator.batch.fit_micro_batches`), as Keras' own `fit` at the
            effective batch would train it. `fn_args.train_steps` stays
            `num_steps`. b is global (over all replicas, like `fit`'s batch), at
            most the effective batch (a larger b trains it whole). "auto": the
            largest micro-batch whose step fits the device, found by the run
            itself (a step that runs out of memory is trained again at a smaller
            b). A tuned `effective_batch_size` just changes the batch; a tuned
            int `accum_steps` is not applied. Refused with `accum_steps` other
            than 1 (or "auto", "fit"), `accum_schedule`, `gradient_cache`,
            `measure_noise_scale`, `partial_window` other than "apply" and
            `max_effective_batch_size`. Recorded: `micro_batch_size` (the b in
            use when training ended), `micro_batch_size_auto`,
            `micro_batches_per_update`, `micro_batch_changes` (each change "auto"
            made, JSON) and `micro_batch_out_of_memory_errors`; TensorBoard's
            `accumulation/micro_batch_size_taken` marks the first b and every
            change, at its update.
        strategy: "auto" (from `TF_CONFIG` and the GPUs; the default),
            "multi_worker", "mirrored", "one_device" or "default".
        accum_schedule: {epoch: accum_steps}: accumulation that changes at
            epoch starts (each change exact); it replaces `accum_steps`, the
            micro-batch stays fixed.
        accum_schedule_by: "epoch" (the default) or "update": the schedule's
            keys count optimizer updates, each change at the first window
            boundary after that many (exact: Keras' own `fit`s at each batch
            size, chained).
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
        max_effective_batch_size: the limit of `accum_steps="auto"` (required
            with it, refused without it).
        partial_window: "apply" (the default), "carry" or "drop": what the end
            of an epoch and of training does with a window still open.
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
        merge_duplicate_rows: sum each looked-up row's gradients in a window
            before the optimizer sees them (`GradientAccumulator(
            merge_duplicate_rows=True)`: the densified gradient) instead of
            Keras' own large-batch update (the default, under XLA too).
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
            batch); refused otherwise, before training. Recorded as `gather_across_replicas` (0/1). Refused without
            `gradient_cache`.
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

    Raises:
        ValueError: not exactly one of `module_file` and `run_fn`, or of `examples`
            and `transformed_examples`, or `transformed_examples` without
            `transform_graph`; an accumulation setting out of its allowed values or
            refused with another (as listed above), checked when the pipeline is
            defined wherever the value is known then.

    `TrainArgs.num_steps` counts optimizer updates: the run_fn sees
    `fn_args.train_steps = num_steps * accum_steps` micro-steps (`num_steps`
    with `gradient_cache`). With a schedule or "auto" that is the starting
    `accum_steps`: the samples stay, the updates change with the batch, and
    `optimizer_updates` records how many were made.
    """

    SPEC_CLASS = AccumulatingTrainerSpec
    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(executor.Executor)

    def __init__(
        self,
        examples: Optional[types.BaseChannel] = None,
        transformed_examples: Optional[types.BaseChannel] = None,
        transform_graph: Optional[types.BaseChannel] = None,
        schema: Optional[types.BaseChannel] = None,
        base_model: Optional[types.BaseChannel] = None,
        hyperparameters: Optional[types.BaseChannel] = None,
        module_file: Optional[Union[str, data_types.RuntimeParameter]] = None,
        run_fn: Optional[Union[str, data_types.RuntimeParameter]] = None,
        train_args: Optional[Union[trainer_pb2.TrainArgs, data_types.RuntimeParameter]] = None,
        eval_args: Optional[Union[trainer_pb2.EvalArgs, data_types.RuntimeParameter]] = None,
        custom_config: Optional[Union[Dict[str, Any], data_types.RuntimeParameter]] = None,
        accum_steps: Optional[Union[int, str, data_types.RuntimeParameter]] = None,
        effective_batch_size: Optional[Union[int, data_types.RuntimeParameter]] = None,
        strategy: Optional[str] = "auto",
        accum_schedule: Optional[Dict[int, int]] = None,
        partial_window: str = "apply",
        measure_noise_scale: Union[bool, data_types.RuntimeParameter] = False,
        noise_scale_smoothing: Optional[Union[float, data_types.RuntimeParameter]] = None,
        merge_duplicate_rows: bool = False,
        gradient_cache: bool = False,
        gather_across_replicas: bool = False,
        backup_dir: Optional[Union[str, data_types.RuntimeParameter]] = None,
        backup_every: Optional[Union[int, data_types.RuntimeParameter]] = None,
        verify_exactness: Union[bool, str] = False,
        accum_schedule_by: str = "epoch",
        lr_scaling: str = "none",
        max_effective_batch_size: Optional[int] = None,
        lr_ramp_updates: Optional[int] = None,
        micro_batch_size: Optional[Union[int, str, data_types.RuntimeParameter]] = None,
    ):
        if [bool(module_file), bool(run_fn)].count(True) != 1:
            raise ValueError("Exactly one of 'module_file', or 'run_fn' must be supplied.")
        if bool(examples) == bool(transformed_examples):
            raise ValueError("Exactly one of 'example' or 'transformed_example' must be supplied.")
        if transformed_examples and not transform_graph:
            raise ValueError(
                "If 'transformed_examples' is supplied, 'transform_graph' must be supplied too."
            )
        # What is known now is checked now, by the executor's own rules
        # (replicas are only known when it runs).
        def static(value):
            return None if isinstance(value, data_types.RuntimeParameter) else value

        # Whether measuring has windows depends on tuned values, when there are any.
        measure = None if hyperparameters is not None else static(measure_noise_scale)
        # A ramp needs a change of the batch; tuned values may bring one ("auto"): the executor judges then.
        ramp = None if hyperparameters is not None and accum_schedule is None else lr_ramp_updates
        auto = accum_steps == settings_lib.AUTO
        if auto and accum_schedule is not None:
            raise ValueError("`accum_steps='auto'` makes its own schedule: leave `accum_schedule` unset.")
        micro = _static_micro_batch_size(micro_batch_size, accum_steps, effective_batch_size, hyperparameters,
                                         accum_schedule, gradient_cache, partial_window, measure_noise_scale,
                                         max_effective_batch_size)
        _check_backup_and_strategy(backup_dir, backup_every, strategy)
        settings_lib.resolve(None, static(accum_steps), static(effective_batch_size), replicas=1,
                             partial_window=partial_window,
                             schedule=accum_schedule if measure or gradient_cache or ramp is not None else None,
                             measure_noise_scale=measure, noise_scale_smoothing=static(noise_scale_smoothing),
                             merge_duplicate_rows=merge_duplicate_rows, gradient_cache=gradient_cache,
                             schedule_by=accum_schedule_by, lr_scaling=lr_scaling,
                             max_effective_batch_size=max_effective_batch_size,
                             gather_across_replicas=gather_across_replicas, lr_ramp_updates=ramp,
                             micro_batch_size=micro)
        # "auto" travels as micro_batch_size_auto=1, as accum_steps="auto" does.
        micro_batch_size, micro_batch_size_auto = (None, 1) if micro_batch_size == settings_lib.AUTO else (
            micro_batch_size, 0)
        fit = accum_steps == settings_lib.FIT
        if auto or fit:
            accum_steps = None
        if accum_schedule is not None:
            accum_schedule = json.dumps(validate_schedule(accum_schedule))
        if isinstance(measure_noise_scale, bool):
            measure_noise_scale = int(measure_noise_scale)

        spec = AccumulatingTrainerSpec(
            examples=examples or transformed_examples,
            transform_graph=transform_graph,
            schema=schema,
            base_model=base_model,
            hyperparameters=hyperparameters,
            train_args=train_args or trainer_pb2.TrainArgs(),
            eval_args=eval_args or trainer_pb2.EvalArgs(),
            module_file=module_file,
            run_fn=run_fn,
            custom_config=(custom_config if isinstance(custom_config, data_types.RuntimeParameter)
                           else json_utils.dumps(custom_config)),
            accum_steps=accum_steps,
            effective_batch_size=effective_batch_size,
            strategy=strategy,
            accum_schedule=accum_schedule,
            partial_window=partial_window,
            measure_noise_scale=measure_noise_scale,
            noise_scale_smoothing=noise_scale_smoothing,
            merge_duplicate_rows=int(merge_duplicate_rows),
            gradient_cache=int(gradient_cache),
            gather_across_replicas=int(gather_across_replicas),
            accum_steps_auto=int(auto),
            accum_steps_fit=int(fit),
            max_effective_batch_size=max_effective_batch_size,
            accum_schedule_by=accum_schedule_by,
            lr_scaling=lr_scaling,
            lr_ramp_updates=lr_ramp_updates,
            micro_batch_size=micro_batch_size,
            micro_batch_size_auto=micro_batch_size_auto,
            backup_dir=backup_dir,
            backup_every=backup_every,
            verify_exactness=exactness.validate_mode(verify_exactness),
            model=types.Channel(type=standard_artifacts.Model),
            model_run=types.Channel(type=standard_artifacts.ModelRun),
        )
        base_component.BaseComponent.__init__(self, spec=spec)
        if udf_utils.should_package_user_modules():
            # As the stock Trainer: the module file travels as a wheel, so
            # remote workers (Kubeflow, Vertex) and the cache see its contents.
            udf_utils.add_user_module_dependency(
                self, standard_component_specs.MODULE_FILE_KEY, standard_component_specs.MODULE_PATH_KEY
            )


def _static_micro_batch_size(micro_batch_size, accum_steps, effective_batch_size, hyperparameters, schedule,
                             gradient_cache, partial_window, measure_noise_scale, max_effective_batch_size):
    """`micro_batch_size` checked when the pipeline is defined, against what it excludes
    (`settings.micro_batch_setting`); returned for `settings.resolve`, or None when it is a
    RuntimeParameter (the executor checks it) or when the effective batch it needs may come
    later (a RuntimeParameter, or a `hyperparameters` input)."""
    if micro_batch_size is None or isinstance(micro_batch_size, data_types.RuntimeParameter):
        return None

    def known(value):
        return None if isinstance(value, data_types.RuntimeParameter) else value

    settings_lib.micro_batch_setting(
        micro_batch_size, {}, accum_steps=known(accum_steps), schedule=schedule, gradient_cache=gradient_cache,
        partial_window=partial_window, max_effective_batch_size=max_effective_batch_size,
        measure_noise_scale=known(measure_noise_scale))
    if isinstance(effective_batch_size, data_types.RuntimeParameter) or (
            effective_batch_size is None and hyperparameters is not None):
        return None
    return micro_batch_size


def _check_backup_and_strategy(backup_dir, backup_every, strategy) -> None:
    """`backup_dir` (a non-empty path), `backup_every` (an int >= 1) and `strategy` (one of
    `STRATEGY_CHOICES`), where they are known when the pipeline is defined."""
    if backup_dir is not None and not isinstance(backup_dir, data_types.RuntimeParameter) and \
            (not isinstance(backup_dir, str) or not backup_dir.strip()):
        raise ValueError(f"`backup_dir` must be a non-empty path (local or gs://) or None; "
                         f"received {backup_dir!r}.")
    if backup_every is not None and not isinstance(backup_every, data_types.RuntimeParameter):
        integer_at_least(backup_every, "backup_every")
    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"`strategy` must be one of {STRATEGY_CHOICES}; received {strategy!r}.")
