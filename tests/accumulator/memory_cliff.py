"""A model with a real memory cliff: its step runs out of memory from a micro-batch you choose.

`MemoryCliff(cliff)` builds, from its input, a tensor of b^2 floats for a batch of
b < cliff samples (kilobytes) and of 2^40 floats (4 TiB) from b = cliff on: more than any
machine has, so TensorFlow refuses the allocation with a real `ResourceExhaustedError`,
before anything is written (on CPU too), and the process trains on. Where the allocator
retries first (oneDNN's on a CPU, TensorFlow's BFC allocator on a GPU) the error comes
after about 10 s; with TF_ENABLE_ONEDNN_OPTS=0 on a CPU, at once. The tensor is filled
with sum(x), and what is added to the input is its maximum minus sum(x): exactly 0.0 for
finite data, so the model computes exactly what it computes without the layer (`x + 0.0`
is `x`). Grappler cannot see that zero: a tensor multiplied by the constant 0.0 is folded
away with the allocation behind it (TF 2.16), and a fill of constants of static shape is folded into another error. The layer has no weights and draws nothing: `mlp(cliff=None)` is the same model, with the same
initial weights, for the reference run at the large batch.

Tests of the micro-batch probe, of the Trainer's option and of mid-run recovery use it.
"""

import keras
import tensorflow as tf

from tests.accumulator import reference as ref

OUT_OF_MEMORY_ELEMENTS = 2 ** 40


def _elements(fits, elements):
    """`elements` where `fits`, else 2^40 (4 TiB of floats): the allocation a cliff asks for."""
    return tf.where(fits, elements, tf.constant(OUT_OF_MEMORY_ELEMENTS, tf.int64))


def _plus_zero_after(x, elements):
    """`x + 0.0`, exactly for finite data, computed from a tensor of `elements` floats filled
    with sum(x): Grappler cannot fold it away, so the allocation happens (or fails)."""
    total = tf.reduce_sum(x)
    return x + (tf.reduce_max(tf.fill(tf.reshape(elements, [1]), total)) - total)


def _longest(sequences):
    """The longest sequence of a padded batch: its time steps with a nonzero feature."""
    return tf.reduce_max(tf.reduce_sum(tf.cast(tf.reduce_any(tf.not_equal(sequences, 0.0), axis=-1), tf.int64), axis=1))


class MemoryCliff(keras.layers.Layer):
    """The identity, whose step needs 4 TiB for a batch of `cliff` samples or more."""

    def __init__(self, cliff, **kwargs):
        super().__init__(**kwargs)
        self.cliff = int(cliff)

    def call(self, x):
        b = tf.shape(x, out_type=tf.int64)[0]
        return _plus_zero_after(x, _elements(b < self.cliff, b * b))

    def get_config(self):
        return {**super().get_config(), "cliff": self.cliff}


class GlobalNoise(keras.layers.Layer):
    """Adds noise drawn from Keras' global seed generator in training (no generator of its own):
    a step changes the global random state, which a probe must put back."""

    def call(self, x, training=False):
        return x + 0.01 * keras.random.normal(tf.shape(x)) if training else x


def mlp(cliff=None, seed=0, global_noise=False):
    """`reference.mlp`, with a `MemoryCliff(cliff)` after its input (none with `cliff=None`),
    and with `global_noise` a `GlobalNoise` layer after it."""
    keras.utils.set_random_seed(seed)
    first = ([] if cliff is None else [MemoryCliff(cliff)]) + ([GlobalNoise()] if global_noise else [])
    return keras.Sequential([
        keras.Input((ref.FEATURES,)),
        *first,
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(1),
    ])


class SequenceCliff(keras.layers.Layer):
    """The identity on sequences (batch, time, features), whose step needs 4 TiB once the
    micro-batch's samples times its longest sequence (time steps with a nonzero feature)
    reach `budget`: sequences padded per batch that grow cross it at a smaller micro-batch."""

    def __init__(self, budget, **kwargs):
        super().__init__(**kwargs)
        self.budget = int(budget)

    def call(self, x):
        cost = tf.shape(x, out_type=tf.int64)[0] * _longest(x)
        return _plus_zero_after(x, _elements(cost < self.budget, cost))

    def get_config(self):
        return {**super().get_config(), "budget": self.budget}


