"""`micro_batch_size="auto"` under MirroredStrategy (2 logical CPUs) and
MultiWorkerMirroredStrategy (2 processes on 127.0.0.1), through real out-of-memory errors
(`memory_cliff.TokenCliff`, no mocks) crossed mid-run by a replica (or a worker) alone:
each step's micro-batches run with no collective in flight, every worker agrees on the next
b, and the weights land within 1e-5 of Keras' own `fit(batch_size=E)` on one device.

The text model and data are test_fit_auto_micro_batch's (E = 12, each batch's longest
sequence last: the second replica's share holds it, so that replica alone runs out). A
replica's micro-step fits `BUDGET` = 20 tokens: batch 0 (rows of at most 3 tokens) trains
whole (6 rows x 3 a replica); batch 1 (a 9-token row) runs out at 12 and trains at 4 (2 rows
a replica, 18 tokens, predicted from the 18 that fit); batch 2 (a 12-token row) runs out at
4 in the replica's third micro-batch, after two have updated the metrics, and trains at 2.
"""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import next_micro_batch
from tests.accumulator import memory_cliff
from tests.accumulator import reference as ref
from tests.accumulator.multiworker import run_cluster
from tests.accumulator.test_fit_auto_micro_batch import VOCABULARY, _adam, _dataset, _rows
from tests.accumulator.test_fit_effective_batch_distributed import _assert_logged_as_one_device, _mirrored

TOLERANCE = 1e-5
BUDGET = 20
EXPECTED_CHANGES = [
    {"update": 1, "micro_batch": 4, "previous_micro_batch": 12, "effective_batch": 12, "out_of_memory_errors": 1,
     "epoch": 0},
    {"update": 2, "micro_batch": 2, "previous_micro_batch": 4, "effective_batch": 12, "out_of_memory_errors": 1,
     "epoch": 0},
]


def _large():
    """Keras' own fit at E on one device, with the inner optimizer: (model, history)."""
    large = memory_cliff.embedding_model(None, VOCABULARY)
    large.compile(_adam(), "mse", metrics=["mae"])
    return large, large.fit(_dataset(_rows()), epochs=2, verbose=0, shuffle=False).history


def _records(optimizer):
    return [{k: v for k, v in c.as_record().items() if k != "seconds_lost"} for c in optimizer.micro_batch_changes]


def _metrics_kept_per_replica():
    """Whether this Keras keeps metric variables per replica (`on_read`: 3.15 does; 3.8
    mirrors them, each update an all-reduce, and "auto" refuses them under a strategy)."""
    with _mirrored().scope():
        metric = keras.metrics.Mean()
    return metric.variables[0].value.synchronization == tf.VariableSynchronization.ON_READ


def test_mirrored_auto_crosses_a_cliff_of_one_replica_mid_run_exactly():
    large, large_history = _large()
    metrics = ["mae"]
    if not _metrics_kept_per_replica():
        with _mirrored().scope():
            refused = memory_cliff.embedding_model(BUDGET, VOCABULARY)
            refused.compile(GradientAccumulator(_adam(), micro_batch_size="auto"), "mse", metrics=metrics)
        with pytest.raises(NotImplementedError, match="keeps the metric variable .* mirrored"):
            refused.fit(_dataset(_rows()), epochs=1, verbose=0)
        assert int(refused.optimizer.iterations.numpy()) == 0
        metrics, large_history["mae"] = [], None
    with _mirrored().scope():
        auto = memory_cliff.embedding_model(BUDGET, VOCABULARY)
        auto.compile(GradientAccumulator(_adam(), micro_batch_size="auto"), "mse", metrics=metrics)
    history = auto.fit(_dataset(_rows()), epochs=2, verbose=0, shuffle=False).history
    delta = ref.max_abs_diff(large.get_weights(), auto.get_weights())
    assert delta <= TOLERANCE, delta
    assert ref.max_abs_diff(large.get_weights(), memory_cliff.embedding_model(None, VOCABULARY).get_weights()) \
        > 100 * TOLERANCE
    assert _records(auto.optimizer) == EXPECTED_CHANGES
    assert auto.optimizer.micro_batch_size == 2 and int(auto.optimizer.iterations.numpy()) == 8
    # The replica's two micro-batches before its error updated the loss tracker and mae: put back.
    _assert_logged_as_one_device(history, large_history)
    if metrics:
        np.testing.assert_allclose(history["mae"], large_history["mae"], rtol=1e-5)


