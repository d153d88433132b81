"""Mixed precision: one loss scale per window, non-finite windows skipped whole."""

import numpy as np
import keras
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


def test_scale_loss_uses_the_inner_loss_scale():
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0)
    optimizer = GradientAccumulator(lso, 2)
    assert float(optimizer.scale_loss(tf.constant(1.5))) == 96.0


def test_window_with_non_finite_gradient_is_skipped_whole():
    variable = keras.Variable(np.array([1.0, 2.0], "float32"))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=16.0)
    optimizer = GradientAccumulator(lso, accum_steps=2)
    optimizer.build([variable])

    def scaled(values):
        return [tf.constant(values, "float32") * lso.dynamic_scale]

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
        optimizer.apply([tf.constant([value * 4.0])], [variable])
    assert variable.numpy()[0] == 3.0
    assert float(lso.dynamic_scale.numpy()) == 2.0
    assert int(lso.inner_optimizer.iterations.numpy()) == 0
