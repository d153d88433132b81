"""Every loss reduction: the window applies what Keras' own large batch applies.

A loss reduced by "sum" (or "none") is the sum over the batch's samples, so the
large batch's gradient is the sum of its micro-batches', not their mean; Adam's
scale invariance hides most of a wrong factor, but not its epsilon (set large
here so it shows) or clipping thresholds. Each case compares with Keras' own
`fit` at the large batch, with a short last batch (60 samples, batches of 24) and
with sample weights; the controls show that the mean of the micro-batches lands
elsewhere.
"""

import functools

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref

MICRO, ACCUM, SAMPLES = 6, 4, 60


def _data():
    rng = np.random.RandomState(0)
    return (rng.randn(SAMPLES, 5).astype("float32"), rng.randn(SAMPLES, 1).astype("float32"),
            rng.uniform(0.1, 2.0, size=SAMPLES).astype("float32"))


def _model(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])


OPTIMIZERS = {"SGD": lambda: keras.optimizers.SGD(1e-3),
              "Adam": lambda: keras.optimizers.Adam(1e-2, epsilon=0.1),
              "Adam-clipnorm": lambda: keras.optimizers.Adam(1e-2, clipnorm=0.5)}


def _fit(optimizer, batch, reduction, weighted, model=None, epochs=2):
    x, y, weights = _data()
    model = model or _model()
    model.compile(optimizer=optimizer, loss=keras.losses.MeanSquaredError(reduction=reduction), jit_compile=False)
    model.fit(x, y, sample_weight=weights if weighted else None, batch_size=batch, epochs=epochs,
              shuffle=False, verbose=0)
    return model


@functools.lru_cache(maxsize=None)
def _large_batch(name, reduction, weighted):
    """Keras' own fit at the large batch (read only: a case and its control share it)."""
    return _fit(OPTIMIZERS[name](), MICRO * ACCUM, reduction, weighted)


# Adam's unweighted "none" and "mean_with_sample_weight" apart (5 s each): SGD's weighted cases of
# the same reductions run, Adam's epsilon by its weighted "sum", unweighted batches by SGD's "sum".
@pytest.mark.parametrize("name, reduction, weighted", [
    ("SGD", "sum", False), ("Adam", "sum", True), ("Adam-clipnorm", "sum", True),
    pytest.param("Adam", "none", False, marks=pytest.mark.apart),
    ("SGD", "none", True), ("Adam", "sum_over_batch_size", True), ("SGD", "mean_with_sample_weight", True),
    pytest.param("Adam", "mean_with_sample_weight", False, marks=pytest.mark.apart),
])
def test_fit_matches_keras_large_batch_for_every_reduction(name, reduction, weighted):
    make = OPTIMIZERS[name]
    expected = _large_batch(name, reduction, weighted)
    trained = _fit(GradientAccumulator(make(), ACCUM), MICRO, reduction, weighted)
    assert ref.max_abs_diff(expected.get_weights(), _model().get_weights()) > 1e-3
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-5


@pytest.mark.parametrize("name", ["SGD", "Adam"])    # clipping saturates both: no control there
def test_control_the_mean_of_a_summed_loss_lands_elsewhere(name):
    make = OPTIMIZERS[name]
    expected = _large_batch(name, "sum", False)
    trained = _fit(GradientAccumulator(make(), ACCUM, loss_reduction="mean"), MICRO, "sum", False)
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) > 1e-3


def _summing_loop(model, optimizer, batch, **apply_kwargs):
    """A custom loop whose hand-written loss sums over the samples."""
    x, y, _ = _data()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.square(model(xb, training=True) - yb))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables, **apply_kwargs)

    for _ in range(2):
        for start in range(0, len(x), batch):
            step(x[start:start + batch], y[start:start + batch])
        if isinstance(optimizer, GradientAccumulator):
            optimizer.close_partial_window()        # the epoch's short last batch
    return model


def test_custom_loop_with_a_summed_loss_says_loss_reduction_sum():
    expected = _summing_loop(_model(), OPTIMIZERS["SGD"](), MICRO * ACCUM)
    accumulator = GradientAccumulator(OPTIMIZERS["SGD"](), ACCUM, loss_reduction="sum")
    trained = _summing_loop(_model(), accumulator, MICRO)
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-5
    # Control: not told, the window takes the mean of its micro-batches.
    untold = GradientAccumulator(OPTIMIZERS["SGD"](), ACCUM)
    control = _summing_loop(_model(), untold, MICRO)
    assert ref.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-3


class SummingModel(keras.Model):
    """A `compute_loss` override that sums over the samples and does not call `super()`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.net = _model()

    def call(self, x):
        return self.net(x)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return tf.reduce_sum(tf.square(y_pred - y))


def test_compute_loss_override_that_sums():
    x, y, _ = _data()

    def fit(optimizer, batch):
        model = SummingModel()
        model.compile(optimizer=optimizer, jit_compile=False)
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        return model

    expected = fit(OPTIMIZERS["Adam"](), MICRO * ACCUM)
    trained = fit(GradientAccumulator(OPTIMIZERS["Adam"](), ACCUM, loss_reduction="sum"), MICRO)
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-5


def test_two_mirrored_replicas_with_a_summed_loss():
    def fit(make, batch):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                                  cross_device_ops=tf.distribute.ReductionToOneDevice())
        with strategy.scope():
            model = _model()
            return _fit(make(), batch, "sum", True, model=model)

    expected = fit(OPTIMIZERS["Adam"], MICRO * ACCUM)
    trained = fit(lambda: GradientAccumulator(OPTIMIZERS["Adam"](), ACCUM), MICRO)
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-5


def test_bad_input_is_refused_before_training():
    with pytest.raises(ValueError, match=r"`loss_reduction` must be one of \('auto', 'mean', 'sum'\); received 'total'"):
        GradientAccumulator(keras.optimizers.SGD(), ACCUM, loss_reduction="total")
    accumulator = GradientAccumulator(keras.optimizers.SGD(), ACCUM, loss_reduction="sum")
    variable = keras.Variable(np.zeros(2, "float32"))
    with pytest.raises(ValueError, match="`micro_batch_weight` is for losses that are means"):
        accumulator.apply([tf.ones(2)], [variable], micro_batch_weight=3.0)
    assert accumulator.get_config()["loss_reduction"] == "sum"


def test_a_summed_loss_cannot_measure_the_noise_scale():
    """The noise scale weighs each micro-batch's mean gradient by its samples; a summed
    loss carries neither: refused at construction when said, at the first step when seen."""
    with pytest.raises(ValueError, match="`measure_noise_scale=True` needs a loss that is a mean"):
        GradientAccumulator(keras.optimizers.SGD(), ACCUM, loss_reduction="sum", measure_noise_scale=True)
    model = _model()
    optimizer = GradientAccumulator(keras.optimizers.SGD(1e-3), ACCUM, measure_noise_scale=True)
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="This loss sums over its samples"):
        _fit(optimizer, MICRO, "sum", False, model=model)
    assert ref.max_abs_diff(model.get_weights(), before) == 0.0 and int(optimizer.iterations.numpy()) == 0
    # The same with a mean loss measures.
    measured = GradientAccumulator(keras.optimizers.SGD(1e-3), ACCUM, measure_noise_scale=True)
    _fit(measured, MICRO, "sum_over_batch_size", False)
    assert measured.noise_scale_estimate.window_count > 0
