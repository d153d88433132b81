"""`micro_batch_size` under MirroredStrategy (2 logical CPUs) and MultiWorkerMirroredStrategy
(2 processes on 127.0.0.1): the micro-batch is global, as `fit`'s batch is; the samples'
weighting is global (each replica's weighted sums and weights all-reduced), and the inner
optimizer sees the large batch's gradient once. Exact against Keras' own
`fit(batch_size=E)` on one device, also where the replicas get uneven shares of a batch."""

import functools
import json

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref
from tests.accumulator.multiworker import run_cluster

TOLERANCE = 1e-5
DEVICES = ["/cpu:0", "/cpu:1"]
# Batches of 20, 20 and 5 (the last split 3 and 2 between the replicas); micro-batches of
# 8 (4 per replica): each replica's 10 samples as 4 + 4 + 2 (padded).
SAMPLES, E, B = 45, 20, 8


def _adamw():
    return keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(2e-2, 2, 0.7),
                                  weight_decay=0.05, global_clipnorm=0.05)


def _adam():
    return keras.optimizers.Adam(3e-2, clipnorm=0.05)


def _fit(make_model, optimizer, x, y, strategy=None, batch_size=E, loss="mse", epochs=2, **fit_kwargs):
    with strategy.scope() if strategy else tf.distribute.get_strategy().scope():
        model = make_model()
        model.compile(optimizer=optimizer(), loss=loss)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return model, history.history


def _micro(make_optimizer, size=B):
    return lambda: GradientAccumulator(make_optimizer(), micro_batch_size=size)


@functools.lru_cache(maxsize=None)
def _mirrored():
    """One MirroredStrategy for these tests, reducing through one device, as
    test_mirrored.py's (strategies whose collectives share keys in one process collide)."""
    return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())


@functools.lru_cache(maxsize=None)
def _keras_logs_the_mirrored_loss_as_one_device():
    """Whether Keras' own mirrored `fit` logs one device's loss (3.15 does; 3.8 logs other
    sums under a strategy): a learning rate of 0 keeps both models' weights alike."""
    x, y = ref.regression_data(SAMPLES)
    sgd = lambda: keras.optimizers.SGD(0.0)     # noqa: E731
    one = _fit(ref.mlp, sgd, x, y, epochs=2)[1]["loss"]
    mirrored = _fit(ref.mlp, sgd, x, y, _mirrored(), epochs=2)[1]["loss"]
    return bool(np.allclose(one, mirrored, rtol=1e-5))


def _assert_logged_as_one_device(micro_history, large_history):
    """The logged loss is the large batch's, where Keras' own mirrored `fit` logs it so."""
    if _keras_logs_the_mirrored_loss_as_one_device():
        np.testing.assert_allclose(micro_history["loss"], large_history["loss"], rtol=1e-5)


def test_mirrored_fit_is_the_one_device_large_batch_with_uneven_replicas():
    x, y = ref.regression_data(SAMPLES)
    large, large_history = _fit(ref.mlp, _adamw, x, y)
    micro, micro_history = _fit(ref.mlp, _micro(_adamw), x, y, _mirrored())
    gap = ref.max_abs_diff(large.get_weights(), micro.get_weights())
    assert gap < TOLERANCE, gap
    assert int(micro.optimizer.iterations.numpy()) == 6
    _assert_logged_as_one_device(micro_history, large_history)
    # The test can fail: Keras' own mirrored large batch clips each replica's share (and
    # weighs the uneven last batch's replicas alike), far beyond the tolerance.
    mirrored_keras, _ = _fit(ref.mlp, _adamw, x, y, _mirrored())
    assert ref.max_abs_diff(large.get_weights(), mirrored_keras.get_weights()) > 100 * TOLERANCE


