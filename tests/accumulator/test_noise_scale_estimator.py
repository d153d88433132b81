"""The gradient noise scale estimator (`accumulator.noise.noise_scale`) against known truths.

* Least squares at fixed weights, where |G|^2 and tr(Sigma) have a closed form.
  Loss 0.5 (x.w - y)^2, x ~ N(0, I_d), y = x.w* + eps, eps ~ N(0, s^2); with
  delta = w - w*, a sample's gradient is g = (x.delta - eps) x, so
      G = E[x x^T] delta = delta,
      E|g|^2 = E[(x.delta)^2 |x|^2] + s^2 E|x|^2
             = sum_j sum_ab delta_a delta_b E[x_a x_b x_j x_j] + d s^2
             = sum_j (|delta|^2 + 2 delta_j^2) + d s^2          (Isserlis)
             = (d + 2)|delta|^2 + d s^2,
      tr Sigma = E|g|^2 - |G|^2 = |delta|^2 + d (|delta|^2 + s^2),
  and B_simple = tr Sigma / |G|^2.
* The same under `tf.distribute.MirroredStrategy`: replica-local sums with
  Keras' 1/replicas loss scaling undone, reduced once per window, equal one
  device fed with every replica's share as a micro-batch.
* A small Keras model (an MLP with an embedding) at fixed weights on a fixed
  dataset: the truth by brute force from per-example gradients, the estimate
  from micro-batches drawn (with replacement, so that they are independent
  samples of the dataset) and differentiated with `tf.GradientTape`.

Tolerances come from the spread over seeds (see each test); each is tight
enough that the plausible mistakes fail: no bias correction, micro-batch
sizes taken as equal when they are not (h = K/B), h in place of h - 1/B, a
short micro-batch counted as full in 1/B (see
`test_the_tolerances_catch_wrong_formulas`).
"""

import math

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.noise import noise_scale as ns

# ----------------------------------------------------------------- helpers

LSQ_WINDOWS, LSQ_SMOOTHING = 1000, 0.998


def _least_squares_truth(d, delta_sq, noise_var):
    trace = delta_sq + d * (delta_sq + noise_var)
    return delta_sq, trace, trace / delta_sq


def _least_squares_micro_gradients(seed, windows, sizes, d=10, delta_sq=1.0, noise_var=2.0):
    """Per-micro-batch mean-loss gradients, `[windows, K, d]`, by one tape at fixed weights.

    The weights are tiled once per micro-batch, so one `GradientTape` call
    gives each micro-batch's gradient: the gradient of its own mean loss.
    """
    rng = np.random.RandomState(seed)
    w_star = rng.randn(d).astype("float32")
    delta = rng.randn(d)
    delta *= math.sqrt(delta_sq) / np.linalg.norm(delta)
    w = tf.constant(w_star + delta.astype("float32"))
    xs = [tf.constant(rng.randn(windows, b, d).astype("float32")) for b in sizes]
    ys = [
        tf.einsum("wbd,d->wb", x, w_star) + tf.constant(math.sqrt(noise_var) * rng.randn(windows, b), tf.float32)
        for x, b in zip(xs, sizes)
    ]
    tiled = tf.tile(w[None, None, :], [windows, len(sizes), 1])
    with tf.GradientTape() as tape:
        tape.watch(tiled)
        loss = 0.0
        for k, (x, y) in enumerate(zip(xs, ys)):
            residual = tf.einsum("wbd,wd->wb", x, tiled[:, k]) - y
            loss += tf.reduce_sum(tf.reduce_mean(0.5 * tf.square(residual), axis=1))
    return tape.gradient(loss, tiled)


