"""The digits pipeline: ExampleGen → statistics → schema → Tuner → AccumulatingTrainer → Evaluator → Pusher.

`create_pipeline` returns a `tfx.dsl.Pipeline`; `pipelines/run_local.py` runs it
with the Beam DirectRunner, `pipelines/compile_kubeflow.py` compiles it for
Kubeflow Pipelines v2 / Vertex AI.
"""

import os
from typing import Optional

import tensorflow_model_analysis as tfma
from tfx import v1 as tfx

from tfx_gradient_accumulator.components import AccumulatingTrainer
from tfx_gradient_accumulator.pipelines.digits.data import LABEL_KEY

MODULE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.py")
# The same module by import path: where this project is installed (the cluster's
# image), the Tuner and Trainer import `tuner_fn` / `run_fn` from it, and nothing
# is packaged into the pipeline root.
MODULE = "tfx_gradient_accumulator.pipelines.digits.model"
ACCURACY_THRESHOLD = 0.8


def eval_config(threshold=ACCURACY_THRESHOLD):
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


def data_components(data_root: str):
    """The data components, in order: CsvExampleGen (of the CSV under `data_root`),
    StatisticsGen, SchemaGen. The first two run on Beam."""
    example_gen = tfx.components.CsvExampleGen(input_base=data_root)
    statistics_gen = tfx.components.StatisticsGen(examples=example_gen.outputs["examples"])
    schema_gen = tfx.components.SchemaGen(
        statistics=statistics_gen.outputs["statistics"], infer_feature_shape=True
    )
    return example_gen, statistics_gen, schema_gen


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
) -> tfx.dsl.Pipeline:
    """Builds the pipeline. `accum_steps`/`effective_batch_size` are the Trainer's

    defaults; the Tuner's best values replace them. `measure_noise_scale`: the
    Trainer estimates the gradient noise scale and records it on its model.
    `backup_dir`, `backup_every`: the Trainer backs training up there and a
    restarted Trainer resumes (AccumulatingTrainer's parameters).

    The Tuner and Trainer get their code from `module_file` (a path, packaged by
    TFX as a wheel under the pipeline root when the pipeline is compiled or run)
    or, when `module` is given, by import path (`f"{module}.tuner_fn"`,
    `f"{module}.run_fn"`): nothing is packaged, so compiling with a remote
    pipeline root needs no access to it, and the runtime image must have the
    module installed.
    """
    if module:
        code = dict(tuner=dict(tuner_fn=f"{module}.tuner_fn"), trainer=dict(run_fn=f"{module}.run_fn"))
    else:
        code = dict(tuner=dict(module_file=module_file), trainer=dict(module_file=module_file))
    example_gen, statistics_gen, schema_gen = data_components(data_root)
    tuner = tfx.components.Tuner(
        **code["tuner"],
        examples=example_gen.outputs["examples"],
        schema=schema_gen.outputs["schema"],
        train_args=tfx.proto.TrainArgs(num_steps=tuner_updates),
        eval_args=tfx.proto.EvalArgs(num_steps=eval_steps),
        custom_config={"max_trials": max_trials},
    )
    trainer = trainer_class(
        **code["trainer"],
        custom_config=trainer_custom_config,
        examples=example_gen.outputs["examples"],
        schema=schema_gen.outputs["schema"],
        hyperparameters=tuner.outputs["best_hyperparameters"],
        train_args=tfx.proto.TrainArgs(num_steps=train_updates),
        eval_args=tfx.proto.EvalArgs(num_steps=eval_steps),
        accum_steps=accum_steps,
        effective_batch_size=effective_batch_size,
        strategy=strategy,
        measure_noise_scale=measure_noise_scale,
        backup_dir=backup_dir,
        backup_every=backup_every,
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
        beam_pipeline_args=beam_pipeline_args or ["--direct_running_mode=in_memory", "--direct_num_workers=1"],
    )
