"""MultiWorkerMirroredStrategy: 2 worker processes on 127.0.0.1, Keras `fit`."""

import json
import signal
import time

import keras
import numpy as np
import pytest

from tfx_gradient_accumulator.accumulator import hooks
from tests.accumulator import reference as ref
from tests.accumulator.multiworker import load_result, run_cluster, start_cluster


MICRO = 16     # global micro-batch: 8 per worker
ACCUM = 4


def _single_device_large_batch(samples, epochs=1):
    x, y = ref.regression_data(samples)
    optimizer = keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(1e-2, 4, 0.5), weight_decay=0.05, global_clipnorm=0.05
    )
    model = ref.fit_large_batch(ref.mlp(), optimizer, x, y, MICRO * ACCUM, epochs=epochs)
    return model.get_weights()


@pytest.fixture(scope="module")
def mlp_then_embedding(tmp_path_factory):
    """One cluster for the two tests below (2 processes' start saved): the MLP on 32
    micro-batches, then the embedding model on 16, both in windows of 4."""
    out = tmp_path_factory.mktemp("multiworker") / "out"
    codes, output, _ = run_cluster(out, "--accum", ACCUM, "--steps-per-epoch", 32, "--then-embedding", 16)
    return codes, output, out


def test_two_worker_fit_matches_single_device_large_batch(mlp_then_embedding):
    """The hooks `import accumulator` installs are all it takes."""
    codes, output, out = mlp_then_embedding
    assert codes == [0, 0], output[-3000:]
    weights, iterations = load_result(out, 0)
    assert iterations == 8
    assert ref.max_abs_diff(weights, _single_device_large_batch(MICRO * 32)) <= 1e-5


MULTIWORKER_FIXES = ("symbolic_build", "scalar_logs")


# Apart (45 s, 2 processes each): the controls that each fix is needed; plain Keras on
# 2 workers with every fix on runs in make test.
@pytest.mark.apart
@pytest.mark.parametrize("missing", MULTIWORKER_FIXES)
def test_each_keras_fix_is_needed_for_multiworker_fit(missing, tmp_path):
    """Plain Keras optimizer, one fix left out: `fit` fails (keras-team/keras#20585)."""
    assert set(MULTIWORKER_FIXES) <= set(hooks.HOOKS)
    others = ",".join(f for f in MULTIWORKER_FIXES if f != missing) or "none"
    codes, output, _ = run_cluster(tmp_path / "out", "--accum", 1, "--hooks", others, "--steps-per-epoch", 4)
    assert codes != [0, 0]
    expected = {"symbolic_build": "PerReplica", "scalar_logs": "Invalid reduction dimension 0"}[missing]
    assert expected in output


def test_plain_keras_multiworker_fit_runs_with_the_fixes(tmp_path):
    codes, output, result = run_cluster(
        tmp_path / "out", "--accum", 1, "--hooks", ",".join(MULTIWORKER_FIXES), "--steps-per-epoch", 4
    )
    assert codes == [0, 0], output[-3000:]
    assert result[1] == 4


def test_two_worker_embedding_fit_matches_keras_large_batch(mlp_then_embedding):
    """Sparse gradients: each worker's window rows, gathered at the close as Keras
    gathers the large batch's, make Adam's update of the one-device large batch."""
    codes, output, out = mlp_then_embedding
    assert codes == [0, 0], output[-3000:]
    weights, iterations = load_result(f"{out}.embedding", 0)
    assert iterations == 4
    x, y = ref.token_data(MICRO * 16)
    expected = ref.fit_large_batch(ref.embedding_model(), keras.optimizers.Adam(1e-2), x, y, MICRO * ACCUM)
    assert ref.max_abs_diff(weights, expected.get_weights()) <= 1e-5


# Apart (21 s, 2 processes): position lookups on 2 mirrored replicas (test_lookups) and the
# embedding on 2 workers run in make test.
@pytest.mark.apart
def test_two_worker_position_lookup_matches_keras_large_batch_on_two_replicas(tmp_path):
    """A lookup made once per batch: each worker keeps its micro-batches' rows, the
    close sums them into one set per worker's share of the batch, as Keras' large
    batch has them on 2 replicas (here 2 mirrored replicas in this process)."""
    import tensorflow as tf

    from tests.accumulator.test_lookups import text_data, text_model

    codes, output, result = run_cluster(tmp_path / "out", "--accum", ACCUM, "--steps-per-epoch", 8,
                                        "--positions")
    assert codes == [0, 0], output[-3000:]
    weights, iterations = result
    assert iterations == 2
    x, y = text_data(MICRO * 8)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model = text_model()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, y, batch_size=MICRO * ACCUM, shuffle=False, verbose=0)
    assert ref.max_abs_diff(weights, model.get_weights()) <= 1e-5


@pytest.mark.parametrize("partial_window, updates, model", [   # the MLP's apart (50 s each): the embedding case
    pytest.param("carry", 7, "mlp", marks=pytest.mark.apart),     # kills and resumes a worker in make test
    pytest.param("apply", 9, "mlp", marks=pytest.mark.apart), ("carry", 7, "embedding")])
