"""Keras 2: `GradientAccumulator(inner, micro_batch_size="auto")`, the largest micro-batch whose
step fits, found by the run (`accumulator.keras2.fit_auto_micro_batch`), through real
out-of-memory errors (no mocks, `memory_cliff_keras2`), within 1e-5 of Keras 2's own
`fit(batch_size=E)` with the inner optimizer, logged loss and metrics included.

Each out-of-memory error costs about 10 s where oneDNN's allocator retries (on by default on
AVX-512 CPUs), at once with TF_ENABLE_ONEDNN_OPTS=0: the tests take two each at most.
"""

import logging

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import MicroBatchChange
from tfx_gradient_accumulator.accumulator.core import flavours
from tests.keras2 import memory_cliff_keras2 as cliffs

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")

TOLERANCE = 1e-5
VOCABULARY = 50
E = 12
BUDGET = 40         # tokens per micro-step: 12 x 3 fits, 12 x 9 and 4 x 12 do not; 4 x 9, 3 x 12 fit
LONGEST = [3, 9, 12, 3]       # per batch (the last one of 6 samples): the cliff is crossed in batches 1 and 2
SHORTER_LAST = 6


def _max_delta(a, b):
    return max(float(np.max(np.abs(np.asarray(u) - np.asarray(v)))) for u, v in zip(a, b))


def _rows(longest_per_batch=LONGEST, seed=1, short=3):
    """(token ids, target): E per batch (the last batch `SHORTER_LAST`), each batch's longest
    sequence last (so a step at b < E trains its first micro-batches, then runs out)."""
    rng = np.random.default_rng(seed)
    rows = []
    for k, longest in enumerate(longest_per_batch):
        size = SHORTER_LAST if k == len(longest_per_batch) - 1 else E
        for j in range(size):
            length = longest if j == size - 1 else int(rng.integers(1, short + 1))
            ids = rng.integers(1, VOCABULARY, size=length).astype("int32")
            rows.append((ids, np.array([np.tanh(4 * ids.mean() / VOCABULARY - 2)], "float32")))
    return rows


