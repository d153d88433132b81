"""XLA-compiled steps (`jit_compile=True`) train like the large batch, on one device.

On a GPU, Keras' default `jit_compile="auto"` compiles `fit`'s step with XLA;
on CPU it stays off, so without these tests the default path of a GPU user
would be a path no test takes. XLA compiles the same ops on CPU, so each case
here runs both sides compiled: the accumulator's `fit` (or custom step) and
the independent reference (the large-batch `fit`, or the seeds' tape loop).
The tolerance is the same 1e-6 as without XLA (measured with TensorFlow 2.21:
max |Δw| 0.6–1.3e-7 over the four optimizers); 1e-5 for uneven batches, where
Adam divides small gradients by their small moments (measured 2.1e-6 with
TensorFlow 2.21, below 1e-6 with 2.16). Both are far below what skipping or
mis-weighting a micro-batch costs (asserted where it is not obvious).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref
from tests.accumulator.test_exactness import ACCUM, MICRO_BATCH, OPTIMIZERS, UPDATES

TOLERANCE = 1e-6


def _fit(optimizer, x, y, batch_size, epochs=1, **compile_kwargs):
    model = ref.mlp()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=True, **compile_kwargs)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


@pytest.fixture(scope="module")
def data():
    return ref.regression_data(MICRO_BATCH * ACCUM * UPDATES)


# Apart (RMSprop, about 10 s): the window's compiled path is the same for every optimizer (Adam, AdamW and
# SGD with Nesterov run here); RMSprop's clipvalue and schedule run in test_exactness.
@pytest.mark.parametrize("name", [pytest.param(name, marks=[pytest.mark.apart] * (name == "rmsprop"))
                                  for name in sorted(OPTIMIZERS)])
def test_compiled_fit_matches_the_compiled_large_batch(name, data):
    x, y = data
    expected = _fit(OPTIMIZERS[name](), x, y, MICRO_BATCH * ACCUM)
    optimizer = GradientAccumulator(OPTIMIZERS[name](), accum_steps=ACCUM)
    model = _fit(optimizer, x, y, MICRO_BATCH)

    assert model.jit_compile is True
    assert int(optimizer.iterations.numpy()) == UPDATES
    assert int(optimizer.micro_step.numpy()) == 0
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= TOLERANCE


def test_uneven_batches_and_the_partial_window_under_xla():
    # 83 samples in micro-batches of 8: 10 full and one of 3; windows of 4, 4 and 3
    # micro-batches (35 samples), over two epochs. Each window weighs its samples.
    x, y = ref.regression_data(83)
    adam = lambda: keras.optimizers.Adam(1e-2, clipnorm=0.3)
    expected = _fit(adam(), x, y, MICRO_BATCH * ACCUM, epochs=2)
    optimizer = GradientAccumulator(adam(), ACCUM)
    model = _fit(optimizer, x, y, MICRO_BATCH, epochs=2)
    unweighted = ref.tape_accumulation_loop(
        ref.mlp(), adam(), np.concatenate([x, x]), np.concatenate([y, y]), MICRO_BATCH, ACCUM,
        keras.losses.MeanSquaredError())

    assert int(optimizer.iterations.numpy()) == 6
    diff = ref.max_abs_diff(model.get_weights(), expected.get_weights())
    assert diff <= 10 * TOLERANCE
    assert ref.max_abs_diff(unweighted.get_weights(), expected.get_weights()) > 100 * 10 * TOLERANCE


def test_compiled_custom_step_matches_the_tape_loop(data):
    x, y = data
    loss_fn = keras.losses.MeanSquaredError()
    expected = ref.tape_accumulation_loop(ref.mlp(), OPTIMIZERS["adamw"](), x, y, MICRO_BATCH, ACCUM, loss_fn)
    model = ref.mlp()
    optimizer = GradientAccumulator(OPTIMIZERS["adamw"](), accum_steps=ACCUM)

    @tf.function(jit_compile=True)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for start in range(0, len(x), MICRO_BATCH):
        step(x[start:start + MICRO_BATCH], y[start:start + MICRO_BATCH])

    assert int(optimizer.iterations.numpy()) == UPDATES
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= TOLERANCE


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_under_xla_follows_the_large_batch(policy):
    keras.mixed_precision.set_global_policy(policy)
    try:
        x, y = ref.regression_data(8 * 4 * 16)
        sgd = lambda: keras.optimizers.SGD(0.2, momentum=0.9)
        expected = _fit(sgd(), x, y, 32)     # compile adds a LossScaleOptimizer for float16
        if policy == "mixed_float16":
            # The README's recipe: the loss scaling inside, one scale per window.
            accumulated = _fit(GradientAccumulator(keras.optimizers.LossScaleOptimizer(sgd()), 4),
                               x, y, 8, auto_scale_loss=False)
        else:
            accumulated = _fit(GradientAccumulator(sgd(), 4), x, y, 8)
        unaccumulated = _fit(sgd(), x, y, 8)
        compute_dtype = accumulated.layers[0].compute_dtype
    finally:
        keras.mixed_precision.set_global_policy("float32")

    assert compute_dtype == policy.split("_")[1]
    assert int(accumulated.optimizer.iterations.numpy()) == 16
    # Half-precision sums over 8 rather than 32 rows round differently (bfloat16
    # keeps 8 bits of mantissa); skipping accumulation lands much further away.
    diff = ref.max_abs_diff(accumulated.get_weights(), expected.get_weights())
    assert diff <= (2e-2 if policy == "mixed_bfloat16" else 3e-3)
    assert ref.max_abs_diff(unaccumulated.get_weights(), expected.get_weights()) > 10 * diff


def test_non_finite_window_is_skipped_whole_in_a_compiled_step():
    variable = keras.Variable(np.array([1.0, 2.0], "float32"))
    lso = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=16.0)
    optimizer = GradientAccumulator(lso, accum_steps=2)
    optimizer.build([variable])

    @tf.function(jit_compile=True)
    def step(values):
        optimizer.apply([optimizer.scale_loss(values)], [variable])

    step(tf.constant([0.5, 0.5]))
    step(tf.constant([np.inf, 1.0]))
    # The first micro-batch was finite, yet nothing of the window is applied.
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    assert float(lso.dynamic_scale.numpy()) == 8.0
    assert int(optimizer.iterations.numpy()) == 0
    assert not np.any(optimizer.accumulators[0].numpy())

    step(tf.constant([0.25, -0.5]))
    step(tf.constant([0.75, 0.5]))
    np.testing.assert_allclose(variable.numpy(), [0.5, 2.0])
    assert int(optimizer.iterations.numpy()) == 1


def test_noise_scale_under_xla_equals_the_uncompiled_estimate(data):
    x, y = data

    def estimate(jit_compile):
        model = ref.mlp()
        optimizer = GradientAccumulator(keras.optimizers.SGD(0.05), ACCUM, measure_noise_scale=True)
        model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
        return optimizer.noise_scale

    compiled, uncompiled = estimate(True), estimate(False)
    assert np.isfinite(compiled) and compiled > 0
    assert compiled == pytest.approx(uncompiled, rel=1e-4)
