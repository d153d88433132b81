"""Keras 2 layers with a real memory cliff: a step runs out of memory past a size you choose.

The Keras 2 twins of `tests/accumulator/memory_cliff.py` (read its docstring): each layer is
the identity (`x + 0.0`, exactly, for finite data), computed through a tensor of a few
elements below the cliff and of 2^40 floats (4 TiB) from it on, which TensorFlow refuses
with a real `ResourceExhaustedError` before anything is written; the process trains on.
With `budget=None` there is no cliff: the same model, with the same initial weights, for
Keras 2's own run at the large batch.
"""

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import flavours

k2 = flavours.keras2_module()

OUT_OF_MEMORY_ELEMENTS = 2 ** 40


def _elements(budget, cost):
    """`cost` elements where `cost < budget` (or no budget), else 2^40 (4 TiB of floats)."""
    if budget is None:
        return cost
    return tf.where(cost < budget, cost, tf.constant(OUT_OF_MEMORY_ELEMENTS, tf.int64))


def _plus_zero_after(x, elements):
    """`x + 0.0`, exactly for finite data, from a tensor of `elements` floats filled with sum(x):
    Grappler cannot fold it away, so the allocation happens (or fails)."""
    total = tf.reduce_sum(x)
    return x + (tf.reduce_max(tf.fill(tf.reshape(elements, [1]), total)) - total)


if k2 is not None:
    class SizeCliff(k2.layers.Layer):
        """The identity on rows whose first feature is their "size" (an integer >= 1): a step needs
        4 TiB once its micro-batch's rows times their largest size reach `budget`, so data whose
        later rows are larger crosses it mid-run."""

        def __init__(self, budget=None, **kwargs):
            super().__init__(**kwargs)
            self.budget = budget

        def call(self, x):
            size = tf.cast(tf.math.ceil(tf.reduce_max(x[:, 0])), tf.int64)
            return _plus_zero_after(x, _elements(self.budget, tf.shape(x, out_type=tf.int64)[0] * size))

    class TokenCliff(k2.layers.Layer):
        """`[embedded, ids] -> embedded`, whose step needs 4 TiB once the micro-batch's rows times
        its longest sequence (nonzero ids) reach `budget`: the cliff of a text model padded per batch."""

        def __init__(self, budget=None, **kwargs):
            super().__init__(**kwargs)
            self.budget = budget

        def call(self, inputs):
            embedded, ids = inputs
            longest = tf.reduce_max(tf.reduce_sum(tf.cast(tf.not_equal(ids, 0), tf.int64), axis=1))
            return _plus_zero_after(embedded, _elements(self.budget, tf.shape(ids, out_type=tf.int64)[0] * longest))

    class PaddedTokenCliff(k2.layers.Layer):
        """`[embedded, ids] -> embedded`, whose step needs 4 TiB once the micro-batch's rows times
        its padded length reach `budget`: static shapes, so it compiles under XLA (the memory of the
        whole program refused at launch). The big tensor is filled, updated in one place and sorted
        (XLA folds a reduction of a plain fill away); what is added is exactly 0.0, without a gradient."""

        def __init__(self, budget=None, **kwargs):
            super().__init__(**kwargs)
            self.budget = budget

        def call(self, inputs):
            embedded, ids = inputs
            cost = tf.shape(ids, out_type=tf.int64)[0] * tf.shape(ids, out_type=tf.int64)[1]
            fits = tf.constant(True) if self.budget is None else cost < self.budget
            shape = tf.where(fits, tf.stack([cost, tf.constant(1, tf.int64)]),
                             tf.constant([2 ** 20, 2 ** 20], tf.int64))
            total = tf.reduce_sum(embedded)
            big = tf.tensor_scatter_nd_update(tf.fill(shape, total), [[0, 0]], tf.reshape(total, [1]))
            return embedded + tf.stop_gradient(tf.sort(big, axis=0)[-1, -1] - total)


def mlp(budget=None, features=6, normalised=False, seed=0):
    """A `SizeCliff(budget)` -> (a BatchNormalization) -> Dense(16, tanh) -> Dense(1)."""
    k2.utils.set_random_seed(seed)
    return k2.Sequential([k2.Input((features,)), SizeCliff(budget),
                          *([k2.layers.BatchNormalization()] if normalised else []),
                          k2.layers.Dense(16, activation="tanh"), k2.layers.Dense(1)])


def embedding_model(budget=None, vocabulary=50, static=False, normalised=False, seed=0):
    """Token ids padded per batch with 0 -> `Embedding` -> (a BatchNormalization) -> a token cliff
    (`PaddedTokenCliff` with `static`, which XLA compiles) -> mean over time -> Dense(8, tanh) ->
    Dense(1)."""
    k2.utils.set_random_seed(seed)
    ids = k2.Input((None,), dtype="int32")
    embedded = k2.layers.Embedding(vocabulary, 16)(ids)
    if normalised:
        embedded = k2.layers.BatchNormalization()(embedded)
    cliff = (PaddedTokenCliff if static else TokenCliff)(budget)
    hidden = k2.layers.GlobalAveragePooling1D()(cliff([embedded, ids]))
    return k2.Model(ids, k2.layers.Dense(1)(k2.layers.Dense(8, activation="tanh")(hidden)))
