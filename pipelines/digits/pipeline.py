"""The digits pipeline: ExampleGen → statistics → schema → Tuner → AccumulatingTrainer → Evaluator → Pusher.

`create_pipeline` returns a `tfx.dsl.Pipeline`; `pipelines/run_local.py` runs it
with the Beam DirectRunner, `pipelines/compile_kubeflow.py` compiles it for
Kubeflow Pipelines v2 / Vertex AI.
"""

import os
from typing import Optional, Union

import tensorflow_model_analysis as tfma
from tfx import v1 as tfx

from tfx_gradient_accumulator.components import AccumulatingTrainer, TrainerOptions
from tfx_gradient_accumulator.pipelines.digits.data import LABEL_KEY

MODULE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.py")
# The same module by import path: where this project is installed (the cluster's
# image), the Tuner and Trainer import `tuner_fn` / `run_fn` from it, and nothing
# is packaged into the pipeline root.
MODULE = "tfx_gradient_accumulator.pipelines.digits.model"
ACCURACY_THRESHOLD = 0.8


def eval_config(threshold: float = ACCURACY_THRESHOLD) -> tfma.EvalConfig:
    """The Evaluator's config: example count, and accuracy that blesses the model.

    Args:
        threshold: the sparse categorical accuracy's lower bound for blessing.

    Returns:
        The TFMA `EvalConfig`.
    """
    return tfma.EvalConfig(
        model_specs=[tfma.ModelSpec(
            label_key=LABEL_KEY, signature_name="serving_default",
            prediction_key="probabilities", model_type="tf_generic",
        )],
        slicing_specs=[tfma.SlicingSpec()],
        metrics_specs=[tfma.MetricsSpec(metrics=[
            tfma.MetricConfig(class_name="ExampleCount"),
            tfma.MetricConfig(
                class_name="SparseCategoricalAccuracy",
                threshold=tfma.MetricThreshold(
                    value_threshold=tfma.GenericValueThreshold(lower_bound={"value": threshold})
                ),
            ),
        ])],
    )


def data_components(data_root: str) -> tuple:
    """The data components, in order: CsvExampleGen, StatisticsGen, SchemaGen.

    The first two run on Beam.

    Args:
        data_root: the folder holding the CSV.

    Returns:
        `(example_gen, statistics_gen, schema_gen)`.
    """
    example_gen = tfx.components.CsvExampleGen(input_base=data_root)
    statistics_gen = tfx.components.StatisticsGen(examples=example_gen.outputs["examples"])
    schema_gen = tfx.components.SchemaGen(
        statistics=statistics_gen.outputs["statistics"], infer_feature_shape=True
    )
    return example_gen, statistics_gen, schema_gen


def tuner_component(code: dict, example_gen, schema_gen, tuner_updates: int, eval_steps: int,
                    max_trials: int):
    """The Tuner: `tuner_fn` (by `module_file` or by import path, as `code` says) over the
    examples and schema, `tuner_updates` optimizer updates per trial, `max_trials` trials."""
    return tfx.components.Tuner(
        **code,
        examples=example_gen.outputs["examples"],
        schema=schema_gen.outputs["schema"],
        train_args=tfx.proto.TrainArgs(num_steps=tuner_updates),
        eval_args=tfx.proto.EvalArgs(num_steps=eval_steps),
        custom_config={"max_trials": max_trials},
    )


