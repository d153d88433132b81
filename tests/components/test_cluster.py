"""AccumulatingTrainer on a cluster, as Vertex AI runs it: 2 processes on 127.0.0.1.

Each replica runs TFX's `run_executor` with the container command TFX's Vertex
client generates, and the TF_CONFIG Vertex sets (chief + worker), over the same
examples and the same output artifacts. The module files are unchanged: the
penguin-style test module (it exports from every worker, as the stock example
does) and the digits demo's.
"""

import glob
import os
import signal

import numpy as np
import pytest

from tests.accumulator.reference import max_abs_diff
from tests.components import fixtures, local_cluster

STEPS, ACCUM, EFFECTIVE = 6, 4, 32      # 2 replicas x micro-batch 4 x 4 = the stock run's batch 32


@pytest.fixture(scope="module")
def stock(stock_regression):
    """The stock Trainer in one process at batch 32: the large batch (6 steps, shared with test_executor)."""
    outputs, seen, weights = stock_regression
    assert seen["train_batch"] == EFFECTIVE and seen["iterations"] == STEPS
    return weights, _predictions(outputs)


def _predictions(outputs):
    """The exported model's predictions on fixed inputs (its `serve` endpoint)."""
    import tensorflow as tf
    served = tf.saved_model.load(os.path.join(outputs["model"][0].uri, "Format-Serving"))
    x = np.random.RandomState(1).randn(4, 64, 1).astype("float32")
    return served.serve([tf.constant(column) for column in x]).numpy()


def _model_dir_entries(outputs):
    return sorted(os.listdir(outputs["model"][0].uri))


@pytest.fixture(scope="module")
def vertex_job(examples, tmp_path_factory):
    """`VertexExecutor.Do` through TFX's own Vertex runner on 2 workers, the CustomJob's pools
    (a chief and a worker) run here: (output artifacts, the CustomJob, each replica's
    (exit code, stdout, stderr), the replicas' TMPDIRs' folder). The job that the two tests
    below check, each its side: the cluster's training and exports, and the executor's."""
    from tfx.extensions.google_cloud_ai_platform import runner, training_clients

    from tfx_gradient_accumulator.components import cloud

    tmp = tmp_path_factory.mktemp("vertex")
    jobs, results = [], []

    def launch(project, training_job, enable_vertex, vertex_region):
        jobs.append(training_job)
        results.extend(local_cluster.run_custom_job(training_job, tmp / "tmp"))

    inputs, outputs, properties = fixtures.executor_arguments(
        tmp / "run", examples, num_steps=STEPS, accum_steps=ACCUM, effective_batch_size=EFFECTIVE,
        custom_config=cloud.vertex_training_config("p", "europe-west4", "img", workers=2, gpus_per_worker=0,
                                                   restart_job_on_worker_restart=True))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setattr(training_clients.VertexJobClient, "create_client", lambda self: None)
        monkeypatch.setattr(runner, "_launch_cloud_training", launch)
        cloud.VertexExecutor(None).Do(inputs, outputs, properties)
    [job] = jobs
    return outputs, job, results, tmp / "tmp"


