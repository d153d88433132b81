"""A Keras 2 optimizer's geometry for the noise scale (`accumulator.noise.preconditioning`):
its scale P after real `apply_gradients` steps against P recomputed in NumPy from the
gradients applied, with the formula of Keras 2's own `update_step`."""

import inspect

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.noise import preconditioning as pc
from tests import second_moments

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 installed")

SHAPES = [(3, 4), (5,)]
STEPS = 3


def _gradients(seed=0, steps=STEPS):
    """`steps` lists of gradients shaped like `SHAPES`, magnitudes 0.005-0.2 and 0.05-2."""
    rng = np.random.RandomState(seed)
    return [[(rng.choice([-1, 1], s) * rng.uniform(0.05, 2.0, s) * scale).astype("float32")
             for s, scale in zip(SHAPES, (0.1, 1.0))] for _ in range(steps)]


def _applied(optimizer, divisor=1.0):
    """Fresh variables, `optimizer` applied `STEPS` times; (variables, gradients / divisor per variable)."""
    variables = [tf.Variable(np.zeros(s, "float32")) for s in SHAPES]
    grads = _gradients()
    for step in grads:
        optimizer.apply_gradients(zip([tf.constant(g) for g in step], variables))
    return variables, [[step[i] / divisor for step in grads] for i in range(len(SHAPES))]


CASES = {
    "Adam": (lambda: k2.optimizers.Adam(0.01), "adam", second_moments.adam_scale),
    "AdamW": (lambda: k2.optimizers.AdamW(0.01, beta_2=0.99), "adam", lambda g: second_moments.adam_scale(g, 0.99)),
    # Keras 2's Nadam folds g^2 into v with 1 - beta_2 in float32: a beta_2 float32 holds exactly.
    "Nadam": (lambda: k2.optimizers.Nadam(0.01, beta_2=0.99609375), "adam",
              lambda g: second_moments.adam_scale(g, 0.99609375, on_corrected=True)),
    "RMSprop": (lambda: k2.optimizers.RMSprop(0.01), "rmsprop", second_moments.rmsprop_scale),
    "Adagrad": (lambda: k2.optimizers.Adagrad(0.01), "adagrad", second_moments.adagrad_scale),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_scale_is_the_one_the_keras2_update_applies(name):
    make, kind, expected_scale = CASES[name]
    optimizer = make()
    variables, history = _applied(optimizer)
    preconditioner = pc.preconditioner_of(optimizer)
    assert preconditioner.kind == kind and preconditioner.optimizer is optimizer
    for scale, variable, steps in zip(preconditioner.scales(variables), variables, history):
        assert scale.dtype == tf.float32 and scale.shape == variable.shape
        np.testing.assert_allclose(scale.numpy(), expected_scale(steps), rtol=1e-6)
    values = np.concatenate([s.numpy().ravel() for s in preconditioner.scales(variables)])
    assert values.max() / values.min() > 5.0


def test_adaptive_epsilon_puts_epsilon_on_the_corrected_moment():
    if "adaptive_epsilon" not in inspect.signature(k2.optimizers.Adam).parameters:
        pytest.skip(f"Keras {k2.__version__}'s Adam has no adaptive_epsilon")
    optimizer = k2.optimizers.Adam(0.01, epsilon=1e-3, adaptive_epsilon=True)
    variables, history = _applied(optimizer)
    for scale, steps in zip(pc.preconditioner_of(optimizer).scales(variables), history):
        np.testing.assert_allclose(scale.numpy(), second_moments.adam_scale(steps, eps=1e-3, on_corrected=True), rtol=1e-6)
        assert not np.allclose(scale.numpy(), second_moments.adam_scale(steps, eps=1e-3), rtol=1e-3)


def test_a_keras2_loss_scale_optimizer_and_accumulator_are_unwrapped():
    inner = k2.optimizers.Adam(0.01)
    scaled = k2.mixed_precision.LossScaleOptimizer(inner, dynamic=False, initial_scale=4.0)
    variables, history = _applied(scaled)     # Keras 2: apply_gradients takes unscaled gradients
    preconditioner = pc.preconditioner_of(scaled)
    assert preconditioner.optimizer is inner
    for scale, steps in zip(preconditioner.scales(variables), history):
        np.testing.assert_allclose(scale.numpy(), second_moments.adam_scale(steps), rtol=1e-6)
    accumulating = GradientAccumulator(k2.optimizers.RMSprop(), 2)
    assert pc.preconditioner_of(accumulating).kind == "rmsprop"


def test_before_building_none_and_before_the_first_update_ones():
    optimizer = k2.optimizers.Adam()
    variables = [tf.Variable(np.zeros(s, "float32")) for s in SHAPES]
    preconditioner = pc.preconditioner_of(optimizer)
    assert preconditioner.scales(variables) == [None, None]
    optimizer.build(variables)
    assert all(np.all(s.numpy() == 1.0) for s in preconditioner.scales(variables))
    assert preconditioner.scales([tf.Variable(np.zeros(2, "float32"))]) == [None]


@pytest.mark.parametrize("name", ["SGD", "Lion", "Adafactor", "Ftrl", "legacy.Adam", "legacy.RMSprop"])
def test_keras2_optimizers_without_a_readable_second_moment_have_none(name):
    owner = k2.optimizers
    for part in name.split(".")[:-1]:
        owner = getattr(owner, part)
    if not hasattr(owner, name.split(".")[-1]):
        pytest.skip(f"Keras {k2.__version__} has no optimizers.{name}")
    assert pc.preconditioner_of(getattr(owner, name.split(".")[-1])()) is None


def test_the_keras2_scales_are_read_at_call_time_inside_a_tf_function():
    optimizer = k2.optimizers.Adam(0.01)
    variables, history = _applied(optimizer)
    preconditioner = pc.preconditioner_of(optimizer)
    read = tf.function(lambda: preconditioner.scales(variables))
    for got, steps in zip(read(), history):
        np.testing.assert_allclose(got.numpy(), second_moments.adam_scale(steps), rtol=1e-6)
    more = _gradients(5, 1)[0]
    optimizer.apply_gradients(zip([tf.constant(g) for g in more], variables))
    for got, steps, extra in zip(read(), history, more):
        np.testing.assert_allclose(got.numpy(), second_moments.adam_scale(steps + [extra]), rtol=1e-6)
