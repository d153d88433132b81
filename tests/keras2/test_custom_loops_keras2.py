"""Keras 2's custom loops: `micro_batches` is the large batch, and an open window is told of
(issue 58, item 2; Keras 3's, in programs of their own: tests/accumulator/test_custom_loops.py)."""

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.window import loop_notes

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")


def _data(n=92):
    x = np.random.default_rng(0).normal(size=(n, 8)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _model():
    k2.utils.set_random_seed(0)
    return k2.Sequential([k2.Input((8,)), k2.layers.Dense(1)])


def _loop(helper):
    """The README's loop over 92 samples (11 micro-batches of 8, one of 4), no weight passed."""
    x, y = _data()
    model, loss_fn = _model(), k2.losses.MeanSquaredError()
    optimizer = GradientAccumulator(k2.optimizers.Adam(1e-2), accum_steps=4)

    @tf.function
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    for xb, yb in (optimizer.micro_batches(dataset) if helper else dataset.take(10)):
        micro_step(xb, yb)
    return model, optimizer


def test_the_loop_over_micro_batches_is_the_large_batch():
    model, optimizer = _loop(helper=True)
    x, y = _data()
    large = _model()
    large.compile(optimizer=k2.optimizers.Adam(1e-2), loss="mse")
    large.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert int(optimizer.iterations) == 3 and optimizer.held_micro_batches == 0
    for ours, theirs in zip(model.get_weights(), large.get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_an_uncompiled_models_weights_read_with_a_window_open_are_told_of_once():
    model, optimizer = _loop(helper=False)      # 10 micro-batches: 2 held, never closed
    with pytest.warns(loop_notes.CustomLoopWarning, match="holds 2 micro-batch"):
        model.get_weights()
    optimizer.close_partial_window()
    assert optimizer._state.notes.loop_notes.warned == {"open"}