def test_two_processes_train_like_the_large_batch_and_only_the_chief_exports_and_records(vertex_job, stock):
    outputs, _, results, replicas = vertex_job
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]

    seen, weights = fixtures.read_run(outputs["model_run"][0].uri)     # the chief's run_fn wrote these
    assert (seen["strategy"], seen["iterations"], seen["train_batch"]) == ("CollectiveAllReduceStrategy", STEPS, 8)  # MultiWorkerMirroredStrategy
    stock_weights, stock_predictions = stock
    print(f"[measured] 2 processes vs the one-process large batch: max |dw| = "
          f"{max_abs_diff(weights, stock_weights):.1e}, exported predictions "
          f"{np.abs(_predictions(outputs) - stock_predictions).max():.1e}")
    assert max_abs_diff(weights, stock_weights) <= 1e-5
    assert _model_dir_entries(outputs) == ["Format-Serving"]
    assert np.abs(_predictions(outputs) - stock_predictions).max() <= 1e-5     # the exported model itself

    chief, worker = (local_cluster.published(out) for _, out, _ in results)
    recorded = local_cluster.custom_properties(chief["model"][0])
    assert {k: recorded[k] for k in ("replicas", "workers", "accum_steps", "micro_batch_size",
                                     "effective_batch_size", "optimizer_updates")} == {
        "replicas": 2, "workers": 2, "accum_steps": ACCUM, "micro_batch_size": 8,
        "effective_batch_size": EFFECTIVE, "optimizer_updates": STEPS}
    assert recorded["effective_batch_size"] == recorded["replicas"] * 4 * recorded["accum_steps"]
    assert recorded["distribution_strategy"] == "CollectiveAllReduceStrategy"
    assert local_cluster.custom_properties(chief["model_run"][0]) == recorded
    assert local_cluster.custom_properties(worker["model"][0]) == {}                  # the worker records nothing
    summaries = glob.glob(os.path.join(outputs["model_run"][0].uri, "accumulation", "events.out.tfevents.*"))
    assert len(summaries) == 1                                           # TensorBoard: once
    assert os.listdir(replicas / "replica1") == []                       # the worker's exports are gone


def _stock_two_lines_on_two_processes(tmp_path):
    """The control: without this project, the module's `MirroredStrategy()` after the
    executor's `MultiWorkerMirroredStrategy`, on 2 processes; their exit codes."""
    import json
    import subprocess
    import sys

    import portpicker
    cluster = {"chief": [f"127.0.0.1:{portpicker.pick_unused_port()}"],
               "worker": [f"127.0.0.1:{portpicker.pick_unused_port()}"]}
    code = "import tensorflow as tf; tf.distribute.MultiWorkerMirroredStrategy(); tf.distribute.MirroredStrategy()"
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TF_CONFIG=json.dumps(
                                  {"cluster": cluster, "task": {"type": job, "index": 0}})))
             for job in ("chief", "worker")]
    return [proc.wait(timeout=300) for proc in procs]


@pytest.mark.apart      # TFX's penguin module (tests/components/test_penguin.py) makes one too, in make test
def test_a_run_fn_that_makes_its_own_mirrored_strategy_trains_on_two_processes(examples, stock, tmp_path):
    """TFX's penguin example constructs `MirroredStrategy()` in its run_fn: TF 2.16 segfaults
    making it beside a MultiWorkerMirroredStrategy (the control); under AccumulatingTrainer it
    is the executor's strategy."""
    assert _stock_two_lines_on_two_processes(tmp_path) == [-signal.SIGSEGV] * 2
    inputs, outputs, properties = fixtures.executor_arguments(
        tmp_path / "run", examples, num_steps=STEPS, accum_steps=ACCUM, effective_batch_size=EFFECTIVE,
        custom_config={"own_strategy": "mirrored"})
    results = local_cluster.run(local_cluster.container_command(inputs, outputs, properties), 2, tmp_path / "tmp")
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    seen, weights = fixtures.read_run(outputs["model_run"][0].uri)
    assert (seen["own_strategy"], seen["own_strategy_replicas"], seen["iterations"]) == (
        "CollectiveAllReduceStrategy", 2, STEPS)
    assert "run_fn constructed tf.distribute.MirroredStrategy" in results[1][2]
    print(f"[measured] 2 processes, the run_fn's own MirroredStrategy, vs the one-process large batch: "
          f"max |dw| = {max_abs_diff(weights, stock[0]):.1e}")
    assert max_abs_diff(weights, stock[0]) <= 1e-5
    assert _model_dir_entries(outputs) == ["Format-Serving"]


