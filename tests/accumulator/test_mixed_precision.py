"""Mixed precision: one loss scale per window, non-finite windows skipped whole.

Under mixed_float16, `compile` with its defaults puts the loss scaling inside the
accumulator (`accumulator.hooks`): these tests compare that to the explicit
`GradientAccumulator(LossScaleOptimizer(inner))` and to Keras' own float16 large batch,
with real float16 overflows.
"""

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref


def _fit(model, optimizer, x, y, batch_size):
    model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def test_mixed_float16_fit_follows_the_large_batch(mixed_policy):
    x, y = ref.regression_data(8 * 4 * 16)
    lso = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.2, momentum=0.9))
    expected = _fit(ref.mlp(), lso(), x, y, 32)
    accumulated = _fit(ref.mlp(), GradientAccumulator(lso(), 4), x, y, 8)
    unaccumulated = _fit(ref.mlp(), lso(), x, y, 8)

    assert accumulated.layers[0].compute_dtype == "float16"
    assert int(accumulated.optimizer.iterations.numpy()) == 16
    # float16 sums over 8 rather than 32 rows round differently: ~1e-3 apart,
    # while skipping accumulation lands a hundred times further away.
    diff = ref.max_abs_diff(accumulated.get_weights(), expected.get_weights())
    assert diff <= 3e-3
    assert ref.max_abs_diff(unaccumulated.get_weights(), expected.get_weights()) > 30 * diff


def test_scale_loss_gives_each_micro_batch_its_share_of_the_inner_loss_scale():
    # The large batch's loss is the mean over the window's samples: each micro-batch's
    # float16 gradients are its share of the large batch's when scaled by S / N.
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    optimizer = GradientAccumulator(lso, 2)
    assert float(optimizer.scale_loss(tf.constant(1.5))) == 48.0
    passthrough = GradientAccumulator(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1),
                                                                          initial_scale=64.0))
    assert float(passthrough.scale_loss(tf.constant(1.5))) == 96.0


def test_window_with_non_finite_gradient_is_skipped_whole():
    variable = keras.Variable(np.array([1.0, 2.0], "float32"))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=16.0)
    optimizer = GradientAccumulator(lso, accum_steps=2)
    optimizer.build([variable])

    def scaled(values):     # a micro-batch's gradient of its loss scaled by `scale_loss`
        return [optimizer.scale_loss(tf.constant(values, "float32"))]

    optimizer.apply(scaled([0.5, 0.5]), [variable])
    optimizer.apply(scaled([np.inf, 1.0]), [variable])
    # The first micro-batch was finite, yet nothing of the window is applied.
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    assert float(lso.dynamic_scale.numpy()) == 8.0
    assert int(optimizer.iterations.numpy()) == 0
    assert int(optimizer.micro_step.numpy()) == 0
    assert not np.any(optimizer.accumulators[0].numpy())

    optimizer.apply(scaled([0.25, -0.5]), [variable])
    optimizer.apply(scaled([0.75, 0.5]), [variable])
    np.testing.assert_allclose(variable.numpy(), [0.5, 2.0])
    assert int(optimizer.iterations.numpy()) == 1


def test_nan_in_a_later_micro_batch_also_skips_the_window():
    variable = keras.Variable(np.array([3.0], "float32"))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(0.1), initial_scale=4.0)
    optimizer = GradientAccumulator(lso, accum_steps=3)
    optimizer.build([variable])
    for value in [1.0, 1.0, np.nan]:
        optimizer.apply([optimizer.scale_loss(tf.constant([value]))], [variable])
    assert variable.numpy()[0] == 3.0
    assert float(lso.dynamic_scale.numpy()) == 2.0
    assert int(lso.inner_optimizer.iterations.numpy()) == 0


# ------------------------------------------- compile's defaults (auto_scale_loss=True)
def _default_and_explicit(x, y, jit_compile=False, epochs=1):
    adam = lambda: keras.optimizers.Adam(1e-2)
    given = GradientAccumulator(adam(), 4)
    default = ref.mlp()
    default.compile(optimizer=given, loss="mse", jit_compile=jit_compile)     # Keras' defaults
    explicit = ref.mlp()
    explicit.compile(optimizer=GradientAccumulator(keras.optimizers.LossScaleOptimizer(adam()), 4),
                     loss="mse", auto_scale_loss=False, jit_compile=jit_compile)
    for model in (default, explicit):
        model.fit(x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0)
    return given, default, explicit


