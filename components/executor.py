"""Executor of `AccumulatingTrainer`: the stock generic Trainer plus accumulation.

`Executor.Do` resolves the settings and the strategy before anything trains, runs the
user's unchanged run_fn with every compiled optimizer wrapped in `GradientAccumulator`
(or every `GradientCache` given its `accum_steps`), and records what happened on the
output artifacts and in TensorBoard. On a cluster the chief exports and records.
"""

import dataclasses
import json
import os
from typing import Any, Dict, List, Optional

import tensorflow as tf
from absl import logging
from google.protobuf import json_format
from tfx import types
from tfx.components.trainer import executor as tfx_trainer_executor
from tfx.components.util import udf_utils
from tfx.types import standard_component_specs

from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile
from tfx_gradient_accumulator.accumulator.core.distribute import strategy_from_environment
from tfx_gradient_accumulator.components import (
    cluster, effective_batch_record, exactness, fn_args_utils, micro_batch_fit, noise_scale, out_of_memory,
    preemption, run_fn_swaps, settings as settings_lib, trainer_options)

# The execution properties the component writes (`trainer_options.exec_properties`).
ACCUM_STEPS_KEY = trainer_options.ACCUM_STEPS_KEY
EFFECTIVE_BATCH_SIZE_KEY = trainer_options.EFFECTIVE_BATCH_SIZE_KEY
STRATEGY_KEY = trainer_options.STRATEGY_KEY
ACCUM_SCHEDULE_KEY = "accum_schedule"
PARTIAL_WINDOW_KEY = "partial_window"
MEASURE_NOISE_SCALE_KEY = "measure_noise_scale"
NOISE_SCALE_SMOOTHING_KEY = "noise_scale_smoothing"
MERGE_DUPLICATE_ROWS_KEY = "merge_duplicate_rows"
GRADIENT_CACHE_KEY = "gradient_cache"
GATHER_ACROSS_REPLICAS_KEY = "gather_across_replicas"
ACCUM_STEPS_AUTO_KEY = trainer_options.ACCUM_STEPS_AUTO_KEY
ACCUM_STEPS_FIT_KEY = trainer_options.ACCUM_STEPS_FIT_KEY
MAX_EFFECTIVE_BATCH_SIZE_KEY = "max_effective_batch_size"
ACCUM_SCHEDULE_BY_KEY = "accum_schedule_by"
LR_SCALING_KEY = "lr_scaling"
LR_RAMP_UPDATES_KEY = settings_lib.LR_RAMP_UPDATES
MICRO_BATCH_SIZE_KEY = trainer_options.MICRO_BATCH_SIZE_KEY
MICRO_BATCH_SIZE_AUTO_KEY = trainer_options.MICRO_BATCH_SIZE_AUTO_KEY
BACKUP_DIR_KEY = preemption.BACKUP_DIR_KEY
BACKUP_EVERY_KEY = preemption.BACKUP_EVERY_KEY
TENSORBOARD_SUBDIR = "accumulation"
RECORD_FILE = "record.json"
@dataclasses.dataclass(frozen=True)
class _Run:
    """What one run resolved before training: the settings, the strategy, this
    process's role on the cluster, the backup (or None), and with accum_steps="fit"
    the out-of-memory recovery (or None; it also holds the switches it made)."""

    settings: settings_lib.AccumulationSettings
    strategy: Any
    role: Any
    backup: Any = None
    recovery: Any = None


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """What the run did: optimizer updates, micro-batches left in open windows, the
    noise-scale reading (or None), what "auto" decided (or None), and the wrappers made."""

    updates: int
    open_windows: int
    reading: Any = None
    schedule_taken: Optional[Dict[int, int]] = None
    optimizers: tuple = ()


