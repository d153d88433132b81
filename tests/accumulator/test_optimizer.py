"""What the wrapper does not change reaches the inner optimizer; set-ups that would train wrong are refused."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref


def test_exclude_from_weight_decay_reaches_the_inner_optimizer():
    excluded = keras.Variable(np.array([2.0], "float32"))
    decayed = keras.Variable(np.array([2.0], "float32"))
    optimizer = GradientAccumulator(keras.optimizers.AdamW(0.1, weight_decay=0.04), 2)
    optimizer.exclude_from_weight_decay(var_list=[excluded])
    zero = [tf.zeros(1), tf.zeros(1)]
    for _ in range(2):
        optimizer.apply(zero, [excluded, decayed])
    assert int(optimizer.iterations.numpy()) == 1
    assert float(excluded.numpy()[0]) == 2.0
    assert float(decayed.numpy()[0]) == pytest.approx(2.0 * (1 - 0.1 * 0.04))


def test_exclude_from_weight_decay_by_name_through_a_loss_scale_optimizer():
    bias = keras.Variable(np.array([2.0], "float32"), name="bias")
    optimizer = GradientAccumulator(
        keras.optimizers.LossScaleOptimizer(keras.optimizers.AdamW(0.1, weight_decay=0.04)), 2)
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    for _ in range(2):
        optimizer.apply([tf.zeros(1)], [bias])
    assert float(bias.numpy()[0]) == 2.0


def _trained_adam_wrapper():
    variable = keras.Variable(np.array([1.0, -1.0], "float32"))
    optimizer = GradientAccumulator(keras.optimizers.Adam(0.1), 2)
    for g in ([0.5, 1.0], [0.1, -0.2], [0.3, 0.3]):   # one update, one open micro-step
        optimizer.apply([tf.constant(g)], [variable])
    return variable, optimizer


def test_set_weights_sets_the_inner_optimizers_state_too():
    variable, trained = _trained_adam_wrapper()
    fresh = GradientAccumulator(keras.optimizers.Adam(0.1), 2)
    fresh.build([variable])
    fresh.set_weights(trained.get_weights())
    assert int(fresh.iterations.numpy()) == 1
    assert int(fresh.micro_step.numpy()) == 1
    for a, b in zip(fresh.variables, trained.variables):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(ValueError, match="must hold"):
        fresh.set_weights(trained.get_weights()[:-1])


@pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"), reason="Keras without MultiOptimizer")
@pytest.mark.parametrize("make_callback, final_rate", [
    (lambda: keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.05 / (epoch + 1)), 0.05 / 3),
    # The first epoch sets the best loss; min_delta makes every later one a plateau.
    (lambda: keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0, min_delta=1e9), 0.025),
], ids=["LearningRateScheduler", "ReduceLROnPlateau"])
def test_learning_rate_callbacks_reach_a_wrapped_multi_optimizer(make_callback, final_rate):
    x, y = ref.regression_data(64)
    model = ref.mlp()
    sgd, adam = keras.optimizers.SGD(0.1), keras.optimizers.Adam(0.1)
    multi = keras.optimizers.MultiOptimizer(lambda v: adam if v.path.endswith("bias") else sgd)
    model.compile(GradientAccumulator(multi, 2), "mse")
    model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[make_callback()])
    assert int(sgd.iterations.numpy()) == int(adam.iterations.numpy()) == 6
    for inner in (sgd, adam):
        assert float(np.asarray(inner.learning_rate)) == pytest.approx(final_rate)


class WeightsAtValidation(keras.callbacks.Callback):
    def on_test_begin(self, logs=None):
        self.weights = [w.numpy() for w in self.model.trainable_weights]


def test_swap_ema_weights_works_through_a_loss_scale_optimizer():
    # The set-up `accumulating_compile` builds for mixed_float16 models.
    x, y = ref.regression_data(64)
    inner = keras.optimizers.SGD(0.1, use_ema=True, ema_momentum=0.5)
    model = ref.mlp()
    model.compile(GradientAccumulator(keras.optimizers.LossScaleOptimizer(inner), 2), "mse",
                  auto_scale_loss=False)
    seen = WeightsAtValidation()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, validation_data=(x, y),
              callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True), seen])
    assert model.optimizer.inner_optimizer is inner
    emas = [inner._model_variables_moving_average[i].numpy() for i in range(len(seen.weights))]  # noqa: SLF001
    assert ref.max_abs_diff(seen.weights, emas) == 0.0


def _float8_like_variables():
    # A scale-like variable next to an ordinary weight, as in float8 layers
    # (Keras before 3.9 refuses an update with no ordinary gradient at all).
    scale = keras.Variable(np.zeros(2, "float32"))
    scale.overwrite_with_gradient = True
    return scale, keras.Variable(np.zeros(1, "float32"))


def test_overwrite_with_gradient_variables_get_the_windows_maximum():
    # Float8 scales and amax histories: one large batch's amax is the maximum
    # over its micro-batches, as Keras' own accumulation takes.
    variable, weight = _float8_like_variables()
    optimizer = GradientAccumulator(keras.optimizers.SGD(1.0), 2)
    builtin_variable, builtin_weight = _float8_like_variables()
    builtin = keras.optimizers.SGD(1.0, gradient_accumulation_steps=2)
    for g in ([1.0, 3.0], [2.0, 1.0]):
        optimizer.apply([tf.constant(g), tf.ones(1)], [variable, weight])
        builtin.apply([tf.constant(g), tf.ones(1)], [builtin_variable, builtin_weight])
    np.testing.assert_array_equal(variable.numpy(), [2.0, 3.0])
    np.testing.assert_array_equal(builtin_variable.numpy(), variable.numpy())
    np.testing.assert_array_equal(weight.numpy(), [-1.0])      # the mean gradient, once
    optimizer.apply([tf.constant([-1.0, -2.0]), tf.ones(1)], [variable, weight])   # a new window starts empty
    optimizer.close_partial_window()
    np.testing.assert_array_equal(variable.numpy(), [-1.0, -2.0])


def test_overwrite_with_gradient_on_two_replicas_takes_the_maximum_over_both():
    strategy = tf.distribute.MirroredStrategy(cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        variable, weight = _float8_like_variables()
        optimizer = GradientAccumulator(keras.optimizers.SGD(1.0), 2)
        optimizer.build([variable, weight])

    @tf.function
    def step(values):
        def replica_step():
            replica = tf.distribute.get_replica_context().replica_id_in_sync_group
            optimizer.apply([tf.gather(values, replica), tf.ones(1)], [variable, weight])
        strategy.run(replica_step)

    step(tf.constant([[1.0, 0.0], [0.0, 5.0]]))
    step(tf.constant([[4.0, 1.0], [2.0, 2.0]]))
    np.testing.assert_array_equal(variable.numpy(), [4.0, 5.0])


def test_keras_own_gradient_accumulation_inside_is_refused():
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        GradientAccumulator(keras.optimizers.Adam(gradient_accumulation_steps=4), 2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps"):
        GradientAccumulator(keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(gradient_accumulation_steps=2)), 2)


@pytest.mark.parametrize("inner", ["lso", "plain"])
def test_compile_keeps_the_loss_scaling_inside_under_its_defaults(mixed_policy, inner):
    sgd = keras.optimizers.SGD(0.1)
    given = GradientAccumulator(keras.optimizers.LossScaleOptimizer(sgd) if inner == "lso" else sgd, 4)
    lso = given.loss_scale_optimizer
    model = ref.mlp()
    model.compile(given, "mse")             # auto_scale_loss=True: Keras would wrap it
    assert model.optimizer is given
    assert given.inner_optimizer is sgd
    assert given.loss_scale_optimizer is (lso if inner == "lso" else given.loss_scale_optimizer)
    assert isinstance(given.loss_scale_optimizer, keras.optimizers.LossScaleOptimizer)


def test_a_loss_scale_optimizer_around_the_accumulator_is_refused_before_training(mixed_policy):
    x, y = ref.regression_data(64)
    written = ref.mlp()
    written.compile(keras.optimizers.LossScaleOptimizer(GradientAccumulator(keras.optimizers.SGD(0.1), 4)), "mse")
    # Built without loss scaling, then compiled under Keras' defaults: its variables are fixed.
    built = GradientAccumulator(keras.optimizers.SGD(0.1), 4)
    built.build(ref.mlp().trainable_variables)
    rebuilt = ref.mlp()
    rebuilt.compile(built, "mse")
    for model in (written, rebuilt):
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
        before = model.get_weights()
        with pytest.raises(ValueError, match="Pass the GradientAccumulator itself to compile"):
            model.fit(x, y, batch_size=16, verbose=0)
        assert ref.max_abs_diff(model.get_weights(), before) == 0.0


def test_carry_leaves_the_remainder_open_and_says_so(caplog):
    x, y = ref.regression_data(8 * 10)
    model = ref.mlp()
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.1), 4, partial_window="carry")
    model.compile(optimizer, "mse")
    with caplog.at_level(logging.WARNING, logger="tfx_gradient_accumulator.accumulator.optimizer"):
        model.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0)
    # 30 micro-batches: floor(30 / 4) = 7 updates, 2 held, nothing dropped.
    assert int(optimizer.iterations.numpy()) == 7
    assert int(optimizer.micro_step.numpy()) == 2
    assert "2 micro-batch(es) held in an open window" in caplog.text