@pytest.mark.parametrize("jit_compile", [False, True])
def test_an_unchanged_compile_trains_as_the_explicit_loss_scaling_inside(mixed_policy, jit_compile):
    x, y = ref.regression_data(8 * 4 * 16)
    given, default, explicit = _default_and_explicit(x, y, jit_compile)

    assert default.optimizer is given                   # what the user passed, not Keras' wrapper
    assert isinstance(given.loss_scale_optimizer, keras.optimizers.LossScaleOptimizer)
    assert given.loss_scale_optimizer.inner_optimizer is given.inner_optimizer
    assert int(given.iterations.numpy()) == 16
    assert ref.max_abs_diff(default.get_weights(), explicit.get_weights()) == 0.0
    assert float(given.loss_scale_optimizer.dynamic_scale.numpy()) == \
        float(explicit.optimizer.loss_scale_optimizer.dynamic_scale.numpy())


def test_an_unchanged_compile_saves_and_loads_as_the_explicit_form(mixed_policy, tmp_path):
    x, y = ref.regression_data(8 * 4 * 8)
    given, default, _ = _default_and_explicit(x, y)
    config = given.get_config()
    assert config["optimizer"]["class_name"] == "LossScaleOptimizer"
    rebuilt = GradientAccumulator.from_config(config)
    assert isinstance(rebuilt.loss_scale_optimizer, keras.optimizers.LossScaleOptimizer)
    assert rebuilt.accum_steps == 4

    path = str(tmp_path / "model.keras")
    default.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded.optimizer, GradientAccumulator)         # not wrapped again on loading
    assert isinstance(loaded.optimizer.loss_scale_optimizer, keras.optimizers.LossScaleOptimizer)
    assert ref.max_abs_diff([v.numpy() for v in loaded.optimizer.variables],
                            [v.numpy() for v in given.variables]) == 0.0
    for model in (default, loaded):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert ref.max_abs_diff(loaded.get_weights(), default.get_weights()) == 0.0


def _one_micro_batch_overflows(samples, window, at):
    """Regression data whose micro-batch `at` has targets so large that its float16
    gradient overflows at Keras' default scale; (x, y)."""
    x, y = ref.regression_data(samples)
    y[at * 8:(at + 1) * 8] *= 1e4
    return x, y


def test_an_overflow_in_one_micro_batch_skips_its_window_as_the_large_batch_skips_its_step(mixed_policy):
    # Window 2 (micro-batches 8 to 11) holds the overflowing micro-batch 9.
    x, y = _one_micro_batch_overflows(8 * 4 * 8, 4, at=9)
    sgd = lambda: keras.optimizers.SGD(0.05, momentum=0.9)
    large = ref.mlp()
    large.compile(optimizer=sgd(), loss="mse")           # Keras' LossScaleOptimizer around SGD
    large.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    accumulated = ref.mlp()
    optimizer = GradientAccumulator(sgd(), 4)
    accumulated.compile(optimizer=optimizer, loss="mse")
    accumulated.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    # (The inner optimizer's count: Keras 3.8's LossScaleOptimizer keeps its own.)
    assert int(large.optimizer.inner_optimizer.iterations.numpy()) == 7     # 8 steps, one skipped
    assert int(optimizer.iterations.numpy()) == 7               # 8 windows, one skipped whole
    assert float(optimizer.loss_scale_optimizer.dynamic_scale.numpy()) == \
        float(large.optimizer.dynamic_scale.numpy()) == 2.0 ** 14          # halved once
    assert ref.max_abs_diff(accumulated.get_weights(), large.get_weights()) <= 3e-3