def test_mirrored_sample_weights_and_a_summed_loss():
    x, y = ref.regression_data(SAMPLES)
    weights = np.random.RandomState(1).uniform(0.0, 2.0, SAMPLES).astype("float32")
    large, _ = _fit(ref.mlp, _adam, x, y, sample_weight=weights, epochs=1)
    micro, _ = _fit(ref.mlp, _micro(_adam), x, y, _mirrored(), sample_weight=weights, epochs=1)
    assert ref.max_abs_diff(large.get_weights(), micro.get_weights()) < TOLERANCE
    summed = keras.losses.MeanSquaredError(reduction="sum")
    sgd = lambda: keras.optimizers.SGD(1e-3)     # noqa: E731
    large, _ = _fit(ref.mlp, sgd, x, y, loss=summed, sample_weight=weights, epochs=1)
    micro, _ = _fit(ref.mlp, _micro(sgd), x, y, _mirrored(), loss=summed, sample_weight=weights, epochs=1)
    assert ref.max_abs_diff(large.get_weights(), micro.get_weights()) < TOLERANCE


def test_mirrored_lookups_per_token_and_once_per_batch():
    # Per-token rows gathered in replica order (the large batch's rows); a position
    # table's rows summed over the micro-batches and the replicas, as the large batch has
    # them once (Adam's clipnorm sees every row).
    from tests.accumulator.test_lookups import text_data, text_model

    x, y = ref.token_data(50)
    large, _ = _fit(ref.embedding_model, _adam, x, y, batch_size=24, epochs=1)
    micro, _ = _fit(ref.embedding_model, _micro(_adam, 6), x, y, _mirrored(), batch_size=24, epochs=1)
    assert ref.max_abs_diff(large.get_weights(), micro.get_weights()) < TOLERANCE
    x, y = text_data(50)
    large, _ = _fit(text_model, _adam, x, y, batch_size=24, epochs=1)
    micro, _ = _fit(text_model, _micro(_adam, 6), x, y, _mirrored(), batch_size=24, epochs=1)
    assert ref.max_abs_diff(large.get_weights(), micro.get_weights()) < TOLERANCE


def test_a_micro_batch_the_replicas_cannot_share_is_refused_before_training():
    x, y = ref.regression_data(8)
    with _mirrored().scope():
        model = ref.mlp()
        model.compile(GradientAccumulator(keras.optimizers.Adam(), micro_batch_size=7), "mse")
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match=r"micro_batch_size=7 is not divisible by the 2 replicas.*for example 6"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert ref.max_abs_diff(before, model.get_weights()) == 0.0
    with _mirrored().scope():
        model = ref.mlp()
        model.compile(GradientAccumulator(keras.optimizers.Adam(), micro_batch_size=4), "mse", jit_compile=True)
    with pytest.raises(NotImplementedError, match="jit_compile=False"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_two_workers_train_the_one_device_large_batch(tmp_path):
    # 2 processes: 3 batches of 64 and one of 18 (9 a worker), micro-batches of 16 (8 a worker).
    samples, batch, micro = 210, 64, 16
    codes, output, result = run_cluster(tmp_path / "out", "--samples", samples, "--batch", batch, "--micro", micro,
                                        module="tests.accumulator.fit_effective_batch_worker", timeout=120)
    assert codes == [0, 0], output[-3000:]
    weights, iterations = result
    assert iterations == 4
    x, y = ref.regression_data(samples)
    from tests.accumulator.fit_effective_batch_worker import optimizer

    large, history = _fit(ref.mlp, lambda: optimizer(keras), x, y, batch_size=batch, epochs=1)
    assert ref.max_abs_diff(weights, large.get_weights()) < TOLERANCE
    logged = json.loads(str(np.load(f"{tmp_path / 'out'}.0.npz")["loss"]))
    _assert_logged_as_one_device({"loss": logged}, history)


def _regularized():
    keras.utils.set_random_seed(0)
    features, targets = (a.shape[1] for a in ref.regression_data(1))
    return keras.Sequential([keras.Input((features,)),
                             keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.1)),
                             keras.layers.Dense(targets)])


def test_mirrored_weight_regularization_counts_once():
    # Keras divides each replica's regularizers by the replicas, as its mean losses: the
    # update, R times the replicas' sums over the global weight, holds them once.
    x, y = ref.regression_data(SAMPLES)
    large, large_history = _fit(_regularized, _adam, x, y, epochs=1)
    micro, micro_history = _fit(_regularized, _micro(_adam), x, y, _mirrored(), epochs=1)
    assert ref.max_abs_diff(large.get_weights(), micro.get_weights()) < TOLERANCE
    _assert_logged_as_one_device(micro_history, large_history)