class BackwardCliff(keras.layers.Layer):
    """`[sequences, hidden] -> hidden`, whose gradient (the backward pass only) needs 4 TiB
    once the micro-batch's samples times its longest sequence reach `budget`."""

    def __init__(self, budget, **kwargs):
        super().__init__(**kwargs)
        self.budget = int(budget)

    def call(self, inputs):
        sequences, hidden = inputs
        cost = tf.shape(sequences, out_type=tf.int64)[0] * _longest(sequences)
        elements = _elements(cost < self.budget, cost)

        @tf.custom_gradient
        def identity(h):
            return tf.identity(h), lambda upstream: _plus_zero_after(upstream, elements)

        return identity(hidden)


def backward_sequence_model(budget=None, features=3, seed=0):
    """`sequence_model` with the cliff in the backward pass, between the per-step Dense and
    the mean over time: the output layer's gradient exists before it runs out."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((None, features))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if budget is not None:
        hidden = BackwardCliff(budget)([inputs, hidden])
    pooled = keras.layers.GlobalAveragePooling1D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(pooled))


def sequence_model(budget=None, features=3, seed=0):
    """Sequences padded per batch -> a `SequenceCliff(budget)` (none with `budget=None`) ->
    Dense(8, tanh) at each step -> mean over time -> Dense(1)."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((None, features)),
        *([] if budget is None else [SequenceCliff(budget)]),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])


class SizeCliff(keras.layers.Layer):
    """`[x, size] -> x`, the identity on `x`, whose step needs 4 TiB once the micro-batch's
    samples times its largest `size` (a feature of each example, >= 1) reach `budget`:
    data whose later examples are larger crosses it at a smaller micro-batch. No cliff
    with `budget=None` (the same math: the reference at the large batch)."""

    def __init__(self, budget=None, **kwargs):
        super().__init__(**kwargs)
        self.budget = None if budget is None else int(budget)

    def call(self, inputs):
        x, size = inputs
        cost = tf.shape(x, out_type=tf.int64)[0] * tf.cast(tf.reduce_max(size), tf.int64)
        return _plus_zero_after(x, cost if self.budget is None else _elements(cost < self.budget, cost))

    def get_config(self):
        return {**super().get_config(), "budget": self.budget}


def _longest_ids(ids):
    """The longest sequence of a batch of token ids padded with 0: its nonzero ids."""
    return tf.reduce_max(tf.reduce_sum(tf.cast(tf.not_equal(ids, 0), tf.int64), axis=1))


class TokenCliff(keras.layers.Layer):
    """`[embedded, ids] -> embedded`, the identity on the embedded tokens, whose step needs
    4 TiB once the micro-batch's samples times its longest sequence (nonzero ids) reach
    `budget`: tokens per step, the cliff of a text model padded per batch. It comes after
    the lookup, whose gradient's ids exist before the forward pass ends (the rows' id
    buffer can be written in a step that then runs out). No cliff with `budget=None`
    (the same math: the reference at the large batch)."""

    def __init__(self, budget=None, **kwargs):
        super().__init__(**kwargs)
        self.budget = None if budget is None else int(budget)

    def call(self, inputs):
        embedded, ids = inputs
        cost = tf.shape(ids, out_type=tf.int64)[0] * _longest_ids(ids)
        return _plus_zero_after(embedded, cost if self.budget is None else _elements(cost < self.budget, cost))

    def get_config(self):
        return {**super().get_config(), "budget": self.budget}


def embedding_model(budget=None, vocabulary=50, dimension=16, seed=0):
    """Token ids padded per batch with 0 -> a plain `Embedding` (its gradient: rows of a
    lookup per sample) -> a `TokenCliff(budget)` -> mean over time -> Dense(8, tanh) ->
    Dense(1)."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32")
    embedded = keras.layers.Embedding(vocabulary, dimension)(ids)
    hidden = keras.layers.GlobalAveragePooling1D()(TokenCliff(budget)([embedded, ids]))
    return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(hidden)))