def _window_sums(micro_grads, sizes):
    """What a window holds when it closes: the sums the estimator needs.

    `micro_grads` is a list over the K micro-batches of gradient lists.
    """
    sq_sum = tf.add_n([ns.squared_norm(g) for g in micro_grads])
    inv_sum = tf.add_n([1.0 / tf.cast(b, tf.float32) for b in sizes])
    size = float(sum(sizes))
    window = [
        None if parts[0] is None else tf.add_n([
            float(b) * tf.convert_to_tensor(g) for b, g in zip(sizes, parts)
        ]) / size
        for parts in zip(*micro_grads)
    ]
    return sq_sum, inv_sum, len(sizes), ns.squared_norm(window), size


def _feed_least_squares(estimator, grads, sizes):
    @tf.function
    def window_step(window_grads):
        micro = [[window_grads[k]] for k in range(len(sizes))]
        estimator.update_from_window(*_window_sums(micro, sizes))

    for i in range(grads.shape[0]):
        window_step(grads[i])


def _estimate(seed, sizes, windows=LSQ_WINDOWS, smoothing=LSQ_SMOOTHING):
    truth = _least_squares_truth(10, 1.0, 2.0)
    estimator = ns.NoiseScaleEstimate(smoothing=smoothing)
    _feed_least_squares(estimator, _least_squares_micro_gradients(seed, windows, sizes), sizes)
    got = (
        float(estimator.gradient_sq_norm),
        float(estimator.trace),
        float(estimator.noise_scale),
    )
    return got, truth


# ------------------------------------------------------- closed form: LSQ

# Truth: d = 10, |delta|^2 = 1, s^2 = 2: |G|^2 = 1, tr Sigma = 31, B_simple = 31
# (half the window of B = 64, so single windows resolve |G|^2 only roughly).
# LSQ_WINDOWS = 1000 windows, smoothing 0.998 (about 760 effective windows;
# the bias correction divides by 1 - 0.998^1000 = 0.865, so leaving it out is
# 13.5% off in |G|^2 and tr Sigma). Relative errors over seeds 0..19:
#   K = 4 x 16:       std 2.4% (|G|^2), 1.1% (tr Sigma), 2.4% (B_simple);
#                     max 4.2%, 2.2%, 5.0%
#   16, 16, 16, 4:    std 3.5%, 2.0%, 4.3%; max 7.5%, 3.1%, 8.4%
# (means within 0.5% of 0: no visible bias). The tolerances are about 3 sigma
# of the noisier uneven case; every wrong formula tried fails them (below).
LSQ_TOLERANCE = {"g2": 0.10, "trace": 0.06, "noise_scale": 0.12}


def _assert_within(got, truth, tolerance=LSQ_TOLERANCE):
    for name, value, true in zip(("g2", "trace", "noise_scale"), got, truth):
        assert abs(value - true) <= tolerance[name] * true, (name, value, true)


@pytest.mark.parametrize("seed", [0, 1])
def test_least_squares_closed_form(seed):
    got, truth = _estimate(seed, [16, 16, 16, 16])
    _assert_within(got, truth)


@pytest.mark.parametrize("seed", [0, 1])
def test_least_squares_uneven_micro_batches(seed):
    # B = 52; a short last micro-batch weighs 1/4 in the window's mean and
    # contributes 1/4 (not 1/16) to h.
    got, truth = _estimate(seed, [16, 16, 16, 4])
    _assert_within(got, truth)