def test_the_overflowing_window_changes_nothing_and_moves_the_scale_once(mixed_policy):
    x, y = _one_micro_batch_overflows(8 * 4 * 3, 4, at=9)
    model = ref.mlp()
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.05, momentum=0.9), 4)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x[:64], y[:64], batch_size=8, shuffle=False, verbose=0)
    before = model.get_weights()
    moments = [v.numpy() for v in optimizer.inner_optimizer.variables]
    model.fit(x[64:], y[64:], batch_size=8, shuffle=False, verbose=0)   # micro-batch 9 overflows

    # Its three finite micro-batches are not applied either, and the moments stay.
    assert ref.max_abs_diff(model.get_weights(), before) == 0.0
    assert ref.max_abs_diff([v.numpy() for v in optimizer.inner_optimizer.variables], moments) == 0.0
    assert int(optimizer.iterations.numpy()) == 2
    assert int(optimizer.micro_step.numpy()) == 0
    assert float(optimizer.loss_scale_optimizer.dynamic_scale.numpy()) == 2.0 ** 14


def _first_skipped_exponent(model, start, lso, x, y, batch_size, exponents):
    """The first 2**e of `exponents` at which one step (one window) on (x, y) is skipped,
    each try from the weights `start`; None if none is."""
    for e in exponents:
        model.set_weights(start)
        lso.dynamic_scale.assign(2.0 ** e)
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
        if float(lso.dynamic_scale.numpy()) < 2.0 ** e:        # halved: the step was skipped
            return e
    return None


@pytest.mark.parametrize("target, feature", [(1e2, 1.0), (1e2, 30.0)])
def test_windows_first_overflow_at_the_large_batchs_scale(mixed_policy, target, feature):
    # Large targets overflow the per-sample float16 gradients (a micro-batch's loss at
    # the full scale would make them N times the large batch's); large features
    # overflow the weights' gradients, which the large batch sums in float16 over
    # all its samples and the window sums over micro-batches in float32.
    rng = np.random.default_rng(1)
    x = (rng.normal(size=(32, 4)) * feature).astype("float32")
    y = (rng.normal(size=(32, 1)) * target).astype("float32")
    exponents = range(4, 17)

    def tiny_model():
        keras.utils.set_random_seed(0)
        return keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])

    large, large_lso = tiny_model(), keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-3))
    start = large.get_weights()
    large.compile(optimizer=large_lso, loss="mse")
    large.fit(x[:1], y[:1], verbose=0)         # built, traced
    accumulated, optimizer = tiny_model(), GradientAccumulator(keras.optimizers.SGD(1e-3), 4)
    accumulated.compile(optimizer=optimizer, loss="mse")       # compile's defaults
    accumulated.fit(x[:8], y[:8], batch_size=8, verbose=0)

    expected = _first_skipped_exponent(large, start, large_lso, x, y, 32, exponents)
    found = _first_skipped_exponent(accumulated, start, optimizer.loss_scale_optimizer, x, y, 8, exponents)
    assert expected is not None and expected > exponents[0]
    assert found == expected


# --------------------- the explicit LossScaleOptimizer and Keras' own (Keras' own tests of it
# run through the accumulator: test_keras_loss_scale_suite.py)
def _scaled_loop(model, optimizer, x, y, batch_size, scale_loss):
    """A custom loop: each batch's mean squared error scaled by `scale_loss`, then `apply`."""
    for start in range(0, len(x), batch_size):
        with tf.GradientTape() as tape:
            prediction = model(x[start:start + batch_size], training=True)
            loss = tf.reduce_mean(keras.losses.mean_squared_error(y[start:start + batch_size], prediction))
            scaled = scale_loss(loss)
        optimizer.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)


def test_a_custom_loop_scaling_with_the_accumulators_scale_loss_follows_keras_large_batch():
    # S / N per micro-batch is what makes the window's sum carry S; the inner optimizer's S is N times off.
    x, y = ref.regression_data(8 * 4 * 4)
    lso = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 8)
    large, large_optimizer = ref.mlp(), lso()
    _scaled_loop(large, large_optimizer, x, y, 32, large_optimizer.scale_loss)
    accumulated, optimizer = ref.mlp(), GradientAccumulator(lso(), 4)
    _scaled_loop(accumulated, optimizer, x, y, 8, optimizer.scale_loss)
    at_inner_scale, wrong = ref.mlp(), GradientAccumulator(lso(), 4)
    _scaled_loop(at_inner_scale, wrong, x, y, 8, wrong.loss_scale_optimizer.scale_loss)

    assert int(optimizer.iterations.numpy()) == int(large_optimizer.inner_optimizer.iterations.numpy()) == 4
    diff = ref.max_abs_diff(accumulated.get_weights(), large.get_weights())
    assert diff <= 1e-6
    assert ref.max_abs_diff(at_inner_scale.get_weights(), large.get_weights()) > 1e3 * max(diff, 1e-7)


