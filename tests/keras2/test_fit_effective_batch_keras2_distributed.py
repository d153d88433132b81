"""Keras 2: `GradientAccumulator(inner, micro_batch_size=b)` under MirroredStrategy (2 logical
CPUs) and MultiWorkerMirroredStrategy (2 processes on 127.0.0.1). The micro-batch is global, as
`fit`'s batch is; the samples' weighting is global (each replica's weighted sums and weights
all-reduced once), and the inner optimizer applies the large batch's gradient once, its own
aggregation skipped. Exact against Keras 2's own `fit(batch_size=E)` on ONE device, also where
the replicas get uneven shares of the last batch; the logged loss is one device's.
"""

import functools
import json

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import flavours
from tests import deltas
from tests.accumulator.multiworker import run_cluster

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")

TOLERANCE = 1e-5
DEVICES = ["/cpu:0", "/cpu:1"]
# Batches of 20, 20 and 5 (the last split 3 and 2 between the replicas); micro-batches of
# 8 (4 per replica): each replica's 10 samples as 4 + 4 + 2 (padded).
SAMPLES, E, B = 45, 20, 8


def _data(samples=SAMPLES, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, 5).astype("float32")
    y = (x @ rng.randn(5, 1) + 0.1 * rng.randn(samples, 1)).astype("float32")
    return x, y


def _mlp(regularized=False):
    k2.utils.set_random_seed(0)
    regularizer = k2.regularizers.L2(1e-2) if regularized else None
    return k2.Sequential([k2.Input((5,)), k2.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer),
                          k2.layers.Dense(1)])


def _adamw():
    return k2.optimizers.AdamW(k2.optimizers.schedules.ExponentialDecay(2e-2, 2, 0.7), weight_decay=0.05,
                               global_clipnorm=0.05)


def _adam():
    return k2.optimizers.Adam(3e-2, clipnorm=0.05)


def _micro(make_optimizer, size=B):
    return lambda: GradientAccumulator(make_optimizer(), micro_batch_size=size)


@functools.lru_cache(maxsize=None)
def _mirrored():
    """One MirroredStrategy for these tests, reducing through one device (strategies whose
    collectives share keys in one process collide)."""
    return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())


def _fit(make_model, make_optimizer, x, y, strategy=None, batch_size=E, loss="mse", epochs=2, **fit_kwargs):
    with (strategy or tf.distribute.get_strategy()).scope():
        model = make_model()
        model.compile(optimizer=make_optimizer(), loss=loss)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return model, history.history


def _gap(a, b):
    return deltas.max_abs_diff(a.get_weights(), b.get_weights())


def test_mirrored_fit_is_the_one_device_large_batch_with_uneven_replicas():
    # AdamW with a schedule, weight decay and a global clipnorm; an L2 regularizer, which
    # Keras 2 divides by the replicas in each replica's loss, as its mean losses.
    x, y = _data()
    regularized = functools.partial(_mlp, regularized=True)
    large, large_history = _fit(regularized, _adamw, x, y)
    micro, micro_history = _fit(regularized, _micro(_adamw), x, y, _mirrored())
    gap = _gap(large, micro)
    assert gap < TOLERANCE, gap
    assert int(micro.optimizer.iterations.numpy()) == 6
    # Logged as Keras 2 logs the large batch on one device.
    np.testing.assert_allclose(micro_history["loss"], large_history["loss"], rtol=1e-5)
    # The test can fail: Keras 2's own mirrored large batch clips each replica's share (and
    # weighs the uneven last batch's replicas alike), far beyond the tolerance.
    mirrored_keras, _ = _fit(regularized, _adamw, x, y, _mirrored())
    assert _gap(large, mirrored_keras) > 100 * TOLERANCE


