"""A model with a real memory cliff: its step runs out of memory from a micro-batch you choose.

`MemoryCliff(cliff)` builds, from its input, a tensor of b^2 floats for a batch of
b < cliff samples (kilobytes) and of 2^40 floats (4 TiB) from b = cliff on: more than any
machine has, so TensorFlow refuses the allocation at once with a real
`ResourceExhaustedError`, before anything is written (on CPU too), and the process trains
on. The tensor's value depends on the data (0 * sum(x): a constant of static shape would be
folded by Grappler into another error), and it is reduced to zero and added to the input,
so the model computes exactly what it computes without the layer (`x + 0.0` is `x`), and
it has no weights and draws nothing: `mlp(cliff=None)` is the same model, with the same
initial weights, for the reference run at the large batch.

Tests of the micro-batch probe, of the Trainer's option and of mid-run recovery use it.
"""

import keras
import tensorflow as tf

from tests.accumulator import reference as ref

OUT_OF_MEMORY_ELEMENTS = 2 ** 40


class MemoryCliff(keras.layers.Layer):
    """The identity, whose step needs 4 TiB for a batch of `cliff` samples or more."""

    def __init__(self, cliff, **kwargs):
        super().__init__(**kwargs)
        self.cliff = int(cliff)

    def call(self, x):
        b = tf.shape(x, out_type=tf.int64)[0]
        elements = tf.where(b < self.cliff, b * b, tf.constant(OUT_OF_MEMORY_ELEMENTS, tf.int64))
        aside = tf.fill(tf.reshape(elements, [1]), 0.0 * tf.reduce_sum(x))
        return x + 0.0 * tf.reduce_sum(aside)

    def get_config(self):
        return {**super().get_config(), "cliff": self.cliff}


def mlp(cliff=None, seed=0):
    """`reference.mlp`, with a `MemoryCliff(cliff)` after its input (none with `cliff=None`)."""
    keras.utils.set_random_seed(seed)
    cliff_layers = [] if cliff is None else [MemoryCliff(cliff)]
    return keras.Sequential([
        keras.Input((ref.FEATURES,)),
        *cliff_layers,
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ])
