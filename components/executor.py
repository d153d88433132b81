"""Executor of `AccumulatingTrainer`: the stock generic Trainer plus accumulation.

It resolves the accumulation settings (hyperparameters, then component
parameters, then defaults) and the distribution strategy before anything
trains, runs the user's unchanged run_fn with every compiled optimizer wrapped
in `GradientAccumulator`, and records what happened on the output artifacts
(ML Metadata) and in the run's TensorBoard logs.
"""

import json
import os
from typing import Any, Dict, List

import tensorflow as tf
from absl import logging
from tfx import types
from tfx.components.trainer import executor as tfx_trainer_executor
from tfx.components.util import udf_utils
from tfx.dsl.io import fileio
from tfx.types import standard_component_specs

from accumulator.autowrap import accumulating_compile
from accumulator.distribute import strategy_from_environment
from components import fn_args_utils, noise_scale, settings as settings_lib

ACCUM_STEPS_KEY = "accum_steps"
EFFECTIVE_BATCH_SIZE_KEY = "effective_batch_size"
STRATEGY_KEY = "strategy"
ACCUM_SCHEDULE_KEY = "accum_schedule"
PARTIAL_WINDOW_KEY = "partial_window"
MEASURE_NOISE_SCALE_KEY = "measure_noise_scale"
NOISE_SCALE_SMOOTHING_KEY = "noise_scale_smoothing"
MERGE_DUPLICATE_ROWS_KEY = "merge_duplicate_rows"
TENSORBOARD_SUBDIR = "accumulation"


def _load_run_fn(exec_properties):
    try:
        return udf_utils.get_fn(exec_properties, "run_fn")
    except (AttributeError, ValueError) as err:
        source = exec_properties.get("module_file") or exec_properties.get("module_path") \
            or exec_properties.get("run_fn")
        raise ValueError(
            f"AccumulatingTrainer needs a `run_fn(fn_args)` to train with; none was "
            f"found in {source!r} ({err})."
        ) from None


def _as_bool(value):
    return bool(value) if isinstance(value, int) and value in (0, 1) else value


class Executor(tfx_trainer_executor.GenericExecutor):
    """Runs the user's run_fn with accumulation, under a distribution strategy."""

    def Do(
        self,
        input_dict: Dict[str, List[types.Artifact]],
        output_dict: Dict[str, List[types.Artifact]],
        exec_properties: Dict[str, Any],
    ) -> None:
        self._log_startup(input_dict, output_dict, exec_properties)
        run_fn = _load_run_fn(exec_properties)
        fn_args = self._GetFnArgs(input_dict, output_dict, exec_properties)
        strategy = strategy_from_environment(exec_properties.get(STRATEGY_KEY) or "auto")
        settings = settings_lib.resolve(
            fn_args.hyperparameters,
            exec_properties.get(ACCUM_STEPS_KEY),
            exec_properties.get(EFFECTIVE_BATCH_SIZE_KEY),
            strategy.num_replicas_in_sync,
            json.loads(exec_properties[ACCUM_SCHEDULE_KEY]) if exec_properties.get(ACCUM_SCHEDULE_KEY) else None,
            exec_properties.get(PARTIAL_WINDOW_KEY),
            # Stored as an int (0/1) in the pipeline, as SchemaGen's infer_feature_shape.
            _as_bool(exec_properties.get(MEASURE_NOISE_SCALE_KEY)),
            exec_properties.get(NOISE_SCALE_SMOOTHING_KEY),
            exec_properties.get(MERGE_DUPLICATE_ROWS_KEY),
        )
        logging.info(
            "Accumulation: accum_steps=%d (%s), effective batch %s (%s), global micro-batch %s, "
            "%d replica(s) under %s; %s optimizer updates = %s micro-steps; partial windows: %s.",
            settings.accum_steps, settings.sources.get("accum_steps"),
            settings.effective_batch_size, settings.sources.get("effective_batch_size"),
            settings.micro_batch or "the run_fn's", settings.replicas, type(strategy).__name__,
            fn_args.train_steps, fn_args.train_steps and fn_args.train_steps * settings.accum_steps,
            settings.partial_window,
        )
        user_fn_args = fn_args_utils.for_accumulation(fn_args, settings)

        with accumulating_compile(settings.accum_steps, settings.schedule,
                                  settings.partial_window, strategy=strategy,
                                  measure_noise_scale=settings.measure_noise_scale,
                                  noise_scale_smoothing=settings.noise_scale_smoothing,
                                  merge_duplicate_rows=settings.merge_duplicate_rows) as optimizers:
            run_fn(user_fn_args)

        if not fileio.exists(fn_args.serving_model_dir):
            raise RuntimeError("run_fn failed to generate model.")
        if not optimizers:
            raise RuntimeError(
                "AccumulatingTrainer wrapped no optimizer: the run_fn never called "
                "`Model.compile(optimizer=...)` on a Keras 3 or Keras 2 (tf_keras) model, "
                "so nothing was accumulated and no accumulation is recorded. A run_fn "
                "with a custom training loop must wrap its optimizer itself "
                "(accumulator.GradientAccumulator) and use the stock Trainer."
            )
        open_windows = sum(o.held_micro_batches for o in optimizers)
        updates = max((int(o.iterations.numpy()) for o in optimizers), default=0)
        reading = noise_scale.read(optimizers, settings.measure_noise_scale)
        self._record(output_dict, fn_args.model_run_dir, settings, updates, strategy, open_windows, reading)
        if reading is not None:
            logging.info("%s", noise_scale.describe(reading, settings.effective_batch_size))
        logging.info(
            "Training complete: %d optimizer updates. Model written to %s. ModelRun written to %s",
            updates, fn_args.serving_model_dir, fn_args.model_run_dir,
        )

    @staticmethod
    def _record(output_dict, model_run_dir, settings, updates, strategy, open_windows, reading=None):
        # `unapplied_micro_batches`: held in a window left open (partial_window="carry").
        properties = {**settings.as_properties(), "optimizer_updates": updates,
                      "unapplied_micro_batches": open_windows}
        for key in (standard_component_specs.MODEL_KEY, standard_component_specs.MODEL_RUN_KEY):
            for artifact in output_dict.get(key, []):
                for name, value in properties.items():
                    artifact.set_int_custom_property(name, int(value))
                artifact.set_string_custom_property("distribution_strategy", type(strategy).__name__)
                artifact.set_string_custom_property("partial_window", settings.partial_window)
            noise_scale.record(output_dict.get(key, []), reading)
        writer = tf.summary.create_file_writer(os.path.join(model_run_dir, TENSORBOARD_SUBDIR))
        with writer.as_default():
            for name, value in properties.items():
                tf.summary.scalar(f"accumulation/{name}", value, step=0)
            noise_scale.write_summaries(reading, step=updates)
            tf.summary.text("accumulation/settings", json.dumps(
                {**properties, "strategy": type(strategy).__name__, "partial_window": settings.partial_window,
                 "sources": settings.sources},
                indent=1, sort_keys=True), step=0)
        writer.flush()
