"""The retrieval pipeline: ExampleGen → statistics → schema → Tuner → AccumulatingTrainer(options=TrainerOptions(gradient_cache=True)).

A two-tower model trained with in-batch negatives on synthetic interactions
with known clusters; no Evaluator (`evaluate.py` measures held-out recall@k).
`model="keras"` (Keras 3, tuned) or `model="tfrs"` (TensorFlow Recommenders on
Keras 2, no Tuner; the process needs `TF_USE_LEGACY_KERAS=1` from its start).
"""

import os
from typing import Optional

from tfx import v1 as tfx

from tfx_gradient_accumulator.components import AccumulatingTrainer, TrainerOptions

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
    """Builds the retrieval pipeline.

    Args:
        pipeline_name: the pipeline's name in ML Metadata.
        pipeline_root: where the components' artifacts go.
        data_root: the folder holding `interactions.csv`.
        metadata_path: a SQLite ML Metadata file; None: the orchestrator's store.
        train_updates: the Trainer's optimizer updates (`TrainArgs.num_steps`).
        tuner_updates: each tuning trial's optimizer updates.
        eval_steps: evaluation steps of the Tuner and the Trainer.
        max_trials: tuning trials; 0 leaves the Tuner out (the Trainer then
            trains with the defaults).
        accum_steps: the Trainer's default; the Tuner's best value replaces it.
        effective_batch_size: the Trainer's default; the Tuner's best value
            replaces it.
        strategy: the Trainer's `strategy` ("auto" reads the environment).
        beam_pipeline_args: Beam's arguments; None or an empty list: Beam's
            defaults, the direct runner in memory with one worker (why none rather
            than those two flags: `run_local.beam_pipeline_args`).
        model: which module file: "keras" (Keras 3, tunable) or "tfrs"
            (TensorFlow Recommenders on Keras 2, `max_trials=0` only).
        module_file: a module file of your own instead of `model`'s.

    Returns:
        The `tfx.dsl.Pipeline`: ExampleGen, StatisticsGen, SchemaGen, the
        Tuner (unless `max_trials=0`), `AccumulatingTrainer(options=TrainerOptions(gradient_cache=True))`.

    Raises:
        ValueError: `model` is not "keras" or "tfrs", or `max_trials` is not 0
            with a model that has no Tuner.
    """
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
        options=TrainerOptions(gradient_cache=True),
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
        beam_pipeline_args=list(beam_pipeline_args or ()),
    )
