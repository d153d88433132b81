"""`AccumBatchNormalization` under `GradientAccumulator(inner, micro_batch_size=b)`: the step is
the window. Each micro-batch is normalized with its own real rows (the last one's padding left
out), and the moving statistics are updated once per step with the mean and biased variance of
all the batch's real rows, over every replica.

References: the window (`accum_steps=N`, `fit` at b, each window one batch of E), Keras' own
large-batch `BatchNormalization`, the moving statistics computed from the data, and fixed-b
runs for "auto". The placeholder (moving statistics per micro-batch, padding counted) fails
each of them.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import AccumBatchNormalization, GradientAccumulator
from tests.accumulator import memory_cliff
from tests.accumulator import reference as ref

TOLERANCE = 1e-5
MICRO, ACCUM = 8, 4
E = MICRO * ACCUM
MOMENTUM = 0.8


def _data(samples, seed=0, features=3):
    """Channels of different means and spreads, drifting along the rows so that micro-batch
    means differ (a stock layer's per-micro-batch statistics are then far from the batch's)."""
    rng = np.random.RandomState(seed)
    x = (rng.randn(samples, features) * np.linspace(0.5, 3.0, features) + np.linspace(-1.0, 10.0, features)
         + np.linspace(0, 4, samples)[:, None]).astype("float32")
    return x, rng.randn(samples, 1).astype("float32")


def _model(**norm):
    """Dense -> AccumBatchNormalization -> Dense: the normalized inputs depend on the weights,
    so the weights and the moving statistics both tell how each micro-batch was normalized.
    No bias before the layer: its gradient is zero but for rounding, which Adam would make
    steps of the learning rate's size."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(4, use_bias=False),
                             AccumBatchNormalization(momentum=MOMENTUM, **norm), keras.layers.Dense(1)])


def _moving(model):
    layer = next(layer for layer in model.layers if isinstance(layer, keras.layers.BatchNormalization))
    return [layer.moving_mean.numpy(), layer.moving_variance.numpy()]


def _trained(model):
    """The trainable weights (the window's own counters differ by design: accum_steps 4 and 1)."""
    return [np.asarray(w) for w in model.trainable_weights]


def _assert_close(ours, theirs):
    delta = ref.max_abs_diff(ours, theirs)
    assert delta <= TOLERANCE, delta


@pytest.mark.parametrize("jit_compile", [False, True])
def test_the_step_trains_and_pools_as_the_window(jit_compile):
    """54 samples at E = 32 in micro-batches of 8: a step of 4, then one of 8, 8 and 6 (padded
    to 8, the padding masked). The window (`accum_steps=4`, fit at 8) has the same
    micro-batches, its last window partial: weights and moving statistics within 1e-5, over
    two epochs; under XLA the whole step (loop, pooling, close) is one program."""
    x, y = _data(54)
    window = _model()
    window.compile(GradientAccumulator(keras.optimizers.Adam(0.05), ACCUM), "mse")
    window.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    step = _model()
    step.compile(GradientAccumulator(keras.optimizers.Adam(0.05), micro_batch_size=MICRO), "mse",
                 jit_compile=jit_compile)
    step.fit(x, y, batch_size=E, epochs=2, shuffle=False, verbose=0)
    _assert_close(_trained(step), _trained(window))
    _assert_close(_moving(step), _moving(window))
    assert float(step.layers[1]._window_count.numpy()) == 0.0      # closed by each step


def test_one_update_moves_the_statistics_as_keras_large_batch_does(caplog):
    """One batch of 30 in micro-batches of 8 (the last of 6, padded): the moving statistics move
    once, with the batch's mean and variance, as Keras' own layer at fit(batch_size=30) moves
    them. A layer given accum_steps=4 pools the step all the same, with a warning."""
    x, y = _data(30)
    keras.utils.set_random_seed(0)
    large = keras.Sequential([keras.Input((3,)), keras.layers.BatchNormalization(momentum=MOMENTUM),
                              keras.layers.Dense(1)])
    large.compile(keras.optimizers.SGD(0.1), "mse")
    large.fit(x, y, batch_size=30, shuffle=False, verbose=0)
    keras.utils.set_random_seed(0)
    ours = keras.Sequential([keras.Input((3,)), AccumBatchNormalization(momentum=MOMENTUM, accum_steps=ACCUM),
                             keras.layers.Dense(1)])
    ours.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size=MICRO), "mse")
    with caplog.at_level(logging.WARNING):
        ours.fit(x, y, batch_size=30, shuffle=False, verbose=0)
    _assert_close(_moving(ours), _moving(large))
    expected_mean = (1 - MOMENTUM) * x.mean(axis=0)
    expected_variance = MOMENTUM + (1 - MOMENTUM) * x.var(axis=0)
    _assert_close(_moving(ours), [expected_mean, expected_variance])
    assert "accum_steps=4, which micro_batch_size ignores" in caplog.text


