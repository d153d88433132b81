"""AccumBatchNormalization: moving statistics of the effective batch."""

import numpy as np
import keras
import pytest

from tfx_gradient_accumulator.accumulator import AccumBatchNormalization, GradientAccumulator, use_accumulated_batch_norm
from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile

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


def _large_batch_moving(x, y, batch_sizes, momentum=0.8):
    """Stock BN on one device, one epoch per entry of `batch_sizes`."""
    big = _model(keras.layers.BatchNormalization(momentum=momentum))
    big.compile(keras.optimizers.SGD(0.01), "mse")
    for batch_size in batch_sizes:
        big.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return _moving(big)


def test_fit_ties_unconfigured_layers_to_the_optimizer_and_closes_them_at_epoch_ends():
    x, y = _data(MICRO * 10)   # windows of 4, 4 and 2 every epoch
    expected = _large_batch_moving(x, y, [MICRO * ACCUM] * 2)
    model = _model(AccumBatchNormalization(momentum=0.8))     # no accum_steps given
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.01), ACCUM), "mse")
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert model.layers[0].accum_steps == ACCUM
    assert int(model.layers[0]._window_calls.numpy()) == 0
    for ours, reference in zip(_moving(model), expected):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)


def test_layers_follow_an_accumulation_schedule():
    from tfx_gradient_accumulator.accumulator.schedules.callbacks import AccumulationSchedule
    x, y = _data(MICRO * 8)
    expected = _large_batch_moving(x, y, [MICRO * 2, MICRO * 4])
    model = _model(AccumBatchNormalization(momentum=0.8))
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.01), 2, schedulable=True), "mse")
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
              callbacks=[AccumulationSchedule({0: 2, 1: 4})])
    assert model.layers[0].accum_steps == 4
    for ours, reference in zip(_moving(model), expected):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("synchronized", [False, True])
def test_statistics_are_pooled_over_replicas_like_one_device(synchronized):
    import tensorflow as tf
    # 195 samples in global micro-batches of 16 (8 per replica): 12 full ones
    # and a last one of 3, split 2 and 1 over the replicas; windows of 4.
    x, y = _data(195)
    expected = _large_batch_moving(x, y, [16 * ACCUM])
    # Not the CPU default (collective ops): TensorFlow gives every
    # MirroredStrategy the same collective keys, so a second strategy in one
    # process clashes with the first's ops (stock Keras included).
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    results = {}
    for name, layer, optimizer in [
        ("ours", AccumBatchNormalization(momentum=0.8, synchronized=synchronized),
         lambda: GradientAccumulator(keras.optimizers.SGD(0.01), ACCUM)),
        ("stock", keras.layers.BatchNormalization(momentum=0.8, synchronized=synchronized),
         lambda: keras.optimizers.SGD(0.01)),
    ]:
        with strategy.scope():
            model = _model(layer)
            model.compile(optimizer(), "mse")
        model.fit(x, y, batch_size=16 if name == "ours" else 16 * ACCUM, shuffle=False, verbose=0)
        results[name] = _moving(model)
    for ours, reference in zip(results["ours"], expected):
        np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5)
    if not synchronized:
        # Stock Keras keeps one replica's statistics.
        assert max(np.max(np.abs(s - r)) for s, r in zip(results["stock"], expected)) > 1e-2


def test_the_optimizer_does_not_checkpoint_the_layers_it_closes(tmp_path):
    import tensorflow as tf
    x, y = _data(MICRO * 4)
    model = _model(AccumBatchNormalization())
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.01), ACCUM), "mse")
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    path = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))
    fresh = GradientAccumulator(keras.optimizers.SGD(0.01), ACCUM)
    fresh.build(model.trainable_variables)
    tf.train.Checkpoint(optimizer=fresh).restore(path).assert_consumed()
