"""A Tuner that searches the effective batch alone (`AccumulatingHyperModel(accum_steps="fit")`),
then the Trainer, on the Beam DirectRunner: every trial completes, the one above the model's
memory cliff included, and the Trainer finds its own micro-batch from the best hyperparameters."""

import json
import os

from tfx import v1 as tfx
from tfx.orchestration.beam.beam_dag_runner import BeamDagRunner

from tfx_gradient_accumulator.components import AccumulatingTrainer
from tfx_gradient_accumulator.pipelines.digits.data import write_digits_csv
from tfx_gradient_accumulator.pipelines.digits.pipeline import data_components
from tfx_gradient_accumulator.pipelines.run_local import beam_pipeline_args, latest_artifacts, summarize
from tests.components import fixtures
from tests.components.testdata import memory_cliff_tuning_module as module

MODULE = os.path.join(fixtures.TESTDATA, "memory_cliff_tuning_module.py")


def _pipeline(tmp_path, metadata_path):
    data_root = str(tmp_path / "data")
    write_digits_csv(data_root)
    example_gen, statistics_gen, schema_gen = data_components(data_root)
    tuner = tfx.components.Tuner(
        module_file=MODULE, examples=example_gen.outputs["examples"], schema=schema_gen.outputs["schema"],
        train_args=tfx.proto.TrainArgs(num_steps=4), eval_args=tfx.proto.EvalArgs(num_steps=2))
    trainer = AccumulatingTrainer(
        module_file=MODULE, examples=example_gen.outputs["examples"], schema=schema_gen.outputs["schema"],
        hyperparameters=tuner.outputs["best_hyperparameters"],
        train_args=tfx.proto.TrainArgs(num_steps=4), eval_args=tfx.proto.EvalArgs(num_steps=2),
        accum_steps=2, effective_batch_size=32)     # the tuned "fit" and batch replace both
    return tfx.dsl.Pipeline(
        pipeline_name="tuned_fit", pipeline_root=str(tmp_path / "root"),
        components=[example_gen, statistics_gen, schema_gen, tuner, trainer], enable_cache=False,
        metadata_connection_config=tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path),
        beam_pipeline_args=beam_pipeline_args())


def test_a_search_over_the_effective_batch_alone_completes_and_the_trainer_fits_the_best(tmp_path):
    metadata_path = str(tmp_path / "metadata.sqlite")
    BeamDagRunner().run(_pipeline(tmp_path, metadata_path))

    results = latest_artifacts(metadata_path)("TunerResults")
    with open(os.path.join(results.uri, "tuner_results.json")) as f:
        completed = json.load(f)       # the Tuner's record of its COMPLETED trials
    assert sorted(t["effective_batch_size"] for t in completed) == sorted(module.EFFECTIVE_BATCH_SIZES)
    assert all(t["accum_steps"] == "fit" for t in completed)

    summary = summarize(metadata_path, "tuned_fit")
    best = summary["best_hyperparameters"]
    assert best["accum_steps"] == "fit" and best["effective_batch_size"] in module.EFFECTIVE_BATCH_SIZES
    trainer = summary["trainer"]
    print(f"best effective batch {best['effective_batch_size']}: the Trainer trained "
          f"{trainer['micro_batch_size']} x {trainer['accum_steps']}")
    assert trainer["accum_steps_fit"] == 1 and trainer["effective_batch_size"] == best["effective_batch_size"]
    assert trainer["micro_batch_size"] * trainer["accum_steps"] == best["effective_batch_size"]
    assert trainer["micro_batch_size"] < module.CLIFF
    assert trainer["largest_fitting_micro_batch"] == min(module.CLIFF - 1, best["effective_batch_size"])