def test_a_keras_mask_and_the_padding_are_both_left_out():
    """Token ids padded with 0 (`mask_zero=True`): the layer's moments count the unmasked
    tokens of the real rows only, as the window's count the unmasked tokens of its
    micro-batches: weights and moving statistics within 1e-5 of the window."""
    rng = np.random.RandomState(0)
    ids = rng.randint(1, 20, size=(54, 6))
    for row in ids:
        row[rng.randint(1, 7):] = 0
    y = rng.randn(54, 1).astype("float32")

    def model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(20, 4, mask_zero=True),
                                 AccumBatchNormalization(momentum=MOMENTUM), keras.layers.GlobalAveragePooling1D(),
                                 keras.layers.Dense(1)])

    window = model()
    window.compile(GradientAccumulator(keras.optimizers.SGD(0.1), ACCUM), "mse")
    window.fit(ids, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    step = model()
    step.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size=MICRO), "mse")
    step.fit(ids, y, batch_size=E, epochs=1, shuffle=False, verbose=0)
    _assert_close(_trained(step), _trained(window))
    _assert_close(_moving(step), _moving(window))


def _mirrored():
    # ReductionToOneDevice, as in test_batch_norm.py: a second strategy of the CPU default
    # (collective ops) in one process clashes with the first's collective keys.
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=tf.distribute.ReductionToOneDevice())


def _window_over(x, y, groups):
    """A dataset whose elements are the micro-batches `groups` ((start, stop) rows, of uneven
    sizes): what the one-device window trains on, one micro-batch per `fit` step."""
    parts = [tf.data.Dataset.from_tensor_slices((x[a:b], y[a:b])).batch(b - a) for a, b in groups]
    data = parts[0]
    for part in parts[1:]:
        data = data.concatenate(part)
    return data


def test_two_replicas_with_uneven_shares_pool_every_real_row():
    """2 replicas, 53 samples at E = 32, b = 8 (4 per replica): the first batch is 16 + 16 rows
    (4 micro-batches of 4 each), the last 21 rows 11 + 10: replica 0 trains 4, 4 and 3 (+1
    padding), replica 1 4, 4 and 2 (+2). The one-device window over the same 14 micro-batches
    (8, then 6 applied at the epoch's end) is the reference: weights and moving statistics."""
    x, y = _data(53)
    first = [(a, a + 4) for a in range(0, 32, 4)]
    last = [(32, 36), (36, 40), (40, 43), (43, 47), (47, 51), (51, 53)]
    window = _model()
    window.compile(GradientAccumulator(keras.optimizers.Adam(0.05), len(first)), "mse")
    window.fit(_window_over(x, y, first + last), epochs=1, shuffle=False, verbose=0)
    with _mirrored().scope():
        step = _model()
        step.compile(GradientAccumulator(keras.optimizers.Adam(0.05), micro_batch_size=MICRO), "mse")
    step.fit(x, y, batch_size=E, epochs=1, shuffle=False, verbose=0)
    _assert_close(_trained(step), _trained(window))
    _assert_close(_moving(step), _moving(window))


def test_synchronized_layers_under_replicas_are_refused_with_the_way_out():
    x, y = _data(16)
    with _mirrored().scope():
        model = _model(synchronized=True)
        model.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size=MICRO), "mse")
    with pytest.raises(NotImplementedError, match="synchronized=True under micro_batch_size"):
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)


