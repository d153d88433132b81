"""End to end: the digits pipeline on the Beam DirectRunner, then again from cache."""

import os

import ml_metadata as mlmd
from ml_metadata.proto import metadata_store_pb2
from tfx import v1 as tfx
from tfx.orchestration.beam.beam_dag_runner import BeamDagRunner

from pipelines.digits.data import write_digits_csv
from pipelines.digits.pipeline import create_pipeline
from pipelines.run_local import summarize


def test_digits_pipeline_runs_end_to_end_and_reuses_its_cache(tmp_path):
    data_root = str(tmp_path / "data")
    write_digits_csv(data_root)
    metadata_path = str(tmp_path / "metadata.sqlite")
    serving = str(tmp_path / "serving")

    def run():
        BeamDagRunner().run(create_pipeline(
            pipeline_name="digits_test", pipeline_root=str(tmp_path / "root"), data_root=data_root,
            serving_model_dir=serving, metadata_path=metadata_path, train_updates=120,
            tuner_updates=8, eval_steps=2, max_trials=2, accuracy_threshold=0.3,
        ))

    run()
    summary = summarize(metadata_path, "digits_test")
    best = summary["best_hyperparameters"]
    assert best["accum_steps"] in (1, 2, 4) and best["effective_batch_size"] in (32, 64)
    trainer = summary["trainer"]
    assert trainer["accum_steps"] == best["accum_steps"]
    assert trainer["effective_batch_size"] == best["effective_batch_size"]
    assert trainer["micro_batch_size"] == best["effective_batch_size"] // best["accum_steps"]
    assert trainer["optimizer_updates"] == 120
    assert (trainer["partial_window"], trainer["distribution_strategy"]) == ("apply", "_DefaultDistributionStrategy")
    assert summary["evaluation"]["sparse_categorical_accuracy"] > 0.3
    assert summary["blessed"] and summary["pushed"]
    assert os.path.exists(os.path.join(summary["pushed_to"], "saved_model.pb"))

    store = mlmd.MetadataStore(tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path))
    first = len(store.get_executions())
    run()
    again = sorted(store.get_executions(), key=lambda e: e.id)[first:]
    assert len(again) == 7
    assert all(e.last_known_state == metadata_store_pb2.Execution.CACHED for e in again)