class Executor(tfx_trainer_executor.GenericExecutor):
    """Runs the user's run_fn with accumulation, under a distribution strategy."""

    def Do(
        self,
        input_dict: Dict[str, List[types.Artifact]],
        output_dict: Dict[str, List[types.Artifact]],
        exec_properties: Dict[str, Any],
    ) -> None:
        """Trains the user's run_fn with accumulation, in TFX's executor shape.

        Log, fn_args, run_fn, settings, (the exactness check), train under
        `accumulating_compile`, check the export, record.

        Args:
            input_dict: the input artifacts by key (as the stock Trainer's).
            output_dict: the output artifacts by key (`model`, `model_run`).
            exec_properties: the component's parameters, accumulation ones included.

        Raises:
            ValueError: no run_fn, or a setting out of its allowed values (for
                values known only now: tuned ones, the replica count).
            RuntimeError: `verify_exactness="refuse"` and the model is not exact, or
                a peer of the cluster died (`components.cluster`).
        """
        self._log_startup(input_dict, output_dict, exec_properties)
        fn_args = self._GetFnArgs(input_dict, output_dict, exec_properties)
        run_fn = _load_run_fn(exec_properties)
        strategy = strategy_from_environment(exec_properties.get(STRATEGY_KEY) or "auto")
        settings = _resolve_settings(fn_args.hyperparameters, exec_properties, strategy.num_replicas_in_sync)
        role = cluster.role_from_environment()
        cluster.refuse_one_strategy_per_worker(role, strategy)
        settings = micro_batch_fit.settle(run_fn, fn_args, settings, strategy, role)
        backup = preemption.backup_for(input_dict, exec_properties, settings.steps_per_update, role.chief)
        verdict = exactness.verify(run_fn, fn_args_utils.for_accumulation(fn_args, settings, role.workers),
                                   settings, exec_properties.get(exactness.VERIFY_EXACTNESS_KEY), strategy, role)
        # Train the model: every optimizer the run_fn compiles accumulates (or every GradientCache).
        recovery = out_of_memory.recovery_for(settings, strategy, role.workers, backup)    # "fit" alone
        run = _Run(settings, strategy, role, backup, recovery)
        logging.info("Training model. %s", _describe(run, fn_args.train_steps))
        with cluster.worker_outputs(fn_args, role, backup) as outputs:
            with accumulating_compile(strategy=strategy, backup=backup, **settings.compile_arguments()) as optimizers, \
                    run_fn_swaps.strategies_made_map_onto(strategy), \
                    run_fn_swaps.fits_routed(out_of_memory.route(run.recovery)):   # "fit": through the recovery
                run_fn(fn_args_utils.for_accumulation(outputs.fn_args, settings, role.workers))
            outputs.check_exported()
            if role.chief:
                exactness.record(output_dict, verdict)
                _record(output_dict, fn_args.model_run_dir, run, optimizers)
            outputs.publish()
        if backup is not None:
            backup.remove()
        logging.info("Training complete on %s. Model written to %s.", cluster.describe(role),
                     fn_args.serving_model_dir if role.chief else "a temporary folder (not the chief)")


def _load_run_fn(exec_properties):
    """The user's `run_fn`; ValueError naming where none was found."""
    try:
        return udf_utils.get_fn(exec_properties, "run_fn")
    except (AttributeError, ValueError) as err:
        source = exec_properties.get("module_file") or exec_properties.get("module_path") \
            or exec_properties.get("run_fn")
        raise ValueError(
            f"AccumulatingTrainer needs a `run_fn(fn_args)` to train with; none was "
            f"found in {source!r} ({err})."
        ) from None


def _resolve_settings(hyperparameters, exec_properties, replicas):
    """The run's `AccumulationSettings`: the Tuner's best over the component's parameters
    (read back from the execution properties the component wrote)."""
    accum_steps, effective_batch_size, micro_batch_size, options = trainer_options.from_exec_properties(
        exec_properties)
    return settings_lib.resolve(hyperparameters, accum_steps, effective_batch_size, replicas, options,
                                micro_batch_size=micro_batch_size)


def _describe(run, train_steps):
    """One log line: what the run trains with."""
    settings, strategy, role = run.settings, run.strategy, run.role
    micro_batch = settings.micro_batch or ("found by the run" if settings.splits_in_step else "the run_fn's")
    if settings.gradient_cache:
        micro_steps = (f"{train_steps} optimizer updates = {train_steps} steps of GradientCache, "
                       f"each over the effective batch in {settings.accum_steps} micro-batches, "
                       + ("the loss scoring the whole global batch on every replica"
                          if settings.gather_across_replicas else "the loss scoring each replica's share"))
    elif settings.splits_in_step:
        micro_steps = (f"{train_steps} optimizer updates = {train_steps} fit steps at the effective batch, "
                       f"each split inside the step into micro-batches (micro_batch_size="
                       f"{settings.micro_batch_size!r})")
    else:
        micro_steps = (f"{train_steps} optimizer updates = {train_steps and train_steps * settings.accum_steps} "
                       f"micro-steps; partial windows: {settings.partial_window}")
    if settings.auto:
        micro_steps += (f"; accum_steps grows from {settings.accum_steps} with the noise scale up to an "
                        f"effective batch of {settings.max_effective_batch_size} (lr_scaling="
                        f"{settings.lr_scaling}, ramped over {settings.lr_ramp_updates} updates); the "
                        f"micro-steps stay, so the updates are fewer")
    return (
        f"Accumulation: accum_steps={settings.accum_steps} ({settings.sources.get('accum_steps')}), "
        f"effective batch {settings.effective_batch_size} ({settings.sources.get('effective_batch_size')}), "
        f"global micro-batch {micro_batch}, "
        f"{settings.replicas} replica(s) under {type(strategy).__name__}; {micro_steps}; "
        f"{cluster.describe(role)}."
    )


