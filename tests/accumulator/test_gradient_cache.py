"""GradientCache: losses that couple the batch train exactly like Keras' own large batch.

Reference: the same model (same class, same initial weights) trained by Keras'
own `fit` at the large batch. Controls show that plain accumulation of
micro-batch gradients (each micro-batch its own negatives) lands elsewhere, so
the comparisons can fail.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, GradientCache
from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile
from tests.accumulator import contrastive_models as cm
from tests.accumulator import reference as ref

BATCH, N = 64, 4
TOLERANCE = 1e-5


def _large_batch(name, optimizer, data, batch=BATCH, epochs=2, **kwargs):
    model = cm.built(name, **kwargs)
    model.compile(optimizer=optimizer)
    model.fit(data, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return model


def _cached(name, optimizer, data, batch=BATCH, accum_steps=N, epochs=2, **kwargs):
    inner = cm.built(name, **kwargs)
    model = GradientCache(inner, accum_steps)
    model.compile(optimizer=optimizer)
    history = model.fit(data, batch_size=batch, epochs=epochs, shuffle=False, verbose=0)
    return inner, history


@functools.lru_cache(maxsize=None)
def _adam_runs(name):
    """(Keras' large batch, GradientCache's inner model) of `name` on its data with Adam(1e-2),
    2 epochs at the defaults: the same two runs for several tests here, made once (read only)."""
    data = cm.MODELS[name][1]()
    return (_large_batch(name, keras.optimizers.Adam(1e-2), data),
            _cached(name, keras.optimizers.Adam(1e-2), data)[0])


def _moved(name, trained, **kwargs):
    return ref.max_abs_diff(trained.get_weights(), cm.built(name, **kwargs).get_weights())


@pytest.mark.parametrize("name", sorted(cm.MODELS))
def test_matches_keras_large_batch_and_plain_accumulation_does_not(name):
    data = cm.MODELS[name][1]()
    expected, inner = _adam_runs(name)
    assert ref.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    # Control: micro-batches of 16 with their own 15 negatives each.
    plain = cm.built(name)
    plain.compile(optimizer=GradientAccumulator(keras.optimizers.Adam(1e-2), N))
    plain.fit(data, batch_size=BATCH // N, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(plain.get_weights(), expected.get_weights()) > 100 * TOLERANCE
    assert _moved(name, expected) > 1e-2


def test_the_learned_temperature_trains_as_in_the_large_batch():
    expected, inner = _adam_runs("clip")
    assert abs(float(inner.logit_scale.numpy()) - float(expected.logit_scale.numpy())) <= TOLERANCE
    assert abs(float(expected.logit_scale.numpy()) - float(np.log(1 / 0.07))) > 1e-3


def test_schedules_clipping_and_weight_decay_act_on_the_large_batch_gradient():
    data = cm.pairs()

    def optimizer():
        schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.5)
        return keras.optimizers.AdamW(schedule, weight_decay=0.1, global_clipnorm=0.5)

    expected = _large_batch("clip", optimizer(), data)
    inner, _ = _cached("clip", optimizer(), data)
    assert ref.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE


def test_uneven_last_batch_and_weight_regularizers_are_exact():
    # 250 samples: the last batch of 58 is cut 15, 15, 15, 13; an L2 kernel
    # regularizer's gradient comes from the loss, once per batch.
    data = {k: v[:250] for k, v in cm.views().items()}
    expected = _large_batch("simclr", keras.optimizers.Adam(1e-2), data, regularizer=keras.regularizers.L2(1e-2))
    inner, history = _cached("simclr", keras.optimizers.Adam(1e-2), data, regularizer=keras.regularizers.L2(1e-2))
    assert ref.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    expected_history = expected.history.history["loss"]
    np.testing.assert_allclose(history.history["loss"], expected_history, rtol=1e-5)


def test_more_micro_batches_than_samples_in_a_batch_is_still_exact():
    data = {k: v[:70] for k, v in cm.interactions().items()}      # last batch: 6 samples, 8 micro-batches
    expected = _large_batch("two_tower", keras.optimizers.SGD(0.5), data)
    inner, _ = _cached("two_tower", keras.optimizers.SGD(0.5), data, accum_steps=8)
    assert ref.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE


def test_mixed_float16_matches_the_large_batch_within_float16_rounding():
    data = cm.views()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        expected = _large_batch("simclr", keras.optimizers.Adam(1e-2), data)
        inner, _ = _cached("simclr", keras.optimizers.Adam(1e-2), data)
        plain = cm.built("simclr")
        plain.compile(optimizer=GradientAccumulator(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.Adam(1e-2)), N), auto_scale_loss=False)
        plain.fit(data, batch_size=BATCH // N, epochs=2, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    cached_off = ref.max_abs_diff(inner.get_weights(), expected.get_weights())
    assert cached_off <= 2e-3
    assert ref.max_abs_diff(plain.get_weights(), expected.get_weights()) > 5 * cached_off


def test_mirrored_replicas_see_the_negatives_of_keras_large_batch_under_the_same_strategy():
    data = cm.interactions()
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        expected = _large_batch("two_tower", keras.optimizers.Adam(1e-2), data)
    with strategy.scope():
        inner, _ = _cached("two_tower", keras.optimizers.Adam(1e-2), data)
    assert ref.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    # The same run on one device has each replica's 32 samples as one batch of 64: other negatives.
    one_device = _large_batch("two_tower", keras.optimizers.Adam(1e-2), data)
    assert ref.max_abs_diff(one_device.get_weights(), expected.get_weights()) > 100 * TOLERANCE


def test_saved_between_steps_and_resumed_trains_as_one_run(tmp_path):
    data = cm.interactions()
    whole = _adam_runs("two_tower")[1]
    inner = cm.built("two_tower")
    model = GradientCache(inner, N)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.fit(data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "cached.keras")
    restored = keras.models.load_model(tmp_path / "cached.keras", custom_objects={"TwoTower": cm.TwoTower})
    assert isinstance(restored, GradientCache) and restored.accum_steps == N
    restored.fit(data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert ref.max_abs_diff(restored.model.get_weights(), whole.get_weights()) <= TOLERANCE
    assert ref.max_abs_diff(inner.get_weights(), whole.get_weights()) > 1e-3     # one epoch short


# Apart (6 s): test_uneven_last_batch_and_weight_regularizers_are_exact compares the logged loss too.
@pytest.mark.apart
def test_the_logged_loss_is_the_large_batch_loss():
    data = cm.interactions()
    expected = _large_batch("two_tower", keras.optimizers.SGD(0.5), data)
    _, history = _cached("two_tower", keras.optimizers.SGD(0.5), data)
    np.testing.assert_allclose(history.history["loss"], expected.history.history["loss"], rtol=1e-6)


def test_batch_normalization_is_refused_before_training():
    inner = keras.Sequential([keras.Input((cm.FEATURES,)), keras.layers.Dense(4), keras.layers.BatchNormalization()])
    model = GradientCache(inner, 2)
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    before = inner.get_weights()
    with pytest.raises(ValueError, match="BatchNormalization.*LayerNormalization"):
        model.fit(np.ones((8, cm.FEATURES), "float32"), np.ones((8, 4), "float32"), batch_size=8, verbose=0)
    assert ref.max_abs_diff(inner.get_weights(), before) == 0.0


def test_losses_added_while_running_are_refused():
    inner = keras.Sequential([keras.Input((cm.FEATURES,)),
                              keras.layers.Dense(4, activity_regularizer=keras.regularizers.L2(0.1))])
    model = GradientCache(inner, 2)
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    with pytest.raises(ValueError, match="adds losses while it runs"):
        model.fit(np.ones((8, cm.FEATURES), "float32"), np.ones((8, 4), "float32"), batch_size=8, verbose=0)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4", None])
def test_bad_accum_steps_is_refused_at_construction(bad):
    with pytest.raises((TypeError, ValueError), match="`accum_steps` must be a positive integer"):
        GradientCache(cm.built("two_tower"), bad)


def test_a_model_that_is_not_a_keras_3_model_is_refused():
    with pytest.raises(TypeError, match="Keras 3"):
        GradientCache(lambda x: x, 2)


# ------------------------------------ accumulating_compile(gradient_cache=True): what the Trainer uses

def test_accumulating_compile_sets_the_accum_steps_and_keeps_the_plain_optimizer():
    data = cm.interactions()
    expected = _adam_runs("two_tower")[0]
    before = keras.Model.compile
    inner = cm.built("two_tower")
    model = GradientCache(inner, accum_steps=1)
    with accumulating_compile(N, gradient_cache=True) as made:
        model.compile(optimizer=keras.optimizers.Adam(1e-2))
    assert keras.Model.compile is before
    assert model.accum_steps == N and type(model.optimizer) is keras.optimizers.Adam
    assert made == [model.optimizer]
    model.fit(data, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE


def test_accumulating_compile_refuses_what_would_accumulate_twice_or_not_at_all():
    with pytest.raises(ValueError, match="must wrap its model in accumulator.GradientCache.*it compiled a TwoTower"):
        with accumulating_compile(N, gradient_cache=True):
            cm.built("two_tower").compile(optimizer="adam")
    with pytest.raises(ValueError, match="without gradient_cache=True.*accumulated twice"):
        with accumulating_compile(N):
            GradientCache(cm.built("two_tower"), 2).compile(optimizer="adam")
    with pytest.raises(ValueError, match="compiled with a GradientAccumulator.*plain optimizer"):
        with accumulating_compile(N, gradient_cache=True):
            GradientCache(cm.built("two_tower"), 2).compile(
                optimizer=GradientAccumulator(keras.optimizers.Adam(), 2))
    for options in ({"schedule": {0: 2}}, {"partial_window": "carry"}, {"measure_noise_scale": True},
                    {"merge_duplicate_rows": True}):
        with pytest.raises(ValueError, match=f"does not support {next(iter(options))}"):
            with accumulating_compile(N, gradient_cache=True, **options):
                pass


def test_dropout_draws_the_same_masks_in_both_passes():
    # With one micro-batch the cached step sees the large batch's own masks only if
    # pass 3 replays pass 1's seeds; without the rewind it would draw new ones.
    def dropout_model():
        keras.utils.set_random_seed(3)
        inputs = keras.Input((cm.FEATURES,))
        outputs = keras.layers.Dense(8)(keras.layers.Dropout(0.3)(keras.layers.Dense(16, activation="relu")(inputs)))
        return keras.Model(inputs, outputs)

    class Wrapped(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.inner = dropout_model()

        def call(self, inputs, training=None):
            return self.inner(inputs, training=training)

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return cm.contrastive.nt_xent(y_pred[::2], y_pred[1::2])

    x = cm.views()["first"][:128]
    expected = Wrapped()
    expected.compile(optimizer=keras.optimizers.SGD(0.5))
    expected.fit(x, batch_size=32, epochs=1, shuffle=False, verbose=0)
    inner = Wrapped()
    model = GradientCache(inner, 1)
    model.compile(optimizer=keras.optimizers.SGD(0.5))
    model.fit(x, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert ref.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    assert ref.max_abs_diff(expected.get_weights(), Wrapped().get_weights()) > 1e-3
