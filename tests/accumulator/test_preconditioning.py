"""The optimizer's geometry for the noise scale (`accumulator.noise.preconditioning`).

* Each supported optimizer's scale P, after real `apply_gradients` steps, against P
  recomputed in NumPy from the gradients applied (not from the optimizer's variables),
  with the formula of the optimizer's own `update_step`.
* |P g|^2 of a sparse gradient equals that of the dense one it stands for.
* The preconditioned estimator recovers tr(P Sigma P) / |P G|^2 from simulated windows,
  within 4 standard errors computed from the simulation, and differs from the raw one.
* The scales are read at call time inside a `tf.function` and in each replica of a
  MirroredStrategy.
"""

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.noise import noise_scale as ns
from tfx_gradient_accumulator.accumulator.noise import preconditioning as pc
from tests import second_moments

DEVICES = ["/cpu:0", "/cpu:1"]
SHAPES = [(3, 4), (5,)]
STEPS = 3


def _gradients(seed=0, steps=STEPS):
    """`steps` lists of gradients shaped like `SHAPES`, of magnitudes between 0.005 and 0.2
    (the first variable) and between 0.05 and 2 (the second)."""
    rng = np.random.RandomState(seed)
    return [[(rng.choice([-1, 1], s) * rng.uniform(0.05, 2.0, s) * scale).astype("float32")
             for s, scale in zip(SHAPES, (0.1, 1.0))] for _ in range(steps)]


def _applied(optimizer, steps=STEPS, seed=0):
    """Fresh variables, `optimizer` applied `steps` times to `_gradients`; (variables, gradients)."""
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    grads = _gradients(seed, steps)
    for step in grads:
        optimizer.apply_gradients(zip([tf.constant(g) for g in step], variables))
    return variables, grads


CASES = {
    "Adam": (lambda: keras.optimizers.Adam(0.01), "adam", second_moments.adam_scale),
    "Adam_amsgrad": (lambda: keras.optimizers.Adam(0.01, amsgrad=True), "adam",
                     lambda g: second_moments.adam_scale(g, amsgrad=True)),
    "AdamW": (lambda: keras.optimizers.AdamW(0.01, beta_2=0.99, epsilon=1e-6), "adam",
              lambda g: second_moments.adam_scale(g, 0.99, 1e-6)),
    # Nadam folds g^2 into v with 1 - beta_2 in float32: a beta_2 float32 holds exactly.
    "Nadam": (lambda: keras.optimizers.Nadam(0.01, beta_2=0.99609375), "adam",
              lambda g: second_moments.adam_scale(g, 0.99609375, on_corrected=True)),
    "Lamb": (lambda: keras.optimizers.Lamb(0.01, epsilon=1e-6), "adam",
             lambda g: second_moments.adam_scale(g, eps=1e-6, on_corrected=True)),
    "Adamax": (lambda: keras.optimizers.Adamax(0.01), "adamax", second_moments.adamax_scale),
    "RMSprop": (lambda: keras.optimizers.RMSprop(0.01), "rmsprop", second_moments.rmsprop_scale),
    "RMSprop_centered": (lambda: keras.optimizers.RMSprop(0.01, rho=0.8, momentum=0.5, centered=True), "rmsprop",
                         lambda g: second_moments.rmsprop_scale(g, rho=0.8, centered=True)),
    "Adagrad": (lambda: keras.optimizers.Adagrad(0.01), "adagrad", second_moments.adagrad_scale),
}


def _per_step(grads):
    """`[[g of variable 0 at each step], [g of variable 1 ...]]`."""
    return [[step[i] for step in grads] for i in range(len(SHAPES))]


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_scale_is_the_one_the_optimizers_update_applies(name):
    make, kind, expected_scale = CASES[name]
    optimizer = make()
    variables, grads = _applied(optimizer)
    preconditioner = pc.preconditioner_of(optimizer)
    assert preconditioner.kind == kind and preconditioner.optimizer is optimizer
    scales = preconditioner.scales(variables)
    for scale, variable, history in zip(scales, variables, _per_step(grads)):
        assert scale.dtype == tf.float32 and scale.shape == variable.shape
        np.testing.assert_allclose(scale.numpy(), expected_scale(history), rtol=1e-6)


def test_the_scales_are_not_uniform_after_updates():
    # Else the test above could pass on a scale that is ones everywhere.
    optimizer = keras.optimizers.Adam()
    variables, _ = _applied(optimizer)
    values = np.concatenate([s.numpy().ravel() for s in pc.preconditioner_of(optimizer).scales(variables)])
    assert values.max() / values.min() > 5.0


