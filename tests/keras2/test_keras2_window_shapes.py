"""Keras 2: the window's buffers state the shape they hold; a checkpoint written before that restores;
a custom loop's open window is reported when saved (issue 47, items 2 and 3)."""

import pathlib

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import flavours, seam

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")

DATA = pathlib.Path(__file__).parent / "data"
LOGGER = "tfx_gradient_accumulator.accumulator.window.window"


def _embedding_model():
    """As tests/accumulator/data/make_window_checkpoint_v1.py builds it."""
    k2.utils.set_random_seed(0)
    inp, tok = k2.Input((5,)), k2.Input((2,), dtype="int32")
    pooled = k2.layers.GlobalAveragePooling1D()(k2.layers.Embedding(20, 3)(tok))
    hidden = k2.layers.Dense(4)(k2.layers.Concatenate()([inp, pooled]))
    return k2.Model([inp, tok], k2.layers.Dense(1)(hidden))


def _data(n=24):
    x = np.random.default_rng(0).normal(size=(n, 5)).astype("float32")
    return [x, np.random.default_rng(1).integers(0, 20, size=(n, 2))], x.sum(1, keepdims=True)


def _assert_true_shapes(optimizer):
    for v in optimizer.variables:
        held = tuple(int(d) for d in tf.shape(v))
        assert tuple(v.shape) == held, (v.name, tuple(v.shape), held)


def test_after_fit_every_optimizer_variable_states_what_it_holds():
    x, y = _data(64)
    model = _embedding_model()
    optimizer = GradientAccumulator(k2.optimizers.Adam(1e-3), accum_steps=4)
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=8, verbose=0)
    _assert_true_shapes(optimizer)
    by_name = {v.name.split(":")[0]: v for v in optimizer.variables}
    assert tuple(by_name["accumulator_0"].shape) == (1, 3)          # the table's stand-in
    assert tuple(by_name["accumulator_1"].shape) == (8, 4)          # filled
    assert tuple(by_name["rows_0_values"].shape) == (4 * 8 * 2, 3)  # grown inside the step
    assert seam.declared_shape(by_name["rows_0_values"]).as_list() == [None, 3]


def test_a_checkpoint_written_before_buffers_stated_their_shape_restores():
    # Written by tests/accumulator/data/make_window_checkpoint_v1.py (keras2) with f49b76b's code.
    x, y = _data()
    model = _embedding_model()
    optimizer = GradientAccumulator(k2.optimizers.Adam(1e-2), accum_steps=4, partial_window="carry")
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=optimizer, model=model).read(
        str(DATA / "window_checkpoint_v1_keras2" / "ckpt")).assert_consumed()
    expected = np.load(DATA / "window_checkpoint_v1_keras2" / "expected.npz")
    assert len(expected.files) == len(optimizer.variables)
    for v, i in zip(optimizer.variables, range(len(expected.files))):
        np.testing.assert_array_equal(v.numpy(), expected[f"arr_{i}"])
    _assert_true_shapes(optimizer)
    assert optimizer.held_micro_batches == 2
    model.fit(x, y, batch_size=4, verbose=0)          # 2 held + 6: two more windows
    assert optimizer.held_micro_batches == 0 and int(optimizer.iterations) == 3
    _assert_true_shapes(optimizer)


def test_a_custom_loops_open_window_is_reported_once_at_save(caplog, tmp_path):
    x, y = _data(48)
    model = _embedding_model()
    optimizer = GradientAccumulator(k2.optimizers.SGD(0.1), accum_steps=4)
    loss_fn = k2.losses.MeanSquaredError()

    @tf.function
    def step(xb, ids, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model([xb, ids], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables),
                                  micro_batch_weight=tf.cast(tf.shape(xb)[0], tf.float32))

    for start in range(0, 48, 8):                      # 6 micro-batches: 2 held
        step(x[0][start:start + 8], x[1][start:start + 8], y[start:start + 8])
    _assert_true_shapes(optimizer)
    model.compile(optimizer, "mse")
    with caplog.at_level("WARNING", logger=LOGGER):
        model.save(str(tmp_path / "m.keras"))
        optimizer.get_weights()
    assert caplog.text.count("while its window holds 2 micro-batch(es)") == 1
