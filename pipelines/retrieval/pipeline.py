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
"""

import os
from typing import Optional

from tfx import v1 as tfx

from tfx_gradient_accumulator.components import AccumulatingTrainer

MODULE_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "model.py")


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
    module_file: str = MODULE_FILE,
) -> tfx.dsl.Pipeline:
    """Builds the pipeline. `accum_steps`/`effective_batch_size` are the Trainer's
    defaults; the Tuner's best values replace them. `max_trials=0` leaves the
    Tuner out (the Trainer then trains with the defaults)."""
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
