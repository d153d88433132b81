"""AccumBatchNormalization: moving statistics of the effective batch."""

import numpy as np
import keras
import pytest

from accumulator import AccumBatchNormalization, GradientAccumulator, use_accumulated_batch_norm
from accumulator.autowrap import accumulating_compile

MICRO, ACCUM = 8, 4


def _data(samples=128, seed=0):
    rng = np.random.RandomState(seed)
    # Channels with different means and spreads; rows drift so micro-batch means differ.
    x = (rng.randn(samples, 3) * [1.0, 3.0, 0.5] + [2.0, -1.0, 10.0]
         + np.linspace(0, 4, samples)[:, None]).astype("float32")
    y = rng.randn(samples, 1).astype("float32")
    return x, y


def _model(norm):
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((3,)), norm, keras.layers.Dense(1)])


def _moving(model):
    layer = model.layers[0]
    return layer.moving_mean.numpy(), layer.moving_variance.numpy()


def test_moving_statistics_match_the_large_batch():
    x, y = _data()
    big = _model(keras.layers.BatchNormalization(momentum=0.8))
    big.compile(keras.optimizers.SGD(0.01), "mse")
    big.fit(x, y, batch_size=MICRO * ACCUM, shuffle=False, verbose=0)

    acc = _model(AccumBatchNormalization(momentum=0.8, accum_steps=ACCUM))
    acc.compile(GradientAccumulator(keras.optimizers.SGD(0.01), ACCUM), "mse")
    acc.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)

    plain = _model(keras.layers.BatchNormalization(momentum=0.8))
    plain.compile(GradientAccumulator(keras.optimizers.SGD(0.01), ACCUM), "mse")
    plain.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)

    for ours, expected, stock in zip(_moving(acc), _moving(big), _moving(plain)):
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)
        # The stock layer, updated per micro-batch, is visibly elsewhere.
        assert np.max(np.abs(stock - expected)) > 100 * max(np.max(np.abs(ours - expected)), 1e-6)


def test_compile_under_accumulation_sets_accum_steps_and_partial_window_closes_it():
    x, y = _data(MICRO * 6)      # 6 micro-batches: one window of 4, then 2 applied at the end
    big = _model(keras.layers.BatchNormalization(momentum=0.8))
    big.compile(keras.optimizers.SGD(0.01), "mse")
    big.fit(x, y, batch_size=MICRO * ACCUM, shuffle=False, verbose=0)

    acc = _model(AccumBatchNormalization(momentum=0.8))
    with accumulating_compile(ACCUM):
        acc.compile(keras.optimizers.SGD(0.01), "mse")
    assert acc.layers[0].accum_steps == ACCUM
    acc.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    for ours, expected in zip(_moving(acc), _moving(big)):
        np.testing.assert_allclose(ours, expected, rtol=1e-5, atol=1e-5)


def test_saves_and_loads_like_the_keras_layer(tmp_path):
    x, y = _data()
    model = _model(AccumBatchNormalization(momentum=0.9, accum_steps=ACCUM))
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.01), ACCUM, partial_window="carry"), "mse")
    model.fit(x[:MICRO * 6], y[:MICRO * 6], batch_size=MICRO, shuffle=False, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    layer = loaded.layers[0]
    assert isinstance(layer, AccumBatchNormalization) and layer.accum_steps == ACCUM
    assert int(layer._window_calls.numpy()) == 2
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6)


def test_swapping_a_pretrained_models_layers_keeps_its_weights():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((3,))
    h = keras.layers.Dense(5)(inputs)
    h = keras.layers.BatchNormalization()(h)
    outputs = keras.layers.Dense(1)(keras.layers.BatchNormalization(center=False)(h))
    pretrained = keras.Model(inputs, outputs)
    pretrained.compile("sgd", "mse")
    x, y = _data()
    pretrained.fit(x, y, batch_size=16, verbose=0)     # moving statistics away from 0/1

    swapped = use_accumulated_batch_norm(pretrained, ACCUM)
    norms = [l for l in swapped.layers if "normalization" in l.name]
    assert len(norms) == 2 and all(isinstance(l, AccumBatchNormalization) for l in norms)
    assert all(l.accum_steps == ACCUM for l in norms)
    np.testing.assert_allclose(swapped.predict(x, verbose=0), pretrained.predict(x, verbose=0), atol=1e-6)


def test_bad_arguments():
    with pytest.raises(ValueError, match="accum_steps"):
        AccumBatchNormalization(accum_steps=0)
    with pytest.raises(ValueError, match="renorm"):
        AccumBatchNormalization(renorm=True)