def test_without_a_compiled_model_a_finite_window_beyond_float16s_range_is_applied_as_keras_applies_it():
    # Nothing says which gradients were float16's: as Keras' LossScaleOptimizer, only a non-finite one skips.
    step = np.array([1.0, 6.0, 7.0, 2.0], "float32") * 2.0 ** 15        # finite, up to 229376 > 65504
    own_variable, own = keras.Variable([1.0, 2.0, 3.0, 4.0]), keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(0.5))
    own.apply([tf.constant(step)], [own_variable])
    variable = keras.Variable([1.0, 2.0, 3.0, 4.0])
    optimizer = GradientAccumulator(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.5)), 2)
    for _ in range(2):
        optimizer.apply([tf.constant(step / 2)], [variable])         # each micro-batch's share (S / 2)

    np.testing.assert_array_equal(variable.numpy(), own_variable.numpy())
    np.testing.assert_allclose(variable.numpy(), [0.5, -1.0, -0.5, 3.0])
    assert int(optimizer.iterations.numpy()) == 1
    assert float(optimizer.dynamic_scale.numpy()) == float(own.dynamic_scale.numpy()) == 2.0 ** 15


def test_a_compiled_model_checks_float16s_range_in_its_float16_layers_only(mixed_policy):
    # The large batch's float16 layers' gradients overflow past 65504; a float32 layer's are applied.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1, dtype="float32")])
    optimizer = GradientAccumulator(keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1e-9),
                                                                        initial_scale=1.0), 2)
    model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False)
    variables = model.trainable_variables
    optimizer.build(variables)

    def window(index):      # a window whose mean is 2**17 in one element of variables[index]
        grads = [np.zeros(v.shape, "float32") for v in variables]
        grads[index].flat[0] = 2.0 ** 17 / 2
        for _ in range(2):
            optimizer.apply([tf.constant(g) for g in grads], variables)

    window(2)                                                        # the float32 layer's kernel
    assert int(optimizer.iterations.numpy()) == 1 and float(optimizer.dynamic_scale.numpy()) == 1.0
    window(0)                                                        # the float16 layer's kernel
    assert int(optimizer.iterations.numpy()) == 1 and float(optimizer.dynamic_scale.numpy()) == 0.5


@pytest.mark.skipif(not hasattr(keras.optimizers, "MultiOptimizer"),
                    reason="keras.optimizers.MultiOptimizer is new in Keras 3.15")
def test_a_multi_optimizer_inside_the_loss_scaling_follows_the_large_batch(mixed_policy):
    def multi():     # Adam for the kernels, SGD for the rest
        return keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
            default_optimizer=keras.optimizers.SGD(0.2, momentum=0.9),
            optimizer_map={".*kernel.*": keras.optimizers.Adam(1e-2)}))

    x, y = ref.regression_data(8 * 4 * 8)
    large = ref.mlp()
    large.compile(optimizer=multi(), loss="mse")                     # Keras' LossScaleOptimizer around it
    large.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    accumulated, optimizer = ref.mlp(), GradientAccumulator(multi(), 4)
    accumulated.compile(optimizer=optimizer, loss="mse")             # taken inside the accumulator
    accumulated.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    explicit = ref.mlp()
    explicit.compile(optimizer=GradientAccumulator(keras.optimizers.LossScaleOptimizer(multi()), 4), loss="mse",
                     auto_scale_loss=False)
    explicit.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    unaccumulated = ref.mlp()
    unaccumulated.compile(optimizer=multi(), loss="mse")
    unaccumulated.fit(x, y, batch_size=8, shuffle=False, verbose=0)

    assert isinstance(optimizer.loss_scale_optimizer.inner_optimizer, keras.optimizers.MultiOptimizer)
    assert ref.max_abs_diff(explicit.get_weights(), accumulated.get_weights()) == 0.0
    diff = ref.max_abs_diff(accumulated.get_weights(), large.get_weights())
    assert diff <= 3e-3
    assert ref.max_abs_diff(unaccumulated.get_weights(), large.get_weights()) > 100 * diff