@pytest.mark.apart      # 55 s; two processes exporting from the chief run in make test above
def test_the_demo_module_trains_on_two_processes_and_the_chief_exports_it(tmp_path):
    from tfx_gradient_accumulator.pipelines.digits import model as digits_module
    examples = fixtures.write_digits_examples(str(tmp_path / "examples"))
    inputs, outputs, properties = fixtures.executor_arguments(
        tmp_path / "run", examples, num_steps=20, module=digits_module.__file__.replace(".pyc", ".py"),
        accum_steps=2, effective_batch_size=32)
    results = local_cluster.run(local_cluster.container_command(inputs, outputs, properties), 2, tmp_path / "tmp")
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    assert _model_dir_entries(outputs) == ["Format-Serving"]
    recorded = local_cluster.custom_properties(local_cluster.published(results[0][1])["model"][0])
    assert (recorded["workers"], recorded["replicas"], recorded["optimizer_updates"]) == (2, 2, 20)
    assert local_cluster.custom_properties(local_cluster.published(results[1][1])["model"][0]) == {}
    logs = glob.glob(os.path.join(outputs["model_run"][0].uri, "train", "events.out.tfevents.*"))
    assert len(logs) == 1                 # the module's TensorBoard callback: the chief's alone


# Apart (65 s, 2 processes): the cluster's error paths are the chief's (test_two_processes_...),
# and a killed run's resume on 1 process runs in make test.
@pytest.mark.apart
def test_a_worker_that_dies_fails_the_run_with_a_clear_message_and_no_model(examples, tmp_path):
    inputs, outputs, properties = fixtures.executor_arguments(
        tmp_path / "run", examples, num_steps=STEPS, accum_steps=ACCUM, effective_batch_size=EFFECTIVE)
    results = local_cluster.run(local_cluster.container_command(inputs, outputs, properties), 2, tmp_path / "tmp",
                           env={1: {"DIE_AFTER_STEPS": 10}}, timeout=300)
    (chief_code, _, chief_log), (worker_code, _, _) = results
    assert worker_code == -signal.SIGKILL and chief_code != 0
    assert "another process failed or became unreachable" in chief_log
    assert "No model was exported" in chief_log
    assert not os.path.exists(outputs["model"][0].uri) or _model_dir_entries(outputs) == []
    assert not glob.glob(os.path.join(outputs["model_run"][0].uri, "accumulation", "*"))


def _resumable(examples, tmp_path, **more):
    return fixtures.executor_arguments(tmp_path / "run", examples, num_steps=STEPS, accum_steps=ACCUM,
                                       effective_batch_size=EFFECTIVE, backup_dir=str(tmp_path / "backups"),
                                       backup_every=1, **more)


# On 2 processes apart (2 min; `make test-apart`): one process covers the backup's resume,
# and test_cluster's other 2-process runs the cluster's.
@pytest.mark.parametrize("workers", [1, pytest.param(2, marks=pytest.mark.apart)])
def test_a_killed_run_resumes_from_its_backup_with_the_weights_of_an_uninterrupted_one(
        workers, examples, stock, tmp_path):
    """Backups every update (4 micro-steps); the last replica is SIGKILLed after
    micro-step 10, 2 micro-batches into the third window; the job is restarted."""
    inputs, outputs, properties = _resumable(examples, tmp_path)
    command = local_cluster.container_command(inputs, outputs, properties)
    killed = local_cluster.run(command, workers, tmp_path / "tmp1", env={workers - 1: {"DIE_AFTER_STEPS": 10}},
                          timeout=300)
    assert killed[-1][0] == -signal.SIGKILL
    if workers == 2:
        assert killed[0][0] != 0 and "resumes from the backup" in killed[0][2] and "fit step 8" in killed[0][2]
    assert not os.path.exists(os.path.join(outputs["model"][0].uri, "Format-Serving"))

    results = local_cluster.run(command, workers, tmp_path / "tmp2")
    assert [code for code, _, _ in results] == [0] * workers, results[0][2][-3000:]
    seen, weights = fixtures.read_run(outputs["model_run"][0].uri)
    print(f"[measured] {workers} process(es), killed and resumed, vs the large batch: "
          f"max |dw| = {max_abs_diff(weights, stock[0]):.1e}")
    assert max_abs_diff(weights, stock[0]) <= 1e-5
    assert np.abs(_predictions(outputs) - stock[1]).max() <= 1e-5
    recorded = local_cluster.custom_properties(local_cluster.published(results[0][1])["model"][0])
    assert {k: recorded[k] for k in ("backup_resumes", "resumed_at_step", "resumed_at_update",
                                     "optimizer_updates", "workers")} == {
        "backup_resumes": 1, "resumed_at_step": 8, "resumed_at_update": 2, "optimizer_updates": STEPS,
        "workers": workers}
    assert recorded["backup_dir"].startswith(str(tmp_path / "backups"))
    assert not os.path.exists(recorded["backup_dir"])          # removed once the model is published
    assert _model_dir_entries(outputs) == ["Format-Serving"]


