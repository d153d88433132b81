"""End to end: the retrieval pipeline (GradientCache in the Trainer) on the Beam DirectRunner,
run as `python -m tfx_gradient_accumulator.pipelines.run_local --pipeline=retrieval` runs it, then again from cache.

References: the Tuner's best hyperparameters (what the Trainer must have trained
with), and the data's known structure: ranking by the generating distribution
reaches IN_CLUSTER + (1 - IN_CLUSTER) x 10 / ITEMS = 0.81 recall@10 (checked, so the
recall code is checked too), chance reaches 10 / ITEMS = 0.05.
"""

import ml_metadata as mlmd
import pytest
from absl import app
from ml_metadata.proto import metadata_store_pb2
from tfx import v1 as tfx

from tfx_gradient_accumulator.pipelines import run_local
from tfx_gradient_accumulator.pipelines.retrieval import data


def test_retrieval_pipeline_runs_end_to_end_and_reuses_its_cache(tmp_path, command_line, capsys):
    command_line("--pipeline=retrieval", f"--output_dir={tmp_path}", "--train_updates=120",
                 "--tuner_updates=8", "--max_trials=2")
    run_local.main([])
    printed = capsys.readouterr().out
    metadata_path = str(tmp_path / "metadata.sqlite")
    summary = run_local.summarize(metadata_path, "retrieval_gradient_cache")
    best = summary["best_hyperparameters"]
    assert best["accum_steps"] in (2, 4) and best["effective_batch_size"] in (64, 128)
    trainer = summary["trainer"]
    assert (trainer["gradient_cache"], trainer["accum_steps"], trainer["effective_batch_size"]) == \
        (1, best["accum_steps"], best["effective_batch_size"])
    assert trainer["micro_batch_size"] == best["effective_batch_size"] // best["accum_steps"]
    assert (trainer["optimizer_updates"], trainer["unapplied_micro_batches"]) == (120, 0)
    assert (trainer["measure_noise_scale"], trainer["merge_duplicate_rows"], trainer["replicas"]) == (0, 0, 1)
    assert "noise_scale_status" not in trainer

    recall = run_local.retrieval_recall(metadata_path)
    chance = 10 / data.ITEMS
    assert recall["chance_recall_at_k"] == pytest.approx(chance)
    oracle = data.IN_CLUSTER + (1 - data.IN_CLUSTER) * chance
    assert recall["oracle_recall_at_k"] == pytest.approx(oracle, abs=0.03)
    print("recall@10", recall)
    assert 8 * chance < recall["recall_at_k"] <= recall["oracle_recall_at_k"] + 0.03
    assert run_local.recall_line(recall) in printed
    assert '"gradient_cache": 1' in printed

    store = mlmd.MetadataStore(tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path))
    first = len(store.get_executions())
    assert first == 5     # CsvExampleGen, StatisticsGen, SchemaGen, Tuner, AccumulatingTrainer
    run_local.main([])
    again = sorted(store.get_executions(), key=lambda e: e.id)[first:]
    assert len(again) == 5
    assert all(e.last_known_state == metadata_store_pb2.Execution.CACHED for e in again)


def test_measure_noise_scale_is_refused_for_the_retrieval_pipeline(tmp_path, command_line):
    command_line("--pipeline=retrieval", f"--output_dir={tmp_path}", "--measure_noise_scale")
    with pytest.raises(app.UsageError, match="gradient_cache=True"):
        run_local.main([])
    assert not (tmp_path / "data").exists()