def test_a_layer_on_other_rows_than_the_samples_is_refused():
    """Time steps folded into the samples' axis: samples x steps rows, whose padding cannot be
    told. (Keras 3's TimeDistributed calls the layer on each step's samples: that trains.)"""
    x = np.random.RandomState(0).randn(16, 5, 3).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((5, 3)), keras.layers.Lambda(lambda t: keras.ops.reshape(t, (-1, 3))),
                              AccumBatchNormalization(), keras.layers.Lambda(lambda t: keras.ops.reshape(t, (-1, 5, 3))),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size=MICRO), "mse")
    with pytest.raises(NotImplementedError, match="called on 40 rows in a micro-batch of 8 samples"):
        model.fit(x, np.zeros((16, 1), "float32"), batch_size=16, epochs=1, verbose=0)


class RowCliff(keras.layers.Layer):
    """The identity, whose step needs 4 TiB once the micro-batch's rows times its largest last
    feature (rounded up) reach `budget`: a batch whose last row is "long" runs out in its last
    micro-batch, after the first ones trained (`memory_cliff`'s allocation)."""

    def __init__(self, budget, **kwargs):
        super().__init__(**kwargs)
        self.budget = int(budget)

    def call(self, x):
        longest = tf.cast(tf.math.ceil(tf.reduce_max(x[:, -1])), tf.int64)
        cost = tf.shape(x, out_type=tf.int64)[0] * longest
        return memory_cliff._plus_zero_after(x, memory_cliff._elements(cost < self.budget, cost))


def _cliff_model(budget):
    """RowCliff -> AccumBatchNormalization -> Dense: the layer normalizes the data itself, so
    its moving statistics are the data's, whatever the weights."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), RowCliff(budget), AccumBatchNormalization(momentum=MOMENTUM),
                             keras.layers.Dense(1)])


def _cliff_data():
    """36 samples in batches of 12, the last feature 1 but for the second batch's last row (6)."""
    x, y = _data(36)
    x[:, -1] = 1.0
    x[23, -1] = 6.0
    return x, y


def _moving_from_data(x, batch=12):
    """The moving statistics of a layer on the data itself, updated once per batch."""
    mean, variance = np.zeros(x.shape[1]), np.ones(x.shape[1])
    for start in range(0, len(x), batch):
        rows = x[start:start + batch].astype("float64")
        mean = MOMENTUM * mean + (1 - MOMENTUM) * rows.mean(axis=0)
        variance = MOMENTUM * variance + (1 - MOMENTUM) * rows.var(axis=0)
    return [mean, variance]


def test_auto_puts_back_a_failed_steps_pooled_statistics():
    """Batches of 12, the last feature 1 except the second batch's last row (6); budget 30.
    Batch 0 fits whole (12); batch 1 runs out whole (72), then at 6 in its second micro-batch
    (36), after its first pooled 6 rows; it trains at 4 (one change, two errors). The failed steps' pooled rows are put
    back: the moving statistics are those of each batch of 12 from the data, and the weights
    those of fixed micro-batches (12, then 4)."""
    x, y = _cliff_data()
    auto = _cliff_model(30)
    auto.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size="auto"), "mse")
    auto.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    changes = [(c.previous_micro_batch, c.micro_batch, c.out_of_memory_errors) for c in auto.optimizer.micro_batch_changes]
    assert changes == [(12, 4, 2)]
    _assert_close(_moving(auto), _moving_from_data(x))
    fixed = _cliff_model(30)
    for size, rows in ((12, slice(0, 12)), (4, slice(12, 36))):
        fixed.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size=size), "mse")
        fixed.fit(x[rows], y[rows], batch_size=12, epochs=1, shuffle=False, verbose=0)
    _assert_close(_trained(auto), _trained(fixed))


def test_auto_under_two_replicas_pools_both_and_puts_a_failed_step_back():
    """The same data on 2 replicas (6 rows each at b = 12): replica 1's share of batch 1 runs
    out (6 x 6), the batch trains again at 6 (3 rows each). The split step pools each
    replica's rows in its loop and closes after it: the moving statistics are each batch's."""
    x, y = _cliff_data()
    with _mirrored().scope():
        auto = _cliff_model(30)
        auto.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size="auto"), "mse")
    auto.fit(x, y, batch_size=12, epochs=1, shuffle=False, verbose=0)
    assert [(c.previous_micro_batch, c.micro_batch) for c in auto.optimizer.micro_batch_changes] == [(12, 6)]
    _assert_close(_moving(auto), _moving_from_data(x))
    assert float(auto.layers[1]._window_count.numpy()) == 0.0