def _dataset(rows):
    """Batches of E, each padded with id 0 to its own longest sequence (of known count)."""
    data = tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=(
        tf.TensorSpec((None,), tf.int32), tf.TensorSpec((1,), tf.float32)))
    return data.padded_batch(E).apply(tf.data.experimental.assert_cardinality(-(-len(rows) // E)))


def _text_pair(static, jit_compile, longest=LONGEST):
    """(Keras 2's own fit at E with Adam, "auto" on the model with the cliff), and their histories."""
    data = _dataset(_rows(longest))
    runs = []
    for budget in (None, BUDGET):
        model = cliffs.embedding_model(budget, VOCABULARY, static=static)
        adam = k2.optimizers.Adam(1e-3)
        optimizer = adam if budget is None else GradientAccumulator(adam, micro_batch_size="auto")
        model.compile(optimizer, "mse", metrics=["mae"], jit_compile=jit_compile)
        if budget is not None:
            assert model.optimizer.micro_batch_size is None      # before the first batch
        runs.append((model, model.fit(data, epochs=2, verbose=0, shuffle=False).history))
    return runs


def _assert_exact(large, auto, large_history, auto_history, start):
    delta = _max_delta(large.get_weights(), auto.get_weights())
    print(f"max |dw| against Keras 2's fit(batch_size={E}): {delta:.3g}")
    assert delta <= TOLERANCE
    # Not the same by accident: training moved the weights far beyond the tolerance.
    assert _max_delta(large.get_weights(), start.get_weights()) > 100 * TOLERANCE
    assert int(auto.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy())
    for name in large_history:
        np.testing.assert_allclose(auto_history[name], large_history[name], rtol=1e-5, atol=1e-6, err_msg=name)


EXPECTED_CHANGES = [
    # batch 1 (9 tokens a row) runs out at 12; 12 x 3 tokens fit, so 4 (36 tokens) is taken at once
    {"update": 1, "micro_batch": 4, "previous_micro_batch": 12, "effective_batch": E, "out_of_memory_errors": 1,
     "epoch": 0},
    # batch 2 (12 a row) runs out at 4 in its third micro-batch; 3 (36 tokens) fits
    {"update": 2, "micro_batch": 3, "previous_micro_batch": 4, "effective_batch": E, "out_of_memory_errors": 1,
     "epoch": 0},
]


def _assert_changes(optimizer):
    assert optimizer.micro_batch_size == 3
    assert all(isinstance(c, MicroBatchChange) for c in optimizer.micro_batch_changes)
    records = [change.as_record() for change in optimizer.micro_batch_changes]
    assert [{k: v for k, v in r.items() if k != "seconds_lost"} for r in records] == EXPECTED_CHANGES
    assert all(r["seconds_lost"] >= 0.0 for r in records)


def test_an_embedding_model_whose_sequences_grow_crosses_the_cliff_mid_run_exactly(caplog):
    """Sequences padded per batch that grow: at b = 4 the step trains two micro-batches (the
    metrics and Keras 2's `loss` metric updated) before the third runs out; they are put back,
    so the logged loss and metrics are the large batch's too."""
    with caplog.at_level(logging.WARNING, logger="tfx_gradient_accumulator"):
        (large, large_history), (auto, auto_history) = _text_pair(static=False, jit_compile=False)
    _assert_exact(large, auto, large_history, auto_history, cliffs.embedding_model(None, VOCABULARY))
    _assert_changes(auto.optimizer)
    logged = [r.getMessage() for r in caplog.records if "micro_batch_size='auto'" in r.getMessage()]
    assert len(logged) == 2 and "micro-batch 12 of 12" in logged[0] and "micro-batch 4 (3 per update)" in logged[0]


def test_under_xla_the_same_cliff_is_taken_the_same_way_and_exactly():
    """`jit_compile=True`: each shape trains first in the graph step, in its XLA program from its
    next batch on (an XLA program's memory is refused at launch). One crossing (batch 1 at 12),
    to keep to one out-of-memory error; the second epoch trains each shape in XLA."""
    (large, large_history), (auto, auto_history) = _text_pair(static=True, jit_compile=True, longest=[3, 9, 3])
    assert auto.jit_compile is True
    _assert_exact(large, auto, large_history, auto_history, cliffs.embedding_model(None, VOCABULARY, static=True))
    records = [{k: v for k, v in c.as_record().items() if k != "seconds_lost"}
               for c in auto.optimizer.micro_batch_changes]
    assert records == EXPECTED_CHANGES[:1] and auto.optimizer.micro_batch_size == 4


def _sized_rows(samples=90, larger_from=60, seed=0):
    """Rows whose first feature, their "size", is 1 and from row `larger_from` on 3."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 6)).astype("float32")
    x[:, 0] = np.where(np.arange(samples) < larger_from, 1.0, 3.0)
    return x, np.tanh(x[:, 1:].sum(axis=1, keepdims=True)).astype("float32")


def test_an_mlp_whose_rows_grow_crosses_the_cliff_mid_run_exactly():
    """Batches of 20 (the last 10): 20 rows of size 1 fit (budget 31), update 3's rows of size 3
    run out at 20 and train at 10 (30) at once, in both epochs, as Keras 2's large batch with
    Adam, `clipnorm` and the logged loss and metrics."""
    x, y = _sized_rows()
    runs = []
    for budget in (None, 31):
        model = cliffs.mlp(budget)
        adam = k2.optimizers.Adam(1e-2, clipnorm=0.5)
        model.compile(adam if budget is None else GradientAccumulator(adam, micro_batch_size="auto"), "mse",
                      metrics=["mae"])
        runs.append((model, model.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0).history))
    (large, large_history), (auto, auto_history) = runs
    _assert_exact(large, auto, large_history, auto_history, cliffs.mlp())
    assert [c.as_record()["update"] for c in auto.optimizer.micro_batch_changes] == [3]
    assert (auto.optimizer.micro_batch_changes[0].previous_micro_batch, auto.optimizer.micro_batch_size) == (20, 10)
    # Keras 2's step count, once a batch whatever its retries: 5 a epoch.
    assert int(auto._train_counter.numpy()) == int(large._train_counter.numpy()) == 10


def test_a_failed_steps_moving_statistics_are_put_back():
    """A Keras 2 `BatchNormalization` before the cliff. The first batch runs out whole (12 x 6
    tokens; nothing has fit: b halves to 6), the second in its second micro-batch at 6 (its first
    moved the moving statistics), then 4 fits. Keras 2's large batch has other statistics, so the
    reference is the same model trained at 6 for batch 0 and at 4 from then on (SGD: no state to
    carry between its two fits): "auto" lands on it, moving statistics and all."""
    data = _dataset(_rows([6, 9, 6], short=6))
    auto = cliffs.embedding_model(BUDGET, VOCABULARY, normalised=True)
    auto.compile(GradientAccumulator(k2.optimizers.SGD(0.1), micro_batch_size="auto"), "mse")
    auto.fit(data, epochs=1, verbose=0, shuffle=False)
    assert [(c.previous_micro_batch, c.micro_batch) for c in auto.optimizer.micro_batch_changes] == [(12, 6), (6, 4)]
    reference = cliffs.embedding_model(BUDGET, VOCABULARY, normalised=True)
    for size, part in ((6, data.take(1)), (4, data.skip(1))):
        reference.compile(GradientAccumulator(k2.optimizers.SGD(0.1), micro_batch_size=size), "mse")
        reference.fit(part, epochs=1, verbose=0, shuffle=False)
    assert _max_delta(reference.get_weights(), auto.get_weights()) <= 1e-6
    start = cliffs.embedding_model(BUDGET, VOCABULARY, normalised=True)
    moving = [np.asarray(v) for v in auto.non_trainable_variables if "moving_mean" in v.name]
    start_moving = [np.asarray(v) for v in start.non_trainable_variables if "moving_mean" in v.name]
    assert _max_delta(moving, start_moving) > 1e-3       # the statistics moved: the check above has teeth


if k2 is not None:
    class UpdateCliffSGD(k2.optimizers.SGD):
        """SGD whose update of its first variable (from its second update on) needs 4 TiB: an error
        inside the inner update."""

        def update_step(self, gradient, variable):
            self.__dict__.setdefault("cliff_variable", variable.name)       # the first one traced
            cliff = tf.logical_and(self.iterations >= 1, tf.constant(variable.name == self.cliff_variable))
            elements = tf.where(cliff, tf.constant(2 ** 40, tf.int64), tf.constant(1, tf.int64))
            total = tf.reduce_sum(gradient)
            zero = tf.reduce_max(tf.fill(tf.reshape(elements, [1]), total)) - total
            super().update_step(gradient + zero, variable)


def test_an_error_inside_the_inner_update_stops_with_a_clear_error():
    x, y = _sized_rows(40)
    model = cliffs.mlp()
    model.compile(GradientAccumulator(UpdateCliffSGD(0.1), micro_batch_size="auto"), "mse")
    with pytest.raises(RuntimeError, match="inside the inner optimizer's update, which stopped half-way"):
        model.fit(x, y, batch_size=20, epochs=1, verbose=0, shuffle=False)
    assert model.optimizer.micro_batch_size == 20 and model.optimizer.micro_batch_changes == []


def test_steps_per_execution_above_one_is_refused_at_fit():
    x, y = _sized_rows(20)
    model = cliffs.mlp()
    model.compile(GradientAccumulator(k2.optimizers.SGD(0.1), micro_batch_size="auto"), "mse", steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1 \\(received 2\\)"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_several_replicas_are_refused_at_fit():
    x, y = _sized_rows(20)
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = cliffs.mlp()
        model.compile(GradientAccumulator(k2.optimizers.SGD(0.1), micro_batch_size="auto"), "mse")
    with pytest.raises(NotImplementedError, match="one device for now .*MirroredStrategy with 2 replicas"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0


def test_loss_scaling_is_refused_at_fit():
    x, y = _sized_rows(20)
    model = cliffs.mlp()
    inner = k2.mixed_precision.LossScaleOptimizer(k2.optimizers.SGD(0.1))
    model.compile(GradientAccumulator(inner, micro_batch_size="auto"), "mse")
    with pytest.raises(NotImplementedError, match="in float32 for now; under loss scaling"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
