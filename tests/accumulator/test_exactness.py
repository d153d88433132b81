"""The accumulator trains like the large batch it stands for.

Each case runs 32 optimizer updates with a learning-rate schedule and clipping,
and asserts the maximum absolute weight difference against an independent
reference: plain `fit` with the effective batch, and the seeds' hand-written
`GradientTape` accumulation loop.
"""

import functools

import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref

MICRO_BATCH = 8
ACCUM = 4
UPDATES = 32
TOLERANCE = 1e-6

OPTIMIZERS = {
    "sgd_nesterov": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.PiecewiseConstantDecay([8, 16], [0.1, 0.05, 0.02]),
        momentum=0.9, nesterov=True, clipnorm=0.5,
    ),
    "adam": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-2, 8, 0.5), clipnorm=0.1,
    ),
    "adamw": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.CosineDecay(1e-2, UPDATES, warmup_target=2e-2, warmup_steps=4),
        weight_decay=0.05, global_clipnorm=0.2,
    ),
    "rmsprop": lambda: keras.optimizers.RMSprop(
        keras.optimizers.schedules.InverseTimeDecay(5e-3, 8, 0.5),
        momentum=0.5, clipvalue=0.05,
    ),
}


@pytest.fixture(scope="module")
def data():
    return ref.regression_data(MICRO_BATCH * ACCUM * UPDATES)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fit_matches_large_batch_fit(name, data):
    x, y = data
    expected = ref.fit_large_batch(ref.mlp(), OPTIMIZERS[name](), x, y, MICRO_BATCH * ACCUM)

    model = ref.mlp()
    optimizer = GradientAccumulator(OPTIMIZERS[name](), accum_steps=ACCUM)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)

    assert int(optimizer.iterations.numpy()) == UPDATES
    assert int(optimizer.micro_step.numpy()) == 0
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= TOLERANCE


@functools.lru_cache(maxsize=None)
def _tape_loop(name):
    """The hand-written tape loop's model: one per optimizer, for both modes below (read only)."""
    x, y = ref.regression_data(MICRO_BATCH * ACCUM * UPDATES)
    return ref.tape_accumulation_loop(ref.mlp(), OPTIMIZERS[name](), x, y, MICRO_BATCH, ACCUM,
                                      keras.losses.MeanSquaredError())


# Eager apart but Adam's (5 s each): the eager loop is one path whatever the inner optimizer;
# every optimizer runs in the tf.function loop.
@pytest.mark.parametrize("name, mode", [
    pytest.param(name, mode, marks=[pytest.mark.apart] * (mode == "eager" and name != "adam"))
    for mode in ("tf_function", "eager") for name in sorted(OPTIMIZERS)])
def test_custom_loop_matches_tape_loop(name, mode, data):
    x, y = data
    loss_fn = keras.losses.MeanSquaredError()
    expected = _tape_loop(name)

    model = ref.mlp()
    optimizer = GradientAccumulator(OPTIMIZERS[name](), accum_steps=ACCUM)

    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    if mode == "tf_function":
        step = tf.function(step)
    for start in range(0, len(x), MICRO_BATCH):
        step(x[start:start + MICRO_BATCH], y[start:start + MICRO_BATCH])

    assert int(optimizer.iterations.numpy()) == UPDATES
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= TOLERANCE
