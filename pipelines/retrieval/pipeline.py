"""The retrieval pipeline: ExampleGen → statistics → schema → Tuner → AccumulatingTrainer(gradient_cache=True).

A two-tower model trained with in-batch negatives (`pipelines/retrieval/model.py`)
on synthetic interactions with known clusters (`pipelines/retrieval/data.py`).
The Tuner searches `accum_steps` and the effective batch with
`AccumulatingHyperModel(..., gradient_cache=True)`; the Trainer trains the
best with `GradientCache`: batches of the effective batch (all of it the
negatives), one micro-batch's activations at a time. No Evaluator: TFMA has no
metric for ranking against every item, so `pipelines/retrieval/evaluate.py`
measures held-out recall@k from the exported model after the run
(`pipelines/run_local.py --pipeline=retrieval` prints it).

Two module files train the same two-tower model: `model.py` with Keras 3
(`model="keras"`, the default) and `tfrs_model.py` with TensorFlow Recommenders
on Keras 2 (`model="tfrs"`). The TFRS one has no Tuner (KerasTuner builds only
Keras 3 models: keras-team/keras-tuner#1039), so `max_trials` must be 0 with it;
and the process running the pipeline needs `TF_USE_LEGACY_KERAS=1` from its start
(`tfrs_model.py` says why).
"""

import os
from typing import Optional

from tfx import v1 as tfx

from tfx_gradient_accumulator.components import AccumulatingTrainer

_HERE = os.path.dirname(os.path.abspath(__file__))
# The module file of each flavour of the model: {model: path}.
MODULE_FILES = {"keras": os.path.join(_HERE, "model.py"), "tfrs": os.path.join(_HERE, "tfrs_model.py")}
MODELS_WITH_TUNER = ("keras",)   # KerasTuner builds Keras 3 models only


def create_pipeline(
    pipeline_name: str,
    pipeline_root: str,
    data_root: str,
    metadata_path: Optional[str] = None,
    train_updates: int = 300,
    tuner_updates: int = 30,
    eval_steps: int = 5,
    max_trials: int = 2,
    accum_steps: int = 4,
    effective_batch_size: int = 128,
    strategy: str = "auto",
    beam_pipeline_args=None,
    model: str = "keras",
    module_file: Optional[str] = None,
) -> tfx.dsl.Pipeline:
    """Builds the pipeline. `accum_steps`/`effective_batch_size` are the Trainer's
    defaults; the Tuner's best values replace them. `max_trials=0` leaves the
    Tuner out (the Trainer then trains with the defaults). `model` picks the
    module file: "keras" (Keras 3, tunable) or "tfrs" (TensorFlow Recommenders,
    `max_trials=0` only); `module_file` replaces it."""
    if model not in MODULE_FILES:
        raise ValueError(f"model={model!r}: one of {', '.join(map(repr, MODULE_FILES))}")
    if max_trials and model not in MODELS_WITH_TUNER:
        raise ValueError(f"max_trials={max_trials} with model={model!r}: the {model} module trains "
                         "without the Tuner (KerasTuner builds Keras 3 models only); pass max_trials=0")
    module_file = module_file or MODULE_FILES[model]
    example_gen = tfx.components.CsvExampleGen(input_base=data_root)
    statistics_gen = tfx.components.StatisticsGen(examples=example_gen.outputs["examples"])
    schema_gen = tfx.components.SchemaGen(
        statistics=statistics_gen.outputs["statistics"], infer_feature_shape=True
    )
    components = [example_gen, statistics_gen, schema_gen]
    hyperparameters = None
    if max_trials:
        tuner = tfx.components.Tuner(
            module_file=module_file,
            examples=example_gen.outputs["examples"],
            schema=schema_gen.outputs["schema"],
            train_args=tfx.proto.TrainArgs(num_steps=tuner_updates),
            eval_args=tfx.proto.EvalArgs(num_steps=eval_steps),
            custom_config={"max_trials": max_trials},
        )
        components.append(tuner)
        hyperparameters = tuner.outputs["best_hyperparameters"]
    trainer = AccumulatingTrainer(
        module_file=module_file,
        examples=example_gen.outputs["examples"],
        schema=schema_gen.outputs["schema"],
        hyperparameters=hyperparameters,
        train_args=tfx.proto.TrainArgs(num_steps=train_updates),
        eval_args=tfx.proto.EvalArgs(num_steps=eval_steps),
        accum_steps=accum_steps,
        effective_batch_size=effective_batch_size,
        strategy=strategy,
        gradient_cache=True,
    )
    components.append(trainer)
    return tfx.dsl.Pipeline(
        pipeline_name=pipeline_name,
        pipeline_root=pipeline_root,
        components=components,
        enable_cache=True,
        metadata_connection_config=(
            tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path)
            if metadata_path else None
        ),
        beam_pipeline_args=beam_pipeline_args or ["--direct_running_mode=in_memory", "--direct_num_workers=1"],
    )
