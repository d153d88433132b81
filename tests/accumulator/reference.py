"""Independent references the accumulator is compared against.

* `fit_large_batch`: plain Keras `fit` with the effective batch, no accumulator.
* `tape_accumulation_loop`: the seeds' hand-written `tf.GradientTape` loop
  (sum the micro-batch gradients, divide by their count, apply every N).
"""

import numpy as np
import keras
import tensorflow as tf

from tests import deltas

FEATURES = 6


def regression_data(samples, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, FEATURES).astype("float32")
    w = rng.randn(FEATURES, 1).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.randn(samples, 1)).astype("float32")
    return x, y


def mlp(seed=0, dtype=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(16, activation="tanh", dtype=dtype),
            keras.layers.Dense(8, activation="tanh", dtype=dtype),
            keras.layers.Dense(1, dtype=dtype),
        ]
    )


VOCAB = 40
TOKENS = 10


def embedding_model(vocab=VOCAB, seed=0):
    """Token ids -> Embedding -> mean -> Dense: its table gets `IndexedSlices` gradients."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((TOKENS,), dtype="int32"),
        keras.layers.Embedding(vocab, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])


def token_data(samples=256, vocab=VOCAB, seed=0):
    """10 ids of 40 per sample: in batches of 32, most rows are looked up repeatedly."""
    rng = np.random.RandomState(seed)
    x = rng.randint(0, vocab, size=(samples, TOKENS)).astype("int32")
    y = rng.randn(samples, 1).astype("float32")
    return x, y


def max_abs_diff(weights_a, weights_b):
    """The largest absolute difference between two weight lists (noted for --record-deltas)."""
    return deltas.note(max(float(np.max(np.abs(a - b))) for a, b in zip(weights_a, weights_b)))


def fit_large_batch(model, optimizer, x, y, batch_size, epochs=1, loss="mse"):
    model.compile(optimizer=optimizer, loss=loss)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


def tape_accumulation_loop(model, optimizer, x, y, micro_batch, accum_steps, loss_fn):
    """The seeds' pattern: sum gradients, divide by the count, apply, reset."""
    variables = model.trainable_variables
    buffers = [tf.Variable(tf.zeros_like(v)) for v in variables]

    @tf.function
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        for buf, g in zip(buffers, tape.gradient(loss, variables)):
            buf.assign_add(g)

    @tf.function
    def apply(count):
        optimizer.apply_gradients(
            [(buf / count, v) for buf, v in zip(buffers, variables)]
        )
        for buf in buffers:
            buf.assign(tf.zeros_like(buf))

    seen = 0
    for start in range(0, len(x), micro_batch):
        micro_step(x[start:start + micro_batch], y[start:start + micro_batch])
        seen += 1
        if seen == accum_steps:
            apply(tf.constant(float(seen)))
            seen = 0
    if seen:
        apply(tf.constant(float(seen)))
    return model


class CountingReduction(tf.distribute.ReductionToOneDevice):
    """Counts executed batched cross-replica reductions (graph or eager)."""

    def __init__(self):
        super().__init__()
        with tf.init_scope():
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.count.assign_add(1)
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)