@pytest.mark.parametrize("make", [keras.optimizers.SGD, keras.optimizers.Lion, keras.optimizers.Adafactor,
                                  keras.optimizers.Adadelta, keras.optimizers.Ftrl])
def test_optimizers_without_a_second_moment_have_no_preconditioner(make):
    assert pc.preconditioner_of(make()) is None


def test_a_loss_scale_optimizer_and_an_accumulator_are_unwrapped():
    inner = keras.optimizers.Adam(0.01)
    scaled = keras.optimizers.LossScaleOptimizer(inner, initial_scale=4.0)
    variables, grads = _applied(scaled)
    preconditioner = pc.preconditioner_of(scaled)
    assert preconditioner.optimizer is inner and preconditioner.kind == "adam"
    # The inner optimizer saw the gradients unscaled.
    unscaled = [[g / 4.0 for g in step] for step in grads]
    for scale, history in zip(preconditioner.scales(variables), _per_step(unscaled)):
        np.testing.assert_allclose(scale.numpy(), second_moments.adam_scale(history), rtol=1e-6)
    accumulating = GradientAccumulator(keras.optimizers.LossScaleOptimizer(keras.optimizers.RMSprop()), 2)
    assert pc.preconditioner_of(accumulating).optimizer is accumulating.inner_optimizer
    assert pc.preconditioner_of(accumulating).kind == "rmsprop"


def test_before_the_first_update_the_scales_are_ones_and_unbuilt_or_unknown_variables_none():
    optimizer = keras.optimizers.Adam()
    variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
    preconditioner = pc.preconditioner_of(optimizer)
    assert preconditioner.scales(variables) == [None, None]         # not built
    optimizer.build(variables)
    for scale, variable in zip(preconditioner.scales(variables), variables):
        np.testing.assert_array_equal(scale.numpy(), np.ones(variable.shape))
    stranger = keras.Variable(np.zeros(3, "float32"))
    assert preconditioner.scales([stranger, variables[1]])[0] is None


def test_min_updates_keeps_the_scales_uniform_that_long():
    optimizer = keras.optimizers.Adam()
    preconditioner = pc.preconditioner_of(optimizer, min_updates=3)
    variables, grads = _applied(optimizer, steps=2)
    assert all(np.all(s.numpy() == 1.0) for s in preconditioner.scales(variables))
    optimizer.apply_gradients(zip([tf.constant(g) for g in _gradients(1, 1)[0]], variables))
    history = _per_step(grads + _gradients(1, 1))
    for scale, steps in zip(preconditioner.scales(variables), history):
        np.testing.assert_allclose(scale.numpy(), second_moments.adam_scale(steps), rtol=1e-6)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "5"])
def test_a_bad_min_updates_is_refused(bad):
    with pytest.raises(ValueError, match="`min_updates` must be an int >= 1"):
        pc.preconditioner_of(keras.optimizers.Adam(), min_updates=bad)


def test_float16_variables_give_float32_scales():
    optimizer = keras.optimizers.Adam()
    variables = [keras.Variable(np.zeros(s, "float16"), dtype="float16") for s in SHAPES]
    grads = _gradients()
    for step in grads:
        optimizer.apply_gradients(zip([tf.constant(g, tf.float16) for g in step], variables))
    scales = pc.preconditioner_of(optimizer).scales(variables)
    for scale, history in zip(scales, _per_step(grads)):
        assert scale.dtype == tf.float32
        np.testing.assert_allclose(scale.numpy(), second_moments.adam_scale(history, eps=1e-7), rtol=2e-3)


# ------------------------------------------------------------- the squared norm
def test_a_sparse_gradient_counts_as_its_dense_sum():
    rng = np.random.RandomState(3)
    scale = tf.constant(rng.uniform(0.1, 3.0, (10, 4)), tf.float32)
    indices = tf.constant([1, 3, 1, 7, 3, 3])
    sparse = tf.IndexedSlices(tf.constant(rng.randn(6, 4), tf.float32), indices, tf.constant([10, 4]))
    dense = tf.convert_to_tensor(sparse)       # repeated rows summed
    expected = float(tf.reduce_sum(tf.square(dense * scale)))
    got = float(pc.preconditioned_squared_norm([sparse], [scale]))
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    # Squaring each slice before summing the repeats would give another number.
    per_slice = float(tf.reduce_sum(tf.square(sparse.values * tf.gather(scale, indices))))
    assert abs(per_slice - expected) > 1e-3 * expected