def test_mirrored_moving_statistics_and_random_draws_are_put_back_on_each_replica():
    """test_fit_auto_micro_batch's BatchNormalization and Dropout model under 2 replicas: each
    replica keeps its own moving statistics and seed state; a failed step's are put back on
    each, so "auto" (12 runs out whole, 6 in the replica's second micro-batch, 4 fits) lands
    on the int-b runs at 6 then 4 under the same strategy (SGD: nothing carried between
    their fits), every replica's moving statistics included."""
    from tests.accumulator.test_fit_auto_micro_batch import _normalised_model

    data = _dataset(_rows([6, 9, 6], short=6))
    with _mirrored().scope():
        auto = _normalised_model(BUDGET)
        auto.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size="auto"), "mse")
    auto.fit(data, epochs=1, verbose=0, shuffle=False)
    assert [(c.previous_micro_batch, c.micro_batch) for c in auto.optimizer.micro_batch_changes] == [(12, 6), (6, 4)]
    with _mirrored().scope():
        reference = _normalised_model(BUDGET)
    for size, part in ((6, data.take(1)), (4, data.skip(1))):
        with _mirrored().scope():
            reference.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size=size), "mse")
        reference.fit(part, epochs=1, verbose=0, shuffle=False)
    assert ref.max_abs_diff(reference.get_weights(), auto.get_weights()) <= TOLERANCE
    for ours, theirs in zip(auto.non_trainable_variables, reference.non_trainable_variables):
        for mine, other in zip(ours.value.values, theirs.value.values):
            np.testing.assert_allclose(np.array(mine), np.array(other), atol=TOLERANCE, err_msg=ours.path)


def test_two_workers_agree_on_b_where_only_one_has_the_cliff(tmp_path):
    """Worker 1 alone has the cliff (and the long rows): worker 0's steps fit, yet both
    train every batch again at the b worker 1 needs, one collective agreeing on it."""
    codes, output, _ = run_cluster(tmp_path / "out", "--budget", BUDGET, "--cliff-on", 1,
                                        module="tests.accumulator.fit_auto_micro_batch_worker", timeout=240)
    assert codes == [0, 0], output[-3000:]
    large, large_history = _large()
    workers = []
    for index in (0, 1):
        saved = np.load(f"{tmp_path / 'out'}.{index}.npz")
        weights = [saved[f"w{i}"] for i in range(len([k for k in saved.files if k.startswith("w")]))]
        assert ref.max_abs_diff(weights, large.get_weights()) <= TOLERANCE, index
        assert int(saved["iterations"]) == 8
        workers.append(json.loads(str(saved["auto"])))
    assert workers[0]["changes"] == workers[1]["changes"] == EXPECTED_CHANGES
    assert workers[0]["micro_batch_size"] == workers[1]["micro_batch_size"] == 2
    for worker in workers:
        # The micro-batches (where memory runs out) hold no collective; the update holds the all-reduce.
        assert worker["collectives"]["first"] == [] and worker["collectives"]["second"], worker["collectives"]
    _assert_logged_as_one_device(workers[0]["history"], large_history)


@pytest.mark.parametrize("failed, effective, per_sample, fit, replicas, expected", [
    (12, 12, 9, 36, 2, 4),         # a replica's share of 6: 2 x 9 = 18 tokens fit a replica
    (4, 12, 12, 36, 2, 2),
    (12, 12, 1, None, 2, 6),       # nothing fit yet: each replica's N doubles
    (64, 64, 1, None, 4, 32),
    (16, 64, 1, 24, 4, 12),        # 4 of a replica's 16 failed, 6 fit: 3 = ceil(16 / 6)
    (6, 12, 100, 36, 2, 2),        # nothing predicted to fit: one sample a replica
])
def test_the_next_micro_batch_is_a_multiple_of_the_replicas(failed, effective, per_sample, fit, replicas, expected):
    chosen = next_micro_batch(failed, effective, per_sample, fit, replicas=replicas)
    assert chosen == expected
    assert chosen % replicas == 0


def test_other_strategies_are_refused_before_training():
    x, y = ref.regression_data(8)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = ref.mlp()
        model.compile(GradientAccumulator(keras.optimizers.Adam(), micro_batch_size="auto"), "mse")
        before = [w.copy() for w in model.get_weights()]
        with pytest.raises(NotImplementedError, match="not under OneDeviceStrategy.*int micro_batch_size"):
            model.fit(x, y, batch_size=8, verbose=0)
    assert ref.max_abs_diff(before, model.get_weights()) == 0.0