@pytest.mark.apart      # make test: the Keras 2 backup in the library (tests/keras2), the Keras 3 Trainer killed here
@pytest.mark.parametrize("workers", [1, 2])
def test_a_killed_keras_2_run_resumes_from_its_backup_exactly(workers, examples, tmp_path):
    """The tf_keras module (what a TFX module gets under TF_USE_LEGACY_KERAS=1), killed after
    micro-step 10 (the last replica), restarted: it resumes at the backup of step 8, 2 updates."""
    pytest.importorskip("tf_keras")
    module = os.path.join(fixtures.TESTDATA, "keras2_regression_module.py")
    stock_weights = fixtures.run_executor(tmp_path / "stock", examples, num_steps=STEPS, stock=True,
                                          module=module)[2]
    inputs, outputs, properties = _resumable(examples, tmp_path, module=module)
    command = local_cluster.container_command(inputs, outputs, properties)
    killed = local_cluster.run(command, workers, tmp_path / "tmp1", env={workers - 1: {"DIE_AFTER_STEPS": 10}},
                          timeout=300)
    assert killed[-1][0] == -signal.SIGKILL, killed[-1][2][-3000:]
    results = local_cluster.run(command, workers, tmp_path / "tmp2")
    assert [code for code, _, _ in results] == [0] * workers, results[0][2][-3000:]
    seen, weights = fixtures.read_run(outputs["model_run"][0].uri)
    assert (seen["keras"][:2], seen["optimizer_module"], seen["iterations"]) == ("2.", "tfx_gradient_accumulator.accumulator.keras2", STEPS)
    print(f"[measured] Keras 2, {workers} process(es), killed and resumed, vs the stock Trainer: "
          f"max |dw| = {max_abs_diff(weights, stock_weights):.1e}")
    assert max_abs_diff(weights, stock_weights) <= 1e-5
    recorded = local_cluster.custom_properties(local_cluster.published(results[0][1])["model"][0])
    assert {k: recorded[k] for k in ("backup_resumes", "resumed_at_step", "resumed_at_update")} == {
        "backup_resumes": 1, "resumed_at_step": 8, "resumed_at_update": 2}


def test_vertex_executor_runs_the_job_and_publishes_the_chiefs_record(vertex_job, stock):
    """`VertexExecutor.Do` through TFX's own Vertex runner, the CustomJob's pools run here."""
    outputs, job, _, _ = vertex_job
    spec = job["job_spec"]
    assert [p["replica_count"] for p in spec["worker_pool_specs"]] == [1, 1]
    assert spec["scheduling"] == {"restart_job_on_worker_restart": True}
    recorded = local_cluster.custom_properties(outputs["model"][0])
    assert (recorded["workers"], recorded["replicas"], recorded["effective_batch_size"]) == (2, 2, EFFECTIVE)
    assert max_abs_diff(fixtures.read_run(outputs["model_run"][0].uri)[1], stock[0]) <= 1e-5
    assert np.abs(_predictions(outputs) - stock[1]).max() <= 1e-5