def test_killed_worker_resumes_from_backup_without_losing_or_repeating_micro_batches(
        partial_window, updates, model, tmp_path):
    # 9 micro-batches an epoch, windows of 4. "carry": the backup at the end of
    # epoch 2 holds a window 2 micro-batches in, and 27 micro-batches make 6
    # full windows and 3 carried past fit, then applied. "apply": 4, 4, 1 every
    # epoch. The embedding model's backup holds both workers' window rows.
    args = ["--accum", ACCUM, "--steps-per-epoch", 9, "--epochs", 3, "--backup", tmp_path / "backup",
            "--partial-window", partial_window] + (["--embedding"] if model == "embedding" else [])
    procs = start_cluster(tmp_path / "out", *args, "--die-at", 22)   # worker dies in epoch 3
    deadline = time.time() + 300
    while all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.5)
    died = [p.poll() for p in procs]
    assert -signal.SIGKILL in died, died
    for p in procs:       # the survivor waits on a collective forever: restart the cluster
        p.kill()
        p.communicate()
    assert load_result(tmp_path / "out", 0) is None

    codes, output, result = run_cluster(tmp_path / "out", *args)
    assert codes == [0, 0], output[-3000:]
    weights, iterations = result
    assert iterations == updates
    expected = _single_device_resumable(partial_window, model)
    assert ref.max_abs_diff(weights, expected) <= 1e-5


def _single_device_resumable(partial_window, model="mlp"):
    """3 epochs of 9 micro-batches, windows of 4, on one device, uninterrupted."""
    from tfx_gradient_accumulator.accumulator import GradientAccumulator
    if model == "embedding":
        (x, y), inner, model = ref.token_data(MICRO * 9), keras.optimizers.Adam(1e-2), ref.embedding_model()
    else:
        x, y = ref.regression_data(MICRO * 9)
        inner = keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(1e-2, 4, 0.5),
                                       weight_decay=0.05, global_clipnorm=0.05)
        model = ref.mlp()
    optimizer = GradientAccumulator(inner, ACCUM, partial_window=partial_window)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    optimizer.close_partial_window("apply")
    return model.get_weights()


# Apart (62 s, 2 processes): the decisions' one collective runs on 2 mirrored replicas in
# make test (test_auto_batch), the 2-worker strategy by the other tests here.
@pytest.mark.apart
def test_every_worker_takes_the_same_auto_accumulation_decisions_at_the_same_windows(tmp_path):
    """AutoAccumulation reads B_simple from the window's all-reduced sums: both workers
    grow the window at the same updates, and the run equals one device replaying the
    decisions as a schedule by update (with the same learning-rate rule)."""
    import json

    import numpy as np

    from tfx_gradient_accumulator.accumulator import AccumulationSchedule, GradientAccumulator

    # Micro-batches of 2: windows of 4 samples, well below this task's noise scale (~12).
    codes, output, result = run_cluster(tmp_path / "out", "--accum", 2, "--micro", 2, "--steps-per-epoch", 256,
                                        "--epochs", 2, "--auto-overhead", 1.0)
    assert codes == [0, 0], output[-3000:]
    schedules = [json.loads(str(np.load(f"{tmp_path / 'out'}.{i}.npz")["schedule"])) for i in (0, 1)]
    assert schedules[0] == schedules[1]
    taken = {int(k): v for k, v in schedules[0].items()}
    assert taken[0] == 2 and len(taken) >= 2, (taken, [line for line in output.splitlines() if "auto readings" in line])
    weights, iterations = result

    x, y = ref.regression_data(MICRO * 32)
    optimizer = keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(1e-2, 4, 0.5), weight_decay=0.05, global_clipnorm=0.05)
    model = ref.mlp()
    model.compile(optimizer=GradientAccumulator(optimizer, 2, schedulable=True), loss="mse")
    model.fit(x, y, batch_size=2, epochs=2, shuffle=False, verbose=0,
              callbacks=[AccumulationSchedule(taken, by="update", lr_scaling="sqrt")])
    assert int(model.optimizer.iterations.numpy()) == iterations
    assert ref.max_abs_diff(weights, model.get_weights()) <= 1e-5


# Apart (51 s, 2 processes): the probe on 2 mirrored replicas runs in make test
# (test_micro_batch), the 2-worker strategy by the other tests here.
@pytest.mark.apart
def test_on_two_workers_every_worker_takes_the_smallest_micro_batch_any_of_them_fits(tmp_path):
    """find_micro_batch under MultiWorkerMirroredStrategy: each worker probes a copy of the
    model on its own device, outside the strategy (a probe that runs out of memory must not
    leave the other in an all-reduce), and both take the smallest. Only worker 1 has a
    memory cliff (12 samples per device: 11 fit); E = 64 on 2 replicas: 11 x 2 = 22 fit
    the cluster, 19 with the headroom, so N = 4 of 16 (8 per worker). Worker 0 alone would
    have taken 32 (16 per device: over worker 1's cliff). Then both train at that split,
    like Keras' large batch of 64 on one device."""
    from tests.accumulator import memory_cliff

    out = tmp_path / "out"
    codes, output, _ = run_cluster(out, "--find-micro-batch", 64, "--cliffs", "1000000,12",
                                   "--micro", 16, "--steps-per-epoch", 16)
    assert codes == [0, 0], output[-3000:]
    found = [np.load(f"{out}.{index}.npz") for index in (0, 1)]
    assert [(int(f["micro_batch"]), int(f["accum_steps"]), int(f["largest_fitting"])) for f in found] == [(16, 4, 22)] * 2
    assert json.loads(str(found[0]["probes"]))[-1] == [32, True]          # worker 0's own device fits 32
    assert [32, False] not in json.loads(str(found[0]["probes"]))
    assert [16, False] in json.loads(str(found[1]["probes"]))             # worker 1's does not fit 16
    x, y = ref.regression_data(16 * 16)
    expected = ref.fit_large_batch(memory_cliff.mlp(), keras.optimizers.Adam(1e-2), x, y, 64).get_weights()
    weights, iterations = load_result(out, 0)
    assert iterations == 4
    print("[measured] 2 workers at the micro-batch found, max |dw| vs Keras' large batch:",
          ref.max_abs_diff(weights, expected))
    assert ref.max_abs_diff(weights, expected) <= 1e-5