def test_the_tolerances_catch_wrong_formulas():
    """The same windows through plausible wrong estimators land outside the tolerances."""
    sizes = [16, 16, 16, 4]
    grads = _least_squares_micro_gradients(0, LSQ_WINDOWS, sizes)
    truth = _least_squares_truth(10, 1.0, 2.0)
    smoothing = LSQ_SMOOTHING

    sums = []
    for i in range(grads.shape[0]):
        sq, inv, count, big, size = _window_sums([[grads[i, k]] for k in range(len(sizes))], sizes)
        sums.append([float(sq), float(inv), count, float(big), size])
    sq, inv, count, big, size = (np.array(c, dtype="float64") for c in zip(*sums))

    def ema(values, corrected=True):
        weights = smoothing ** np.arange(len(values))[::-1] * (1 - smoothing)
        total = float(np.sum(weights * values))
        return total / (1 - smoothing ** len(values)) if corrected else total

    def outcome(trace_w, g2_w, corrected=True):
        g2, trace = ema(g2_w, corrected), ema(trace_w, corrected)
        return g2, trace, trace / g2

    def estimates(m, h, inv_b, big_sq):
        trace_w = (m - big_sq) / (h - inv_b)
        return trace_w, big_sq - trace_w * inv_b

    right = outcome(*estimates(sq / count, inv / count, 1 / size, big))
    _assert_within(right, truth)
    wrong = {
        "no bias correction": outcome(*estimates(sq / count, inv / count, 1 / size, big), corrected=False),
        "sizes taken as equal (h = K/B)": outcome(*estimates(sq / count, count / size, 1 / size, big)),
        "h - 1/B replaced by h": outcome(*estimates(sq / count, inv / count, 0 * size, big)),
        "1/B replaced by 1/(K b_1)": outcome(*estimates(sq / count, inv / count, 1 / (count * 16), big)),
    }
    for name, values in wrong.items():
        print(name, values)
    for name, values in wrong.items():
        with pytest.raises(AssertionError):
            _assert_within(values, truth)


# ------------------------------------------------ a small real Keras model

N_EXAMPLES, FEATURES, CATEGORIES, CLASSES = 512, 6, 5, 3


def _classification_problem(seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(N_EXAMPLES, FEATURES).astype("float32")
    category = rng.randint(0, CATEGORIES, size=(N_EXAMPLES,)).astype("int32")
    logits = x @ rng.randn(FEATURES, CLASSES) + rng.randn(CATEGORIES, CLASSES)[category]
    labels = np.array([rng.choice(CLASSES, p=np.exp(l) / np.exp(l).sum()) for l in logits], dtype="int32")
    keras.utils.set_random_seed(seed)
    numeric = keras.Input((FEATURES,))
    cat_in = keras.Input((), dtype="int32")
    hidden = keras.layers.Concatenate()([numeric, keras.layers.Embedding(CATEGORIES, 4)(cat_in)])
    hidden = keras.layers.Dense(16, activation="tanh")(hidden)
    model = keras.Model([numeric, cat_in], keras.layers.Dense(CLASSES)(hidden))
    return model, x, category, labels


def _per_example_losses(model, x, category, labels):
    logits = model([x, category])
    return keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True)


def _brute_force_truth(model, x, category, labels):
    """|G|^2 of the full-data mean gradient and tr Sigma = mean_i |g_i - G|^2 (ddof 0)."""
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        losses = _per_example_losses(model, x, category, labels)
    jacobians = tape.jacobian(losses, variables, experimental_use_pfor=True)
    per_example = np.concatenate(
        [tf.reshape(tf.convert_to_tensor(j), [N_EXAMPLES, -1]).numpy().astype("float64") for j in jacobians],
        axis=1,
    )
    mean = per_example.mean(axis=0)
    g2 = float(mean @ mean)
    trace = float(np.mean(np.sum((per_example - mean) ** 2, axis=1)))
    return g2, trace, trace / g2


def _estimator_on_model(model, x, category, labels, sizes, windows, seed, smoothing=0.995):
    variables = model.trainable_variables
    estimator = ns.NoiseScaleEstimate(smoothing=smoothing)
    rng = np.random.RandomState(seed)
    total = sum(sizes)
    # With replacement: the micro-batches are independent draws from the data.
    draws = rng.randint(0, N_EXAMPLES, size=(windows, total))
    bounds = np.cumsum([0] + list(sizes))
    x, category, labels = tf.constant(x), tf.constant(category), tf.constant(labels)

    @tf.function
    def window_step(indices):
        micro = []
        for k in range(len(sizes)):
            rows = indices[bounds[k]:bounds[k + 1]]
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(_per_example_losses(
                    model, tf.gather(x, rows), tf.gather(category, rows), tf.gather(labels, rows)
                ))
            micro.append([
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) and k == 0 else g
                for g in tape.gradient(loss, variables)
            ])
        # Micro-batch 0's embedding gradient goes in dense, the others as
        # IndexedSlices with repeated rows: squared_norm must treat both alike.
        assert any(isinstance(g, tf.IndexedSlices) for g in micro[-1])
        estimator.update_from_window(*_window_sums(micro, sizes))

    for i in range(windows):
        window_step(tf.constant(draws[i]))
    return float(estimator.gradient_sq_norm), float(estimator.trace), float(estimator.noise_scale)