@pytest.mark.apart      # 3 min; test_exactness covers the verdict on one process
def test_verify_exactness_on_two_processes_gives_the_one_process_verdict_once_and_trains_as_without_it(
        examples, tmp_path):
    """`verify_exactness=True` on a 2-process cluster, with a module that constructs its own
    `MirroredStrategy()` (as TFX's penguin example does; the probe once made it beside the
    executor's `MultiWorkerMirroredStrategy`: a segfault) and is seeded at import (so the
    training after the check depends on the random state the check found). One verdict, the one-process run's, recorded by the chief alone; the
    worker takes it; and the run trains bit for bit as the same 2 processes without the check."""
    import keras

    from tests.components.test_exactness import seeded_at_import_module

    module = seeded_at_import_module(tmp_path)
    one_process = fixtures.run_executor(tmp_path / "one", examples, num_steps=STEPS, accum_steps=ACCUM,
                                        effective_batch_size=EFFECTIVE, verify_exactness="record",
                                        module=module)[0]
    keras.backend.clear_session()
    expected = local_cluster.custom_properties(one_process["model"][0])
    runs = {}
    for name, check in (("checked", {"verify_exactness": "record"}), ("plain", {})):
        inputs, outputs, properties = fixtures.executor_arguments(
            tmp_path / name, examples, num_steps=STEPS, module=module, accum_steps=ACCUM,
            effective_batch_size=EFFECTIVE, custom_config={"own_strategy": "mirrored"}, **check)
        results = local_cluster.run(local_cluster.container_command(inputs, outputs, properties), 2, tmp_path / f"{name}-tmp")
        assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
        runs[name] = outputs, results

    outputs, ((_, chief_out, _), (_, worker_out, worker_log)) = runs["checked"]
    recorded = local_cluster.custom_properties(local_cluster.published(chief_out)["model"][0])
    print(f"[measured] verify_exactness, 2 processes: {recorded['exactness']}, max |dw| "
          f"{recorded['exactness_max_delta']:.2e}; one process: {expected['exactness']}, "
          f"{expected['exactness_max_delta']:.2e}")
    assert recorded["exactness"] == expected["exactness"] == "exact"
    assert abs(recorded["exactness_max_delta"] - expected["exactness_max_delta"]) <= 1e-6
    assert local_cluster.custom_properties(local_cluster.published(worker_out)["model"][0]) == {}   # the chief records
    assert "verify_exactness: the chief's verdict: exact" in worker_log
    assert "check_exact [1/3]" not in worker_log                                          # ... and alone checks
    with open(os.path.join(outputs["model_run"][0].uri, "accumulation", "record.json")) as f:
        assert '"exactness"' in f.read()
    checked, plain = (fixtures.read_run(runs[name][0]["model_run"][0].uri) for name in ("checked", "plain"))
    assert checked[0]["own_strategy"] == "CollectiveAllReduceStrategy" and checked[0]["iterations"] == STEPS
    print(f"[measured] 2 processes with the check vs without: max |dw| = {max_abs_diff(checked[1], plain[1]):.1e}")
    assert max_abs_diff(checked[1], plain[1]) == 0.0


@pytest.mark.apart      # make test: the worker takes the chief's verdict (above, 2 processes), "refuse" (test_exactness)
def test_verify_exactness_refuse_stops_every_process_of_the_cluster(examples, tmp_path):
    """The batch-normalization module differs: the chief checks, the worker takes its verdict,
    and both stop before training (none waits for the other in a collective); no model."""
    from tests.components.test_exactness import _batch_norm_module

    inputs, outputs, properties = fixtures.executor_arguments(
        tmp_path / "run", examples, num_steps=STEPS, accum_steps=ACCUM, effective_batch_size=EFFECTIVE,
        module=_batch_norm_module(tmp_path), verify_exactness="refuse")
    (chief_code, _, chief_log), (worker_code, _, worker_log) = local_cluster.run(
        local_cluster.container_command(inputs, outputs, properties), 2, tmp_path / "tmp", timeout=300)
    assert chief_code != 0 and worker_code != 0
    assert "nothing was trained" in chief_log and "batch-norm statistics" in chief_log
    assert "nothing was trained" in worker_log and "as the chief's check found" in worker_log
    assert not os.path.exists(outputs["model"][0].uri) or _model_dir_entries(outputs) == []
    assert not os.path.exists(os.path.join(outputs["model_run"][0].uri, "seen.json"))