def create_pipeline(
    pipeline_name: str,
    pipeline_root: str,
    data_root: str,
    serving_model_dir: str,
    metadata_path: Optional[str] = None,
    train_updates: int = 400,
    tuner_updates: int = 60,
    eval_steps: int = 5,
    max_trials: int = 4,
    accum_steps: int = 4,
    effective_batch_size: int = 64,
    accuracy_threshold: float = ACCURACY_THRESHOLD,
    strategy: str = "auto",
    beam_pipeline_args=None,
    module_file: Optional[str] = MODULE_FILE,
    module: Optional[str] = None,
    trainer_class=AccumulatingTrainer,
    trainer_custom_config=None,
    measure_noise_scale: bool = False,
    backup_dir: Optional[str] = None,
    backup_every: Optional[int] = None,
    lr_scaling: str = "none",
    lr_ramp_updates: Optional[int] = None,
    micro_batch_size: Optional[Union[int, str]] = None,
) -> tfx.dsl.Pipeline:
    """Builds the digits pipeline.

    Args:
        pipeline_name: the pipeline's name in ML Metadata.
        pipeline_root: where the components' artifacts go.
        data_root: the folder holding `digits.csv`.
        serving_model_dir: the Pusher's destination.
        metadata_path: a SQLite ML Metadata file; None: the orchestrator's store.
        train_updates: the Trainer's optimizer updates (`TrainArgs.num_steps`).
        tuner_updates: each tuning trial's optimizer updates.
        eval_steps: evaluation steps of the Tuner and the Trainer.
        max_trials: tuning trials.
        accum_steps: the Trainer's default; the Tuner's best value replaces it.
        effective_batch_size: the Trainer's default; the Tuner's best value
            replaces it.
        accuracy_threshold: the Evaluator's accuracy lower bound for blessing.
        strategy: the Trainer's `strategy` ("auto" reads the environment).
        beam_pipeline_args: Beam's arguments; None or an empty list: Beam's
            defaults, the direct runner in memory with one worker (why none rather
            than those two flags: `run_local.beam_pipeline_args`).
        module_file: the Tuner's and Trainer's code by path (packaged by TFX as
            a wheel under the pipeline root when the pipeline is compiled or run).
        module: the same code by import path instead (`f"{module}.tuner_fn"`,
            `f"{module}.run_fn"`): nothing is packaged, so compiling with a
            remote pipeline root needs no access to it, and the runtime image
            must have the module installed.
        trainer_class: `AccumulatingTrainer` or a subclass
            (`VertexAccumulatingTrainer`).
        trainer_custom_config: the Trainer's `custom_config`
            (`vertex_training_config` on Vertex AI).
        measure_noise_scale: the Trainer estimates the gradient noise scale
            and records it on its model.
        backup_dir: the Trainer backs training up there, and a restarted
            Trainer resumes (AccumulatingTrainer's option).
        backup_every: optimizer updates between backups.
        lr_scaling: the Trainer's learning-rate rule when the batch changes.
        lr_ramp_updates: the Trainer's learning-rate ramp (None: its default).
        micro_batch_size: None, or the Trainer's `micro_batch_size` (an int or
            "auto"), which splits the effective batch inside each step instead of
            `accum_steps` (not applied then; `measure_noise_scale` must be off).

    Returns:
        The `tfx.dsl.Pipeline`: ExampleGen, StatisticsGen, SchemaGen, Tuner,
        the Trainer, Evaluator, Pusher.
    """
    if module:
        code = dict(tuner=dict(tuner_fn=f"{module}.tuner_fn"), trainer=dict(run_fn=f"{module}.run_fn"))
    else:
        code = dict(tuner=dict(module_file=module_file), trainer=dict(module_file=module_file))
    example_gen, statistics_gen, schema_gen = data_components(data_root)
    tuner = tuner_component(code["tuner"], example_gen, schema_gen, tuner_updates, eval_steps, max_trials)
    trainer = trainer_class(
        **code["trainer"],
        custom_config=trainer_custom_config,
        examples=example_gen.outputs["examples"],
        schema=schema_gen.outputs["schema"],
        hyperparameters=tuner.outputs["best_hyperparameters"],
        train_args=tfx.proto.TrainArgs(num_steps=train_updates),
        eval_args=tfx.proto.EvalArgs(num_steps=eval_steps),
        accum_steps=accum_steps if micro_batch_size is None else None,     # one way to split E, not two
        micro_batch_size=micro_batch_size,
        effective_batch_size=effective_batch_size,
        strategy=strategy,
        options=TrainerOptions(measure_noise_scale=measure_noise_scale, backup_dir=backup_dir,
                               backup_every=backup_every, lr_scaling=lr_scaling, lr_ramp_updates=lr_ramp_updates),
    )
    evaluator = tfx.components.Evaluator(
        examples=example_gen.outputs["examples"],
        model=trainer.outputs["model"],
        eval_config=eval_config(accuracy_threshold),
    )
    pusher = tfx.components.Pusher(
        model=trainer.outputs["model"],
        model_blessing=evaluator.outputs["blessing"],
        push_destination=tfx.proto.PushDestination(
            filesystem=tfx.proto.PushDestination.Filesystem(base_directory=serving_model_dir)
        ),
    )
    return tfx.dsl.Pipeline(
        pipeline_name=pipeline_name,
        pipeline_root=pipeline_root,
        components=[example_gen, statistics_gen, schema_gen, tuner, trainer, evaluator, pusher],
        enable_cache=True,
        metadata_connection_config=(
            tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path)
            if metadata_path else None
        ),
        beam_pipeline_args=list(beam_pipeline_args or ()),
    )