# Truth (model and data of seed 0, brute force over 512 examples): |G|^2 = 0.6509,
# tr Sigma = 8.857, B_simple = 13.61. 300 windows, smoothing 0.995 (leaving
# out the bias correction: 22% off). Relative errors over 12 seeds of the draws:
#   K = 4 x 8:     std 1.6% (|G|^2), 1.4% (tr Sigma), 2.5% (B_simple); max 3.1%, 3.2%, 4.3%
#   8, 8, 8, 2:    std 1.5%, 2.0%, 3.1%; max 2.8%, 5.6%, 7.1%
# Tolerances: about 3 sigma of the noisier case.
MLP_TOLERANCE = {"g2": 0.06, "trace": 0.07, "noise_scale": 0.10}


@pytest.mark.parametrize("sizes", [[8, 8, 8, 8], [8, 8, 8, 2]])
def test_mlp_brute_force_per_example_gradients(sizes):
    model, x, category, labels = _classification_problem()
    truth = _brute_force_truth(model, x, category, labels)
    got = _estimator_on_model(model, x, category, labels, sizes, windows=300, seed=1)
    print("truth", truth, "estimate", got)
    _assert_within(got, truth, MLP_TOLERANCE)


# ------------------------------------------------------- under tf.distribute


def test_replica_local_sums_reduced_once_per_window_match_one_device():
    """The recipe of the module docstring, under MirroredStrategy on 2 CPUs.

    Each replica keeps its own sums of R^2 |g_r|^2 (undoing the 1/R Keras'
    loss applies under a strategy), 1/b_r and the count, next to its weighted
    gradient sum and weight, all ON_READ; they are read (summed over replicas)
    once per window. The result must equal one device fed with every
    replica's share as a micro-batch of its own, unscaled. Replica shares are
    uneven (8 and 4 samples), so the local sizes matter.
    """
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    replicas = strategy.num_replicas_in_sync
    rng = np.random.RandomState(0)
    windows, steps, shares = 6, 3, (8, 4)
    data = [
        [[(rng.randn(b, 5).astype("float32"), rng.randn(b, 2).astype("float32")) for b in shares]
         for _ in range(steps)]
        for _ in range(windows)
    ]

    def make_model():
        keras.utils.set_random_seed(3)
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)])

    def gradients(model, x, y):
        with tf.GradientTape() as tape:
            loss = keras.losses.MeanSquaredError()(y, model(x))
        return tape.gradient(loss, model.trainable_variables)

    def local(shape=()):
        return tf.Variable(tf.zeros(shape), trainable=False, synchronization=tf.VariableSynchronization.ON_READ,
                           aggregation=tf.VariableAggregation.SUM)

    with strategy.scope():
        model = make_model()
        sq_sum, inv_sum, count, weight = local(), local(), local(), local()
        sums = [local(v.shape) for v in model.trainable_variables]
        distributed = ns.NoiseScaleEstimate(smoothing=0.5)

    @tf.function
    def micro_step(x, y):
        def on_replica(x, y):
            grads = gradients(model, x, y)
            size = tf.cast(tf.shape(x)[0], tf.float32)
            sq_sum.assign_add(float(replicas) ** 2 * ns.squared_norm(grads))
            inv_sum.assign_add(1.0 / size)
            count.assign_add(1.0)
            weight.assign_add(size)
            for total, g in zip(sums, grads):
                total.assign_add(size * g)

        strategy.run(on_replica, args=(x, y))

    def close_window():
        # Cross-replica reads of ON_READ SUM variables: the window's reduction.
        total_weight = float(weight.read_value())
        window_grad = [t.read_value() * (replicas / total_weight) for t in sums]
        distributed.update_from_window(
            sq_sum.read_value(), inv_sum.read_value(), count.read_value(), ns.squared_norm(window_grad), total_weight
        )
        for v in [sq_sum, inv_sum, count, weight] + sums:
            v.assign(tf.zeros_like(v))

    for window in data:
        for step in window:
            per_replica = [
                strategy.experimental_distribute_values_from_function(lambda ctx, i=i: step[ctx.replica_id_in_sync_group][i])
                for i in (0, 1)
            ]
            micro_step(*per_replica)
        close_window()

    one_device = ns.NoiseScaleEstimate(smoothing=0.5)
    reference_model = make_model()
    for window in data:
        micro = [gradients(reference_model, x, y) for step in window for x, y in step]
        one_device.update_from_window(*_window_sums(micro, [b for _ in window for b in shares]))

    assert int(distributed.window_count) == windows
    for name in ("gradient_sq_norm", "trace", "noise_scale"):
        np.testing.assert_allclose(float(getattr(distributed, name)), float(getattr(one_device, name)),
                                   rtol=1e-4, err_msg=name)