def test_the_squared_norm_sums_variables_and_counts_none_as_zero():
    a, b = tf.constant([[1.0, 2.0]]), tf.constant([3.0, 4.0, 5.0])
    sa, sb = tf.constant([[2.0, 0.5]]), tf.constant([1.0, 0.0, 2.0])
    assert float(pc.preconditioned_squared_norm([a, b], [sa, sb])) == pytest.approx(4 + 1 + 9 + 100)
    assert float(pc.preconditioned_squared_norm([a, None, b], [sa, sb, None])) == pytest.approx(5)
    ones = [tf.ones_like(a), tf.ones_like(b)]
    assert float(pc.preconditioned_squared_norm([a, b], ones)) == pytest.approx(float(ns.squared_norm([a, b])))
    half = tf.constant([[1.0, 2.0]], tf.float16)
    assert pc.preconditioned_squared_norm([half], [sa]).dtype == tf.float32


@pytest.mark.parametrize("grads, scales", [([tf.ones(2)], []), (tf.ones(2), [tf.ones(2)])])
def test_mismatched_gradients_and_scales_are_refused(grads, scales):
    with pytest.raises(ValueError, match="`grads` and `scales` must be lists of one length"):
        pc.preconditioned_squared_norm(grads, scales)


# ----------------------------------------------- the estimator in P's geometry
WINDOWS, SIZES, DIM = 400, (8, 16, 16, 24), 200