def test_mirrored_sample_weights_and_a_summed_loss():
    x, y = _data()
    weights = np.random.RandomState(1).uniform(0.0, 2.0, SAMPLES).astype("float32")
    large, large_history = _fit(_mlp, _adam, x, y, sample_weight=weights, epochs=1)
    micro, micro_history = _fit(_mlp, _micro(_adam), x, y, _mirrored(), sample_weight=weights, epochs=1)
    assert _gap(large, micro) < TOLERANCE
    np.testing.assert_allclose(micro_history["loss"], large_history["loss"], rtol=1e-5)
    # A "sum" loss, which Keras 2 does not divide by the replicas: the replicas' sums add up.
    summed = k2.losses.MeanSquaredError(reduction="sum")
    sgd = lambda: k2.optimizers.SGD(1e-3)     # noqa: E731
    large, large_history = _fit(_mlp, sgd, x, y, loss=summed, sample_weight=weights, epochs=1)
    micro, micro_history = _fit(_mlp, _micro(sgd), x, y, _mirrored(), loss=summed, sample_weight=weights, epochs=1)
    assert _gap(large, micro) < TOLERANCE
    np.testing.assert_allclose(micro_history["loss"], large_history["loss"], rtol=1e-5)


def test_mirrored_lookups_per_token_and_once_per_batch():
    # An Embedding's rows gathered in replica order (the large batch's rows, which Keras 2's
    # optimizers merge); a position table's rows summed over the micro-batches and the
    # replicas, as the large batch has them once. Adam's clipnorm sees every row.
    from tests.keras2.test_fit_effective_batch_keras2 import _embedding_model, _text_model, _tokens

    x, y = _tokens(50)
    for make_model in (_embedding_model, _text_model):
        large, _ = _fit(make_model, _adam, x, y, batch_size=24, epochs=1)
        micro, _ = _fit(make_model, _micro(_adam, 6), x, y, _mirrored(), batch_size=24, epochs=1)
        assert _gap(large, micro) < TOLERANCE, make_model.__name__


def test_mirrored_two_outputs_log_their_losses_as_one_device():
    # Each output's loss metric (`a_loss`, `b_loss`) counts each micro-batch's real rows.
    from tests.keras2.test_fit_effective_batch_keras2 import _two_outputs

    x, y = _data()
    targets = [y, np.random.RandomState(3).randn(SAMPLES, 3).astype("float32")]
    sgd = lambda: k2.optimizers.SGD(5e-2, momentum=0.9)     # noqa: E731
    large, large_history = _fit(_two_outputs, sgd, x, targets, loss=["mse", "mae"], epochs=1)
    micro, micro_history = _fit(_two_outputs, _micro(sgd), x, targets, _mirrored(), loss=["mse", "mae"], epochs=1)
    assert _gap(large, micro) < TOLERANCE
    assert set(micro_history) == {"loss", "a_loss", "b_loss"}
    for name in micro_history:
        np.testing.assert_allclose(micro_history[name], large_history[name], rtol=1e-5, err_msg=name)


def test_a_micro_batch_the_replicas_cannot_share_is_refused_before_training():
    x, y = _data(8)
    with _mirrored().scope():
        model = _mlp()
        model.compile(GradientAccumulator(k2.optimizers.Adam(), micro_batch_size=7), "mse")
    before = model.get_weights()
    with pytest.raises(ValueError, match=r"micro_batch_size=7 is not divisible by the 2 replicas.*for example 6"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert deltas.max_abs_diff(before, model.get_weights()) == 0.0
    # XLA under several replicas: Keras 2's own large batch fails there too.
    with _mirrored().scope():
        model = _mlp()
        model.compile(GradientAccumulator(k2.optimizers.Adam(), micro_batch_size=4), "mse", jit_compile=True)
    with pytest.raises(NotImplementedError, match="jit_compile=False"):
        model.fit(x, y, batch_size=8, verbose=0)


def test_two_workers_train_the_one_device_large_batch(tmp_path):
    # 2 processes: 3 batches of 64 and one of 18 (9 a worker), micro-batches of 16 (8 a worker).
    from tests.keras2.fit_effective_batch_keras2_worker import optimizer

    samples, batch, micro = 210, 64, 16
    codes, output, result = run_cluster(tmp_path / "out", "--samples", samples, "--batch", batch, "--micro", micro,
                                        module="tests.keras2.fit_effective_batch_keras2_worker", timeout=180)
    assert codes == [0, 0], output[-3000:]
    weights, iterations = result
    assert iterations == 4
    x, y = _data(samples)
    large, history = _fit(_mlp, lambda: optimizer(k2), x, y, batch_size=batch, epochs=1)
    assert deltas.max_abs_diff(weights, large.get_weights()) < TOLERANCE
    logged = json.loads(str(np.load(f"{tmp_path / 'out'}.0.npz")["loss"]))
    np.testing.assert_allclose(logged, history["loss"], rtol=1e-5)