# ------------------------------------------------------------- unit checks


def test_single_micro_batch_windows_are_skipped():
    g2, trace, valid = ns.window_estimates(5.0, 1 / 16, 1, 5.0, 16.0)
    assert not bool(valid) and float(g2) == 0.0 and float(trace) == 0.0
    # h - 1/B = 0 for any K = 1 window, whatever its size; and K = 1 stays
    # invalid when rounding leaves h a hair above 1/B (1/b summed in another
    # precision), where the ratio would be huge.
    above = float(np.nextafter(np.float32(1 / 3), np.float32(1)))
    for count, inv, size in [(1, 0.25, 4.0), (1, above, 3.0), (0, 0.0, 0.0), (2, 0.0, 0.0)]:
        assert not bool(ns.window_estimates(1.0, inv, count, 1.0, size)[2]), (count, inv, size)

    estimator = ns.NoiseScaleEstimate(smoothing=0.9)
    assert math.isnan(float(estimator.noise_scale))
    assert math.isnan(float(estimator.gradient_sq_norm))
    # Only K = 1 windows (and one with an overflowed gradient): still nothing.
    estimator.update_from_window(5.0, 1 / 16, 1, 5.0, 16.0)
    estimator.update_from_window(float("inf"), 2 / 16, 2, 5.0, 32.0)
    estimator.update(float("nan"), float("nan"), False)
    assert int(estimator.window_count) == 0
    assert math.isnan(float(estimator.noise_scale))

    # Interleaved with valid windows, they change nothing; also traced.
    reference = ns.NoiseScaleEstimate(smoothing=0.9)
    valid_windows = [(3.0, 2 / 8, 2, 1.0, 16.0), (2.5, 3 / 8, 3, 0.9, 24.0), (4.0, 2 / 8, 2, 2.0, 16.0)]
    step = tf.function(estimator.update_from_window)
    for window in valid_windows:
        step(*(tf.constant(v, tf.float32) for v in window))
        step(*(tf.constant(v, tf.float32) for v in (7.0, 1 / 4, 1, 7.0, 4.0)))
        reference.update_from_window(*window)
    assert int(estimator.window_count) == 3
    for a, b in zip(estimator.variables, reference.variables):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


