"""End to end: the digits pipeline on the Beam DirectRunner, then again from cache, then its
Trainer with `micro_batch_size` (the data components and the Tuner from cache)."""

import glob
import math
import os

import ml_metadata as mlmd
import pytest
import tensorflow as tf
from ml_metadata.proto import metadata_store_pb2
from tfx import v1 as tfx
from tfx.orchestration.beam.beam_dag_runner import BeamDagRunner

from tfx_gradient_accumulator.pipelines.digits.data import write_digits_csv
from tfx_gradient_accumulator.pipelines.digits.pipeline import create_pipeline
from tfx_gradient_accumulator.pipelines.run_local import micro_batch_line, noise_scale_line, summarize


def _tensorboard_noise_scale(model_run_uri, tag="accumulation/noise_scale"):
    """{step: value} of the executor's `accumulation/noise_scale` scalar (or another `tag`)."""
    values = {}
    for path in glob.glob(os.path.join(model_run_uri, "accumulation", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = float(tf.make_ndarray(value.tensor))
    return values


def test_digits_pipeline_runs_end_to_end_and_reuses_its_cache(tmp_path):
    data_root = str(tmp_path / "data")
    write_digits_csv(data_root)
    metadata_path = str(tmp_path / "metadata.sqlite")
    serving = str(tmp_path / "serving")

    def run(**trainer):
        BeamDagRunner().run(create_pipeline(
            pipeline_name="digits_test", pipeline_root=str(tmp_path / "root"), data_root=data_root,
            serving_model_dir=serving, metadata_path=metadata_path, train_updates=120,
            tuner_updates=8, eval_steps=2, max_trials=2, accuracy_threshold=0.3,
            **{"measure_noise_scale": True, **trainer},
        ))

    run()
    summary = summarize(metadata_path, "digits_test")
    best = summary["best_hyperparameters"]
    assert best["accum_steps"] in (2, 4) and best["effective_batch_size"] in (32, 64)
    trainer = summary["trainer"]
    assert trainer["accum_steps"] == best["accum_steps"]
    assert trainer["effective_batch_size"] == best["effective_batch_size"]
    assert trainer["micro_batch_size"] == best["effective_batch_size"] // best["accum_steps"]
    assert trainer["optimizer_updates"] == 120
    assert (trainer["partial_window"], trainer["distribution_strategy"]) == ("apply", "_DefaultDistributionStrategy")
    # The gradient noise scale, measured over the 120 windows and recorded as a float.
    assert (trainer["measure_noise_scale"], trainer["noise_scale_windows"]) == (1, 120)
    assert trainer["noise_scale_status"] == "measured"
    assert isinstance(trainer["noise_scale"], float) and math.isfinite(trainer["noise_scale"])
    assert trainer["noise_scale"] > 0
    assert "B_simple = " in noise_scale_line(trainer)
    store = mlmd.MetadataStore(tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path))
    (model_run,) = store.get_artifacts_by_type("ModelRun")
    assert _tensorboard_noise_scale(model_run.uri) == {120: pytest.approx(trainer["noise_scale"], rel=1e-6)}
    assert summary["evaluation"]["sparse_categorical_accuracy"] > 0.3
    assert summary["blessed"] and summary["pushed"]
    assert os.path.exists(os.path.join(summary["pushed_to"], "saved_model.pb"))

    first = len(store.get_executions())
    run()
    again = sorted(store.get_executions(), key=lambda e: e.id)[first:]
    assert len(again) == 7
    assert all(e.last_known_state == metadata_store_pb2.Execution.CACHED for e in again)

    # The Trainer with micro_batch_size: the Tuner's effective batch is fit's batch, each of
    # the 120 updates one step split into micro-batches of 16; the tuned accum_steps is not applied.
    first = len(store.get_executions())
    run(micro_batch_size=16, measure_noise_scale=False)
    states = {store.get_execution_types_by_id([e.type_id])[0].name.rsplit(".", 1)[-1]: e.last_known_state
              for e in store.get_executions()[first:]}
    assert states["Tuner"] == metadata_store_pb2.Execution.CACHED
    assert states["AccumulatingTrainer"] == metadata_store_pb2.Execution.COMPLETE
    summary = summarize(metadata_path, "digits_test")
    trainer = summary["trainer"]
    assert (trainer["effective_batch_size"], trainer["micro_batch_size"], trainer["accum_steps"]) == (
        best["effective_batch_size"], 16, 1)
    assert trainer["micro_batches_per_update"] == best["effective_batch_size"] // 16
    assert (trainer["optimizer_updates"], trainer["micro_batch_size_auto"], trainer["micro_batch_changes"]) == (
        120, 0, "[]")
    assert "measure_noise_scale" in trainer and "noise_scale" not in trainer
    assert f"micro-batches of 16 inside one step" in micro_batch_line(trainer)
    model_run = max(store.get_artifacts_by_type("ModelRun"), key=lambda a: a.id)
    assert _tensorboard_noise_scale(model_run.uri, "accumulation/micro_batch_size_taken") == {0: 16.0}
    assert summary["evaluation"]["sparse_categorical_accuracy"] > 0.3
    assert summary["blessed"] and summary["pushed"]


@pytest.mark.parametrize("arguments, micro_batch_size, measure", [
    ((), None, True),                                   # the demo's default: accum_steps, the noise scale
    (("--micro_batch_size=16",), 16, False),            # the noise scale off by default with it
    (("--micro_batch_size=auto",), "auto", False),
    (("--micro_batch_size=16", "--nomeasure_noise_scale"), 16, False),
])
def test_the_demo_flag_trains_the_trainer_with_micro_batch_size(command_line, arguments, micro_batch_size, measure):
    from tfx_gradient_accumulator.pipelines import run_local

    command_line(*arguments)
    given = run_local.micro_batch_size_flag(run_local.MICRO_BATCH_SIZE.value)
    assert (given, run_local._digits_measure(given)) == (micro_batch_size, measure)


def test_bad_demo_micro_batch_flags_are_refused_naming_the_flag(command_line):
    from absl import app

    from tfx_gradient_accumulator.pipelines import run_local

    with pytest.raises(app.UsageError, match=r"--micro_batch_size='big': an int >= 1 or 'auto'"):
        run_local.micro_batch_size_flag("big")
    command_line("--micro_batch_size=16", "--measure_noise_scale")
    with pytest.raises(app.UsageError, match="--measure_noise_scale with --micro_batch_size"):
        run_local._digits_measure(16)