def _record(output_dict, model_run_dir, run, optimizers):
    """Records what the run did on the output artifacts (ML Metadata), in
    `record.json` and in TensorBoard (the chief alone calls this). Refuses a run
    that wrapped no optimizer, so no artifact claims an accumulation that did not
    happen."""
    settings = run.settings
    if not optimizers and settings.gradient_cache:
        raise RuntimeError(
            "AccumulatingTrainer(options=TrainerOptions(gradient_cache=True)) saw no GradientCache "
            "compiled: the run_fn never called `compile` on an accumulator.GradientCache, so no "
            "accumulation is recorded. Wrap the model (`GradientCache(model, accum_steps=1)`) and compile it."
        )
    if not optimizers:
        raise RuntimeError(
            "AccumulatingTrainer wrapped no optimizer: the run_fn never called "
            "`Model.compile(optimizer=...)` on a Keras 3 or Keras 2 (tf_keras) model, "
            "so nothing was accumulated and no accumulation is recorded. A run_fn "
            "with a custom training loop must wrap its optimizer itself "
            "(accumulator.GradientAccumulator) and use the stock Trainer."
        )
    updates = max(int(o.iterations.numpy()) for o in optimizers)
    # `unapplied_micro_batches`: held in a window left open (partial_window="carry");
    # a GradientCache's plain optimizer holds none (each batch is one whole update).
    open_windows = sum(getattr(o, "held_micro_batches", 0) for o in optimizers)
    schedule_taken = _schedule_taken(optimizers)
    reading = noise_scale.read(optimizers, settings.measure_noise_scale)
    if reading is not None:
        logging.info("%s", noise_scale.describe(reading, settings.effective_batch_size))
    logging.info("%d optimizer updates. %s%s", updates, out_of_memory.describe(run.recovery),
                 effective_batch_record.describe(settings, optimizers))
    _write_record(output_dict, model_run_dir, run,
                  _Outcome(updates, open_windows, reading, schedule_taken, tuple(optimizers)))


def _schedule_taken(optimizers):
    """{optimizer update: accum_steps} that `accum_steps="auto"` decided (the first
    wrapper's), or None without "auto"."""
    rules = [o.auto_accumulation for o in optimizers if getattr(o, "auto_accumulation", None) is not None]
    return dict(rules[0].schedule) if rules else None


def _write_record(output_dict, model_run_dir, run, outcome):
    """Sets the run's properties on the artifacts and writes `record.json` and TensorBoard's scalars."""
    settings, strategy, updates = run.settings, run.strategy, outcome.updates
    reading, schedule_taken = outcome.reading, outcome.schedule_taken
    backup_ints, backup_strings = preemption.properties(run.backup)
    recovery_ints, recovery_strings = out_of_memory.properties(run.recovery)
    split_ints, split_strings = effective_batch_record.properties(settings, outcome.optimizers)
    properties = {**settings.as_properties(), "optimizer_updates": updates,
                  "unapplied_micro_batches": outcome.open_windows, "workers": run.role.workers, **backup_ints,
                  **recovery_ints, **split_ints}
    strings = {"distribution_strategy": type(strategy).__name__, "partial_window": settings.partial_window,
               "accum_schedule_by": settings.schedule_by, "lr_scaling": settings.lr_scaling, **backup_strings,
               **recovery_strings, **split_strings}
    if settings.fitted is not None:       # accum_steps="fit": every step tried, (micro-batch, fitted)
        strings["micro_batch_probes"] = json.dumps([list(p) for p in settings.fitted.probes])
    if schedule_taken is not None:
        # What "auto" did, as the by-update schedule that replays it: AccumulatingTrainer(
        # accum_schedule=json.loads(this), accum_schedule_by="update", lr_scaling=...,
        # lr_ramp_updates=...), both recorded beside it.
        strings["accum_schedule_taken"] = json.dumps({str(k): v for k, v in sorted(schedule_taken.items())})
        properties["final_accum_steps"] = max(schedule_taken.items())[1]
        properties["final_effective_batch_size"] = properties["final_accum_steps"] * (settings.micro_batch or 0)
    for key in (standard_component_specs.MODEL_KEY, standard_component_specs.MODEL_RUN_KEY):
        for artifact in output_dict.get(key, []):
            for name, value in properties.items():
                artifact.set_int_custom_property(name, int(value))
            for name, value in strings.items():
                artifact.set_string_custom_property(name, value)
        noise_scale.record(output_dict.get(key, []), reading)
    model = output_dict[standard_component_specs.MODEL_KEY][0]
    cluster.write_json(os.path.join(model_run_dir, TENSORBOARD_SUBDIR, RECORD_FILE), {
        name: json_format.MessageToDict(value) for name, value in model.mlmd_artifact.custom_properties.items()})
    writer = tf.summary.create_file_writer(os.path.join(model_run_dir, TENSORBOARD_SUBDIR))
    with writer.as_default():
        for name, value in properties.items():
            tf.summary.scalar(f"accumulation/{name}", value, step=0)
        noise_scale.write_summaries(reading, step=updates)
        for update, steps in sorted((schedule_taken or {}).items()):     # each decision, at its update
            tf.summary.scalar("accumulation/effective_batch_size_taken", steps * (settings.micro_batch or 0),
                              step=update)
        for switch in (run.recovery.switches if run.recovery else ()):      # each switch, at its update
            tf.summary.scalar("accumulation/micro_batch_size_taken", switch.micro_batch, step=switch.update)
        effective_batch_record.write_summaries(settings, outcome.optimizers)    # micro_batch_size: each b taken
        tf.summary.text("accumulation/settings", json.dumps(
            {**properties, **strings, "strategy": type(strategy).__name__, "sources": settings.sources},
            indent=1, sort_keys=True), step=0)
    writer.flush()