def test_window_estimates_match_the_papers_two_batch_formulas():
    # K = 2 equal micro-batches of b: B_small = b, B_big = 2b (appendix A).
    b, small_sq, big_sq = 16.0, 3.0, 2.0
    g2, trace, valid = ns.window_estimates(2 * small_sq, 2 / b, 2, big_sq, 2 * b)
    assert bool(valid)
    np.testing.assert_allclose(float(g2), (2 * b * big_sq - b * small_sq) / (2 * b - b), rtol=1e-6)
    np.testing.assert_allclose(float(trace), (small_sq - big_sq) / (1 / b - 1 / (2 * b)), rtol=1e-6)


def test_first_window_is_bias_corrected():
    estimator = ns.NoiseScaleEstimate(smoothing=0.99)
    estimator.update(2.0, 40.0, True)
    np.testing.assert_allclose(float(estimator.gradient_sq_norm), 2.0, rtol=1e-6)
    np.testing.assert_allclose(float(estimator.trace), 40.0, rtol=1e-6)
    np.testing.assert_allclose(float(estimator.noise_scale), 20.0, rtol=1e-6)
    estimator.update(4.0, 40.0, True)
    mean_g2 = (0.99 * 2.0 + 4.0) / 1.99
    np.testing.assert_allclose(float(estimator.gradient_sq_norm), mean_g2, rtol=1e-6)
    np.testing.assert_allclose(float(estimator.noise_scale), 40.0 / mean_g2, rtol=1e-6)


def test_variables_come_from_the_callback():
    made = []

    def make_variable(name, dtype, shape=()):
        variable = tf.Variable(tf.zeros(shape, dtype), trainable=False, name=name)
        made.append((name, dtype, shape))
        return variable

    estimator = ns.NoiseScaleEstimate(make_variable)
    # One vector: a window folds in with one read and one write.
    assert made == [("state", "float64", (len(ns.NoiseScaleEstimate.FIELDS) + len(ns.WindowMoments.FIELDS),))]
    assert estimator.smoothing == ns.DEFAULT_SMOOTHING
    estimator.update(1.0, 3.0, True)
    assert float(estimator.noise_scale) == pytest.approx(3.0)


@pytest.mark.parametrize("smoothing", [-0.1, 1.0, 1.5, float("nan"), float("inf"), "0.9", True, None])
def test_bad_smoothing_raises_naming_the_parameter(smoothing):
    with pytest.raises(ValueError, match=r"`smoothing` must be a float in \[0, 1\)"):
        ns.NoiseScaleEstimate(smoothing=smoothing)


@pytest.mark.parametrize("smoothing", [0, 0.0, 0.5, 0.999, np.float32(0.9)])
def test_good_smoothing_is_accepted(smoothing):
    assert ns.NoiseScaleEstimate(smoothing=smoothing).smoothing == pytest.approx(float(smoothing))


def test_indexed_slices_norm_is_the_dense_norm():
    values = tf.constant(np.random.RandomState(0).randn(6, 3, 2), tf.float32)
    indices = tf.constant([4, 1, 4, 0, 1, 4], tf.int64)  # repeated rows sum before squaring
    slices = tf.IndexedSlices(values, indices, dense_shape=tf.constant([7, 3, 2], tf.int64))
    dense = tf.convert_to_tensor(slices)
    expected = float(tf.reduce_sum(tf.square(dense)))
    assert expected != pytest.approx(float(tf.reduce_sum(tf.square(values))))
    np.testing.assert_allclose(float(ns.squared_norm(slices)), expected, rtol=1e-6)
    np.testing.assert_allclose(float(ns.squared_norm([slices, None, dense])), 2 * expected, rtol=1e-6)
    traced = tf.function(lambda v, i: ns.squared_norm([tf.IndexedSlices(v, i), None]))
    np.testing.assert_allclose(float(traced(values, indices)), expected, rtol=1e-6)
    half = tf.IndexedSlices(tf.cast(values, tf.float16), indices)
    np.testing.assert_allclose(float(ns.squared_norm(half)), expected, rtol=1e-2)
    assert float(ns.squared_norm([None])) == 0.0
