"""`AccumulatingTrainer`: a drop-in `tfx.components.Trainer` that accumulates gradients.

Same inputs, same outputs (`model`, `model_run`), same run_fn contract as the stock
Trainer, plus the accumulation's common parameters (`accum_steps`, `effective_batch_size`,
`micro_batch_size`, `strategy`) and one `options=TrainerOptions(...)` for the rest
(`components.trainer_options`). On a cluster the chief alone exports and records
(components.cluster). Change the class name in a pipeline and it trains with
accumulation; feed `hyperparameters=tuner.outputs["best_hyperparameters"]` and the tuned
values win over the parameters.
"""

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

from tfx_gradient_accumulator.components import exactness, executor, settings as settings_lib, trainer_options
from tfx_gradient_accumulator.components.trainer_options import TrainerOptions

STRATEGY_CHOICES = settings_lib.STRATEGY_CHOICES


class AccumulatingTrainerSpec(standard_component_specs.TrainerSpec):
    """The stock TrainerSpec plus the accumulation parameters: one execution property per
    value (`components.trainer_options` writes them), as every earlier version stored them."""

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
        options: a `TrainerOptions` (`from tfx_gradient_accumulator.components
            import TrainerOptions`): the less common options, each off by
            default: `partial_window`, `merge_duplicate_rows`; a batch that
            changes during training (`accum_schedule`, `accum_schedule_by`,
            `max_effective_batch_size` for `accum_steps="auto"`, `lr_scaling`,
            `lr_ramp_updates`); `measure_noise_scale`, `noise_scale_smoothing`;
            `gradient_cache`, `gather_across_replicas`; `backup_dir`,
            `backup_every`; `verify_exactness`. Each is described there.
        **moved_options: those options given as keywords of the Trainer, as
            earlier versions took them (`gradient_cache=True`): still accepted,
            with a FutureWarning that names where each went
            (`options=TrainerOptions(gradient_cache=True)`); the same option
            given both ways is refused.

    Raises:
        ValueError: not exactly one of `module_file` and `run_fn`, or of `examples`
            and `transformed_examples`, or `transformed_examples` without
            `transform_graph`; an accumulation setting out of its allowed values or
            refused with another (as listed above and in `TrainerOptions`), checked
            when the pipeline is defined wherever the value is known then
            (`settings.check_when_defined`).
        TypeError: a keyword that is neither a parameter nor an option, or a count
            that is not an integer.

    `TrainArgs.num_steps` counts optimizer updates: the run_fn sees
    `fn_args.train_steps = num_steps * accum_steps` micro-steps (`num_steps`
    with `gradient_cache` or `micro_batch_size`). With a schedule or "auto" that is
    the starting `accum_steps`: the samples stay, the updates change with the batch,
    and `optimizer_updates` records how many were made.
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
        micro_batch_size: Optional[Union[int, str, data_types.RuntimeParameter]] = None,
        strategy: str = "auto",
        options: Optional[TrainerOptions] = None,
        **moved_options,
    ):
        if [bool(module_file), bool(run_fn)].count(True) != 1:
            raise ValueError("Exactly one of 'module_file', or 'run_fn' must be supplied.")
        if bool(examples) == bool(transformed_examples):
            raise ValueError("Exactly one of 'example' or 'transformed_example' must be supplied.")
        if transformed_examples and not transform_graph:
            raise ValueError(
                "If 'transformed_examples' is supplied, 'transform_graph' must be supplied too."
            )
        options = trainer_options.with_moved(options, moved_options, type(self).__name__)
        settings_lib.check_when_defined(accum_steps, effective_batch_size, micro_batch_size, strategy, options,
                                        tuned=hyperparameters is not None)
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
            **trainer_options.exec_properties(accum_steps, effective_batch_size, micro_batch_size, strategy,
                                              options, exactness.validate_mode(options.verify_exactness)),
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