def _problem(rng):
    """G, a factor L of Sigma = L L^T (diagonal plus rank 3, non-isotropic), and a diagonal P
    that shrinks the noisy coordinates: the two noise scales differ by a large factor."""
    G = rng.uniform(0.5, 1.5, DIM) * np.where(np.arange(DIM) < DIM // 2, 0.1, 1.0)
    spread = np.where(np.arange(DIM) < DIM // 2, 3.0, 0.5) * rng.uniform(0.5, 1.5, DIM)
    L = np.concatenate([np.diag(spread), 0.3 * rng.randn(DIM, 3)], axis=1)
    P = 1.0 / np.sqrt(np.sum(L * L, axis=1) + G ** 2)         # as Adam's 1 / sqrt(E g^2)
    return G, L, P


def _window_terms(rng, G, L, scales, norm):
    """One window's sums as the accumulator holds them, squared norms by `norm`."""
    micro = [G + L @ rng.randn(L.shape[1]) / np.sqrt(b) for b in SIZES]
    window = sum(b * g for b, g in zip(SIZES, micro)) / sum(SIZES)
    split = lambda g: [tf.constant(g[:60].reshape(6, 10), tf.float32), tf.constant(g[60:], tf.float32)]  # noqa: E731
    sq = tf.add_n([norm(split(g), scales) for g in micro])
    inv = sum(1.0 / b for b in SIZES)
    g2, trace, valid = ns.window_estimates(sq, inv, len(SIZES), norm(split(window), scales), float(sum(SIZES)))
    assert bool(valid)
    return float(g2), float(trace)


def _ratio_and_error(estimates):
    """Ratio of the mean trace to the mean |G|^2 and its standard error (delta method)."""
    g2, trace = np.array(estimates).T
    ratio = trace.mean() / g2.mean()
    return ratio, np.std(trace - ratio * g2, ddof=1) / np.sqrt(len(g2)) / g2.mean()


def test_the_preconditioned_estimator_recovers_the_noise_scale_in_ps_geometry():
    rng = np.random.RandomState(7)
    G, L, P = _problem(rng)
    sigma = L @ L.T
    truth = np.trace(np.diag(P) @ sigma @ np.diag(P)) / np.sum((P * G) ** 2)
    raw_truth = np.trace(sigma) / np.sum(G ** 2)
    scales = [tf.constant(P[:60].reshape(6, 10), tf.float32), tf.constant(P[60:], tf.float32)]
    preconditioned, raw = [], []
    for _ in range(WINDOWS):
        preconditioned.append(_window_terms(rng, G, L, scales, pc.preconditioned_squared_norm))
        raw.append(_window_terms(rng, G, L, None, lambda g, _: ns.squared_norm(g)))
    ratio, error = _ratio_and_error(preconditioned)
    raw_ratio, raw_error = _ratio_and_error(raw)
    assert abs(ratio - truth) <= 4 * error, (ratio, truth, error)
    assert abs(raw_ratio - raw_truth) <= 4 * raw_error, (raw_ratio, raw_truth, raw_error)
    # Ignoring P would be caught: the raw estimate is many standard errors away.
    assert abs(raw_ratio - truth) > 10 * (error + raw_error), (raw_ratio, truth)
    assert error < 0.1 * truth      # the tolerance above is a tight one


# ------------------------------------------------------ graphs and replicas
def test_the_scales_are_read_at_call_time_inside_a_tf_function():
    optimizer = keras.optimizers.Adam()
    variables, grads = _applied(optimizer)
    preconditioner = pc.preconditioner_of(optimizer)
    read = tf.function(lambda: preconditioner.scales(variables))
    norm = tf.function(lambda g: pc.preconditioned_squared_norm(g, preconditioner.scales(variables)))
    for got, expected in zip(read(), preconditioner.scales(variables)):
        np.testing.assert_allclose(got.numpy(), expected.numpy(), rtol=1e-6)
    before = [s.numpy() for s in read()]
    more = _gradients(5, 1)[0]
    optimizer.apply_gradients(zip([tf.constant(g) for g in more], variables))
    after = read()
    history = _per_step(grads + [more])
    for got, old, steps in zip(after, before, history):
        np.testing.assert_allclose(got.numpy(), second_moments.adam_scale(steps), rtol=1e-6)
        assert not np.allclose(got.numpy(), old)
    probe = [tf.constant(g) for g in more]
    expected = pc.preconditioned_squared_norm(probe, preconditioner.scales(variables))
    np.testing.assert_allclose(float(norm(probe)), float(expected), rtol=1e-6)


@pytest.mark.parametrize("make", [   # RMSprop's apart (33 s): Adam's replicas read their scales the same way
    lambda: keras.optimizers.Adam(0.01), pytest.param(lambda: keras.optimizers.RMSprop(0.01), marks=pytest.mark.apart)],
    ids=["adam", "rmsprop"])
def test_each_replica_of_a_mirrored_strategy_reads_the_eager_scales(make):
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        variables = [keras.Variable(np.zeros(s, "float32")) for s in SHAPES]
        optimizer = make()
        optimizer.build(variables)
    preconditioner = pc.preconditioner_of(optimizer)

    for grads in _gradients(2):
        tf.function(lambda: strategy.run(lambda: optimizer.apply_gradients(zip(map(tf.constant, grads), variables))))()
    assert int(optimizer.iterations.numpy()) == STEPS
    eager = [s.numpy() for s in preconditioner.scales(variables)]
    assert not np.allclose(eager[0], 1.0)
    probe = [tf.constant(g) for g in _gradients(9, 1)[0]]
    eager_norm = float(pc.preconditioned_squared_norm(probe, eager))

    @tf.function
    def read():
        return strategy.run(lambda: (preconditioner.scales(variables),
                                     pc.preconditioned_squared_norm(probe, preconditioner.scales(variables))))

    scales, norms = read()
    for replica in range(2):
        local = [strategy.experimental_local_results(s)[replica] for s in scales]
        for got, expected in zip(local, eager):
            np.testing.assert_allclose(got.numpy(), expected, rtol=1e-6)
        np.testing.assert_allclose(float(strategy.experimental_local_results(norms)[replica]), eager_norm, rtol=1e-6)


def test_an_embedding_row_no_update_has_reached_is_left_out_not_scaled_by_one_over_epsilon():
    """Rows 2 and 3 of a table only rows 0 and 1 were looked up in have v = 0: P is 0 there
    (1 / eps = 1e7 would make a first lookup of them swamp the whole norm)."""
    table = keras.Variable(np.ones((4, 2), "float32"))
    optimizer = keras.optimizers.Adam(0.1)
    optimizer.build([table])
    optimizer.apply_gradients([(tf.IndexedSlices(tf.ones((2, 2)), tf.constant([0, 1]), tf.constant([4, 2])), table)])
    (scale,) = pc.preconditioner_of(optimizer).scales([table])
    scale = scale.numpy()
    assert np.all(scale[:2] > 0) and np.all(scale[:2] < 1e3) and np.all(scale[2:] == 0.0)
    first_lookup = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([3]), tf.constant([4, 2]))
    assert float(pc.preconditioned_squared_norm([first_lookup], [tf.constant(scale)])) == 0.0
