"""Keras 2: lookups made once per batch and losses that sum, against Keras 2's own large batch.

Keras 2's optimizers sum repeated rows themselves, so a position table looked up
once per batch is exact whichever way the window holds its rows; these tests
keep it so, as keras.io's layer is written for Keras 2 (`tf.keras`). A loss
reduced by "sum" makes the window sum its micro-batches' gradients, as in Keras 3.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import flavours
from tests import deltas

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")
MAXLEN, VOCAB = 6, 30


def _text_model():
    class TokenAndPositionEmbedding(k2.layers.Layer):     # keras.io's, in tf.keras
        def __init__(self, maxlen, vocab_size, embed_dim):
            super().__init__()
            self.token_emb = k2.layers.Embedding(input_dim=vocab_size, output_dim=embed_dim)
            self.pos_emb = k2.layers.Embedding(input_dim=maxlen, output_dim=embed_dim)

        def call(self, x):
            positions = self.pos_emb(tf.range(start=0, limit=tf.shape(x)[-1], delta=1))
            return self.token_emb(x) + positions

    k2.utils.set_random_seed(0)
    inputs = k2.Input((MAXLEN,), dtype="int32")
    hidden = k2.layers.GlobalAveragePooling1D()(TokenAndPositionEmbedding(MAXLEN, VOCAB, 8)(inputs))
    return k2.Model(inputs, k2.layers.Dense(1)(hidden))


def _fit(model, optimizer, batch, loss="mse"):
    rng = np.random.RandomState(0)
    x = rng.randint(0, VOCAB, size=(96, MAXLEN)).astype("int32")
    y = rng.randn(96, 1).astype("float32")
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def test_position_lookup_matches_keras2_large_batch():
    expected = _fit(_text_model(), k2.optimizers.Adam(1e-2), 32)
    trained = _fit(_text_model(), GradientAccumulator(k2.optimizers.Adam(1e-2), 4), 8)
    assert deltas.max_abs_diff(expected, [w * 0 for w in expected]) > 1e-3
    assert deltas.max_abs_diff(trained, expected) <= 1e-5


@pytest.mark.parametrize("reduction", ["sum", "sum_over_batch_size"])
def test_every_loss_reduction_matches_keras2_large_batch(reduction):
    loss = lambda: k2.losses.MeanSquaredError(reduction=reduction)
    expected = _fit(_text_model(), k2.optimizers.SGD(1e-3), 32, loss())
    trained = _fit(_text_model(), GradientAccumulator(k2.optimizers.SGD(1e-3), 4), 8, loss())
    assert deltas.max_abs_diff(trained, expected) <= 1e-5
    if reduction == "sum":      # control: the mean of the micro-batches' sums
        mean = _fit(_text_model(), GradientAccumulator(k2.optimizers.SGD(1e-3), 4, loss_reduction="mean"), 8, loss())
        assert deltas.max_abs_diff(mean, expected) > 1e-4
