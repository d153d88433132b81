"""`GradientAccumulator(measure_noise_scale=True)` in `fit`, custom loops and under a strategy.

The estimator itself is tested in `test_noise_scale_estimator.py`; here, that
the optimizer feeds it the right sums: every micro-batch's squared norm, size
and count, the window's gradient and weight, once per window, reset with the
window, across replicas with no extra reduction, and that the estimate is
saved, logged and off by default.

Weights are kept fixed (SGD with learning rate 0) where a truth is known, so
every window samples the same |G|^2 and tr Sigma.
"""

import contextlib
import functools
import math

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests import saved_0_3
from tests.accumulator import reference as ref
from tests.accumulator import test_noise_scale_estimator as est
from tests.accumulator.reference import CountingReduction

DEVICES = ["/cpu:0", "/cpu:1"]


def _accumulator(inner=None, accum_steps=4, **kwargs):
    return GradientAccumulator(inner or keras.optimizers.SGD(0.0), accum_steps,
                               measure_noise_scale=True, **kwargs)


def _expected_from_windows(windows, smoothing):
    """B_simple, |G|^2, tr Sigma by the appendix-A formulas in float64, from per-window lists
    of (micro-batch gradient vectors, sizes); bias-corrected EMAs, K = 1 windows skipped."""
    ema_g2 = ema_trace = ema_w = 0.0
    for grads, sizes in windows:
        if len(sizes) < 2:
            continue
        sizes = np.asarray(sizes, "float64")
        total = sizes.sum()
        mean_sq = np.mean([g @ g for g in grads])
        big = sum(b * g for b, g in zip(sizes, grads)) / total
        trace = (mean_sq - big @ big) / (np.mean(1 / sizes) - 1 / total)
        g2 = big @ big - trace / total
        ema_g2 = smoothing * ema_g2 + (1 - smoothing) * g2
        ema_trace = smoothing * ema_trace + (1 - smoothing) * trace
        ema_w = smoothing * ema_w + (1 - smoothing)
    return ema_trace / ema_g2, ema_g2 / ema_w, ema_trace / ema_w


def _flat_gradient(model, loss_fn, x, y):
    with tf.GradientTape() as tape:
        loss = loss_fn(y, model(x, training=True))
    return np.concatenate([tf.reshape(g, [-1]).numpy().astype("float64")
                           for g in tape.gradient(loss, model.trainable_variables)])


def _readings(optimizer, preconditioned=False):
    estimate = optimizer.preconditioned_noise_scale_estimate if preconditioned else optimizer.noise_scale_estimate
    return estimate.noise_scale_value(), float(estimate.gradient_sq_norm), float(estimate.trace)


# ------------------------------------------------------ known truths via fit

def _least_squares_data(windows, window, seed=0, d=10, noise_var=2.0):
    rng = np.random.RandomState(seed)
    w_star = rng.randn(d, 1)
    delta = rng.randn(d, 1)
    delta /= np.linalg.norm(delta)                      # |delta|^2 = 1
    x = rng.randn(windows * window, d).astype("float32")
    y = (x @ w_star + math.sqrt(noise_var) * rng.randn(windows * window, 1)).astype("float32")
    return x, y, (w_star + delta).astype("float32")


def _least_squares_model(weights):
    model = keras.Sequential([keras.Input((weights.shape[0],)), keras.layers.Dense(1, use_bias=False)])
    model.layers[0].set_weights([weights])
    return model


# keras' "mse" is mean (x.w - y)^2, twice the 0.5 (x.w - y)^2 of the closed
# form: gradients double, |G|^2 and tr Sigma grow 4 times, B_simple = 31 stays.
def _lsq_truth():
    g2, trace, noise_scale = est._least_squares_truth(10, 1.0, 2.0)
    return noise_scale, 4 * g2, 4 * trace


def test_least_squares_through_fit_matches_the_closed_form():
    """1000 windows of 4 x 16 at fixed weights, smoothing 0.998: B_simple = 31.

    The same windows and smoothing as the estimator's closed-form test, whose
    spread over 20 seeds (std 2.4% |G|^2, 1.1% tr Sigma, 2.4% B_simple; max
    4.2%, 2.2%, 5.0%) sets the tolerances (`est.LSQ_TOLERANCE`, about 3
    sigma of the uneven case). Fed wrong sums (a window's sums not reset: K
    and the norms grow without bound; the step that finds the data exhausted
    counted; the bias correction left out: 13.5%), it lands far outside.
    """
    x, y, weights = _least_squares_data(est.LSQ_WINDOWS, 64)
    model = _fit_least_squares(weights, "least squares via fit", x, y, batch_size=16, shuffle=False)
    np.testing.assert_allclose(model.get_weights()[0], weights)      # learning rate 0


def _fit_least_squares(weights, label, *data, **fit_kwargs):
    """Fits the least-squares model at learning rate 0 and checks the estimate
    against the closed form (tolerances: about 3 sigma over 20 seeds)."""
    model = _least_squares_model(weights)
    optimizer = _accumulator(noise_scale_smoothing=est.LSQ_SMOOTHING)
    model.compile(optimizer, "mse")
    model.fit(*data, verbose=0, **fit_kwargs)
    assert int(optimizer.noise_scale_estimate.window_count) == est.LSQ_WINDOWS
    got, truth = _readings(optimizer), _lsq_truth()
    print(label, got, "truth", truth)
    for (name, tol), value, true in zip(
            [("noise_scale", 0.12), ("g2", 0.10), ("trace", 0.06)], got, truth):
        assert abs(value - true) <= tol * true, (name, value, true)
    return model


# Apart (41 s): least squares through fit and the brute force below check the same estimate;
# uneven micro-batches' sizes are test_short_last_micro_batch_and_forced_close_are_exact's.
@pytest.mark.apart
def test_uneven_micro_batches_through_fit_match_the_closed_form():
    """Windows of 16, 16, 16, 4 (a dataset that ends every window short): B = 52,
    h = (3/16 + 1/4) / 4. Spread over 20 seeds (estimator test): std 3.5%,
    2.0%, 4.3%; max 7.5%, 3.1%, 8.4%: the tolerances are about 3 sigma. Taking
    the short micro-batch as a full one (h = K/B) fails them."""
    window = 52
    x, y, weights = _least_squares_data(est.LSQ_WINDOWS, window, seed=1)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(window).flat_map(
        lambda xw, yw: tf.data.Dataset.from_tensor_slices((xw, yw)).batch(16))
    _fit_least_squares(weights, "uneven least squares via fit", dataset)


def _fixed_weights_readings(loss):
    """50 windows of 4 x 16 of least squares at fixed weights, smoothing 0.9: the readings."""
    x, y, weights = _least_squares_data(50, 64)
    model = _least_squares_model(weights)
    optimizer = _accumulator(noise_scale_smoothing=0.9)
    model.compile(optimizer, loss)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    return _readings(optimizer)


_mse_readings = functools.lru_cache(maxsize=None)(lambda: _fixed_weights_readings("mse"))   # both cases'


# The mean's apart (4 s): the sum's case runs the same path, its size 16^2 the stronger check.
@pytest.mark.parametrize("reduce", [tf.reduce_sum, pytest.param(tf.reduce_mean, marks=pytest.mark.apart)],
                         ids=["sum", "mean"])
def test_a_loss_that_reduces_its_batch_itself_gives_the_noise_scale_in_samples(reduce):
    """A loss function that returns one number per batch (its samples' sum or mean) gives
    B_simple in samples, as "mse" does: the same windows at fixed weights, the same
    estimate (|G|^2 and tr Sigma 16^2 times "mse"'s for the sum of micro-batches of 16,
    their ratio unchanged). Weighed 1 per micro-batch, as such a loss once was, B_simple
    came out in micro-batches: 16 times too small."""
    readings = {"mse": _mse_readings(),
                "own": _fixed_weights_readings(lambda t, p: reduce(tf.square(p - t)))}
    print("mse", readings["mse"], reduce.__name__, readings["own"])
    scale = 16.0 ** 2 if reduce is tf.reduce_sum else 1.0
    mse = readings["mse"]
    assert math.isfinite(mse[0]) and mse[0] > 0
    np.testing.assert_allclose(readings["own"], [mse[0], mse[1] * scale, mse[2] * scale], rtol=1e-4)


def test_a_loss_that_sums_is_refused_before_fit_reads_a_batch():
    """reduction "sum": its micro-batches carry no size. Refused by `fit` before it
    reads any data (once, at the first step, after the data and the step's tracing)."""
    pulled = []

    def batches():
        for _ in range(8):
            pulled.append(1)
            yield np.ones((4, 10), "float32"), np.ones((4, 1), "float32")

    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(1)])
    model.compile(_accumulator(), keras.losses.MeanSquaredError(reduction="sum"))
    with pytest.raises(ValueError, match=r"needs a loss that is a mean(.|\n)*the loss 'mean_squared_error', "
                                         r"reduction 'sum'(.|\n)*allows 'sum_over_batch_size'"):
        model.fit(batches(), verbose=0)
    assert pulled == []


def test_short_last_micro_batch_and_forced_close_are_exact():
    """100 samples in batches of 16 (6 of 16, one of 4), accum_steps 4: a window of
    4 x 16, then the epoch's end applies one of 16, 16, 4; both count, with
    their true sizes. Weights move (SGD 0.1), so each window is compared with
    per-micro-batch gradients taken at that window's weights."""
    x, y = ref.regression_data(100)
    loss_fn = keras.losses.MeanSquaredError()
    model = ref.mlp()
    optimizer = _accumulator(keras.optimizers.SGD(0.1), noise_scale_smoothing=0.5)
    model.compile(optimizer, "mse")
    reference = ref.mlp()
    windows = []
    for start, stop in [(0, 64), (64, 100)]:
        bounds = list(range(start, stop, 16)) + [stop]
        grads = [_flat_gradient(reference, loss_fn, x[a:b], y[a:b]) for a, b in zip(bounds, bounds[1:])]
        windows.append((grads, np.diff(bounds)))
        ref.fit_large_batch(reference, keras.optimizers.SGD(0.1), x[start:stop], y[start:stop], stop - start)
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(optimizer.noise_scale_estimate.window_count) == 2
    np.testing.assert_allclose(_readings(optimizer), _expected_from_windows(windows, 0.5), rtol=2e-4)


INNER = {"sgd": lambda: keras.optimizers.SGD(0.01), "adam": lambda: keras.optimizers.Adam(1e-3)}


@pytest.mark.parametrize("inner", list(INNER))
@pytest.mark.parametrize("mode", ["drop", "apply"])
def test_the_sums_reset_with_every_window(mode, inner):
    """5 micro-batches, accum_steps 4: a window of 4, then one of 1 ("apply":
    K = 1 gives no estimate, skipped) or dropped; the sums are empty after (Adam's
    squares per coordinate too)."""
    x, y = ref.regression_data(80)
    model = ref.mlp()
    optimizer = _accumulator(INNER[inner](), partial_window=mode)
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=16, shuffle=False, verbose=0)
    assert int(optimizer.noise_scale_estimate.window_count) == 1
    noise = optimizer._state.saved.noise
    assert noise.sums.numpy().tolist() == [0.0] * (3 if inner == "adam" else 4)
    assert (noise.squares is not None) == (inner == "adam")
    if noise.squares is not None:
        assert noise.squares.shape == (sum(int(np.prod(v.shape)) for v in model.trainable_variables),)
        assert not np.any(noise.squares.numpy())
    # The same 4 micro-batches alone give the same estimate: nothing of the
    # fifth leaked into it, nor into the next window.
    assert optimizer.noise_scale == pytest.approx(_first_window_alone(inner), rel=1e-6)


@functools.lru_cache(maxsize=None)
def _first_window_alone(inner):
    """The estimate of the first 4 micro-batches of 16 of `regression_data(80)` alone (both modes')."""
    x, y = ref.regression_data(80)
    alone = ref.mlp()
    alone_optimizer = _accumulator(INNER[inner]())
    alone.compile(alone_optimizer, "mse")
    alone.fit(x[:64], y[:64], batch_size=16, shuffle=False, verbose=0)
    return alone_optimizer.noise_scale


def test_small_model_through_fit_matches_per_example_brute_force():
    """The estimator test's MLP with an embedding (truth |G|^2 = 0.6509, tr Sigma
    = 8.857, B_simple = 13.61 by brute force over 512 examples), through fit:
    300 windows of 4 x 8 drawn with replacement, smoothing 0.995. Spread of
    that set-up over 12 seeds: std 1.6%, 1.4%, 2.5%; max 3.1%, 3.2%, 4.3%;
    tolerances `est.MLP_TOLERANCE` (6%, 7%, 10%)."""
    model, x, category, labels = est._classification_problem()
    g2, trace, noise_scale = est._brute_force_truth(model, x, category, labels)
    draws = np.random.RandomState(1).randint(0, est.N_EXAMPLES, size=300 * 32)
    optimizer = _accumulator(noise_scale_smoothing=0.995)
    model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit([x[draws], category[draws]], labels[draws], batch_size=8, shuffle=False, verbose=0)
    got = _readings(optimizer)
    print("mlp via fit", got, "truth", (noise_scale, g2, trace))
    for (name, tol), value, true in zip(
            [("noise_scale", est.MLP_TOLERANCE["noise_scale"]), ("g2", est.MLP_TOLERANCE["g2"]),
             ("trace", est.MLP_TOLERANCE["trace"])], got, (noise_scale, g2, trace)):
        assert abs(value - true) <= tol * true, (name, value, true)


def test_loss_scale_is_divided_out():
    x, y = ref.regression_data(128)
    readings = []
    for inner in (keras.optimizers.SGD(0.1),
                  keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0 ** 12)):
        model = ref.mlp()
        optimizer = _accumulator(inner, noise_scale_smoothing=0.5)
        model.compile(optimizer, "mse", auto_scale_loss=False)
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        readings.append(_readings(optimizer))
    np.testing.assert_allclose(readings[1], readings[0], rtol=1e-4)


def test_adams_preconditioned_sums_read_p_once_a_window_and_match_each_micro_batchs_norm():
    """Adam's window keeps g^2 per coordinate and reads P at the close. The same estimate,
    window by window, as P read (eagerly, `Preconditioner.scales`) before each window's
    update and applied to each micro-batch's gradient: an embedding looked up twice per
    micro-batch (repeated rows summed before squaring) beside dense layers, and P's
    first window (ones, before any update) and later ones."""
    from tfx_gradient_accumulator.accumulator.noise import noise_scale as ns, preconditioning as pc
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 6, size=(9, 4, 5)).astype("int32")          # 9 micro-batches of 4, 5 ids each
    targets = rng.normal(size=(9, 4, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((5,), dtype="int32")
    hidden = keras.layers.Dense(3, activation="tanh")(keras.layers.Flatten()(keras.layers.Embedding(6, 2)(inputs)))
    model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
    optimizer = _accumulator(keras.optimizers.Adam(0.05), 3, noise_scale_smoothing=0.5)
    variables = model.trainable_variables
    optimizer.build(variables)
    preconditioner = pc.preconditioner_of(optimizer)
    reference = ns.NoiseScaleEstimate(smoothing=0.5)

    def gradients(k):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(ids[k]) - targets[k]))
        return tape.gradient(loss, variables)

    step = tf.function(lambda grads: optimizer.apply_gradients(zip(grads, variables)))
    for window in range(3):
        scales = preconditioner.scales(variables)      # P before this window's update
        micro = [gradients(3 * window + k) for k in range(3)]
        assert isinstance(micro[0][0], tf.IndexedSlices)
        mean = [sum(tf.convert_to_tensor(g[i]) for g in micro) / 3.0 for i in range(len(variables))]
        reference.update_from_window(sum(pc.preconditioned_squared_norm(g, scales) for g in micro), 3.0, 3.0,
                                     pc.preconditioned_squared_norm(mean, scales), 3.0)
        for grads in micro:
            step(grads)
        assert int(optimizer.iterations.numpy()) == window + 1
        estimate = optimizer.preconditioned_noise_scale_estimate
        np.testing.assert_allclose([float(estimate.gradient_sq_norm), float(estimate.trace)],
                                   [float(reference.gradient_sq_norm), float(reference.trace)], rtol=2e-5)
    assert int(reference.window_count) == 3


# ------------------------------------------------------------- distribution

MICRO, ACCUM = 16, 4        # global micro-batch 16: 8 per replica


MIRRORED_INNER = {"sgd": lambda: keras.optimizers.SGD(0.05), "adam": lambda: keras.optimizers.Adam(0.01)}


def _one_device_reference(x, y, epochs, inner="sgd"):
    """One device, micro-batches of 8 in windows of 8: the replicas' shares in order."""
    model = ref.mlp()
    optimizer = _accumulator(MIRRORED_INNER[inner](), 2 * ACCUM, noise_scale_smoothing=0.5)
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=MICRO // 2, epochs=epochs, shuffle=False, verbose=0)
    return optimizer


@pytest.mark.parametrize("inner", list(MIRRORED_INNER))
def test_mirrored_fit_matches_one_device_with_one_reduction_per_window(inner):
    """2 replicas, 96 samples in global micro-batches of 16, accum_steps 4: windows
    of 4 and 2 (closed at the epoch's end) per epoch. Same windows, same
    micro-batches (the replicas' shares) as one device with batches of 8 and
    accum_steps 8: the same estimate (with Adam, the preconditioned one too: each
    replica's squares per coordinate, read with P at the close). And still one
    batched reduction per window: the noise-scale sums travel with the gradients."""
    x, y = ref.regression_data(96)
    counter = CountingReduction()
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=counter)
    with strategy.scope():
        model = ref.mlp()
        optimizer = _accumulator(MIRRORED_INNER[inner](), ACCUM, noise_scale_smoothing=0.5)
        model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    windows = int(optimizer.iterations.numpy())
    assert windows == 4 and int(optimizer.noise_scale_estimate.window_count) == 4
    assert int(counter.count.numpy()) == windows
    one_device = _one_device_reference(x, y, epochs=2, inner=inner)
    np.testing.assert_allclose(_readings(optimizer), _readings(one_device), rtol=1e-4)
    if inner == "adam":
        assert int(optimizer.preconditioned_noise_scale_estimate.window_count) == 4
        np.testing.assert_allclose(_readings(optimizer, preconditioned=True),
                                   _readings(one_device, preconditioned=True), rtol=1e-4)


def test_one_local_replica_reads_its_squares_as_several_do():
    """A strategy with one local replica (each worker of a multi-worker cluster has one)
    hands the close's per-replica squares back as a plain tensor: Adam's estimates there
    are the one-device ones."""
    x, y = ref.regression_data(64)
    readings = []
    for strategy in (tf.distribute.MirroredStrategy(DEVICES[:1]), None):
        with strategy.scope() if strategy else contextlib.nullcontext():
            model = ref.mlp()
            optimizer = _accumulator(keras.optimizers.Adam(0.01), ACCUM, noise_scale_smoothing=0.5)
            model.compile(optimizer, "mse")
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        assert int(optimizer.preconditioned_noise_scale_estimate.window_count) == 2
        readings.append(_readings(optimizer) + _readings(optimizer, preconditioned=True))
    np.testing.assert_allclose(readings[0], readings[1], rtol=1e-5)


# Apart (36 s): the same replicas^2 correction runs through fit in
# test_mirrored_fit_matches_one_device_with_one_reduction_per_window, and `micro_batch_weight`
# on one device in test_overwrite_with_gradient_variables_are_left_out.
@pytest.mark.apart
def test_custom_strategy_run_loop_with_compute_average_loss_matches_one_device():
    """A custom loop: `tf.nn.compute_average_loss(..., global_batch_size=16)` divides
    each replica's local sum by 16 = 2 x 8, as fit divides its mean by 2, so
    the replicas^2 correction applies; `micro_batch_weight` is that
    denominator, 16, whose share per replica (16 / 2) is the replica's size."""
    x, y = ref.regression_data(96)
    loss_fn = keras.losses.MeanSquaredError(reduction="none")
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=CountingReduction())
    with strategy.scope():
        model = ref.mlp()
        optimizer = _accumulator(keras.optimizers.SGD(0.05), ACCUM, noise_scale_smoothing=0.5)
        optimizer.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO))

    @tf.function
    def step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=MICRO)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply(grads, model.trainable_variables, micro_batch_weight=float(MICRO))
        strategy.run(replica_step, args=batch)

    for batch in dataset:
        step(batch)
    optimizer.close_partial_window()
    assert int(optimizer.noise_scale_estimate.window_count) == 2
    np.testing.assert_allclose(_readings(optimizer), _readings(_one_device_reference(x, y, epochs=1)), rtol=1e-4)


# --------------------------------------------------- API, logs and saving

def test_off_by_default_adds_no_variables_and_no_log():
    x, y = ref.regression_data(64)
    counts, histories = [], []
    for measure in (False, True):
        model = ref.mlp()
        optimizer = GradientAccumulator(keras.optimizers.Adam(), 4, measure_noise_scale=measure)
        model.compile(optimizer, "mse")
        histories.append(model.fit(x, y, batch_size=8, epochs=2, verbose=0).history)
        counts.append(len(optimizer.variables))
        if not measure:
            assert not optimizer.measure_noise_scale
            assert not any("noise_scale" in v.name for v in optimizer.variables)
            with pytest.raises(AttributeError, match="measure_noise_scale=True"):
                optimizer.noise_scale
    # Adam: 2 replica-local sums (a vector of sizes, one of squares per coordinate), a state vector per estimate.
    assert counts[1] == counts[0] + 4
    assert "noise_scale" not in histories[0] and "noise_scale_preconditioned" not in histories[0]
    assert len(histories[1]["noise_scale"]) == 2 and len(histories[1]["noise_scale_preconditioned"]) == 2


@pytest.mark.parametrize("inner", list(INNER))
def test_an_optimizer_saved_by_version_0_3_loads_with_its_estimates(inner):
    """Version 0.3 kept the noise scale in scalar variables (the open window's squared norms,
    each estimate's EMAs). Loaded now: the estimates carry over; the open window trains on as
    saved, and is left out of the estimate where this version keeps squares per coordinate
    (Adam), counted where it keeps the sums alike (SGD); the windows after count on both."""
    x, y = ref.regression_data(96)
    runs = []
    for _ in range(2):
        model = ref.mlp()
        optimizer = _accumulator(INNER[inner](), 4, noise_scale_smoothing=0.9, partial_window="carry")
        model.compile(optimizer, "mse")
        runs.append((model, optimizer))
    (model, optimizer), (loaded_model, loaded) = runs
    model.fit(x[:80], y[:80], batch_size=8, shuffle=False, verbose=0)       # 2 windows and 2 micro-batches
    assert optimizer.held_micro_batches == 2 and int(optimizer.noise_scale_estimate.window_count) == 2
    old = saved_0_3.in_the_0_3_layout(optimizer)
    assert len(old) == len(optimizer.variables) + (11 if inner == "adam" else 7)
    loaded_model.set_weights(model.get_weights())
    loaded.build(loaded_model.trainable_variables)
    loaded.load_own_variables({str(i): value for i, value in enumerate(old)})

    estimates = ["noise_scale_estimate"] + (["preconditioned_noise_scale_estimate"] if inner == "adam" else [])
    for name in estimates:
        np.testing.assert_allclose([float(getattr(loaded, name).state[i]) for i in range(12)],
                                   [float(getattr(optimizer, name).state[i]) for i in range(12)], rtol=1e-6)
    assert loaded.held_micro_batches == 2
    for a, b in zip(loaded.variables, optimizer.variables):
        if not any(a is v for v in (loaded._state.saved.noise.squares, loaded._state.saved.noise.sums)):
            np.testing.assert_allclose(np.asarray(a.numpy(), "float64"), np.asarray(b.numpy(), "float64"),
                                       rtol=1e-6, err_msg=a.path)
    # The open window (2 held + 2 more), then one more: the same training.
    for fitted in (model, loaded_model):
        fitted.fit(x[:48], y[:48], batch_size=8, shuffle=False, verbose=0)
    for a, b in zip(loaded_model.get_weights(), model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    counted = int(loaded.noise_scale_estimate.window_count)
    assert int(optimizer.noise_scale_estimate.window_count) == 4
    assert counted == (3 if inner == "adam" else 4)
    if inner == "sgd":
        assert loaded.noise_scale == pytest.approx(optimizer.noise_scale, rel=1e-5)


def test_history_progress_bar_and_batch_logs_show_the_noise_scale(capsys):
    x, y = ref.regression_data(128)
    batch_logs = []
    seen = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs)))
    model = ref.mlp()
    optimizer = _accumulator(keras.optimizers.SGD(0.05))
    model.compile(optimizer, "mse")
    history = model.fit(x, y, batch_size=8, epochs=2, verbose=1, callbacks=[seen])
    values = history.history["noise_scale"]
    assert len(values) == 2 and all(isinstance(v, float) and math.isfinite(v) for v in values)
    assert values[-1] == optimizer.noise_scale
    # Batch logs: NaN until the first window closes (4th micro-batch), then the estimate.
    assert [math.isnan(logs["noise_scale"]) for logs in batch_logs[:4]] == [True, True, True, False]
    assert "noise_scale: " in capsys.readouterr().out


def test_saving_and_restoring_keep_the_estimate(tmp_path):
    x, y = ref.regression_data(128)
    model = ref.mlp()
    optimizer = _accumulator(keras.optimizers.Adam(1e-3), noise_scale_smoothing=0.9)
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=8, verbose=0)
    expected = _readings(optimizer)
    assert math.isfinite(expected[0])

    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.measure_noise_scale and loaded.optimizer.noise_scale_smoothing == 0.9
    np.testing.assert_allclose(_readings(loaded.optimizer), expected, rtol=1e-6)

    path = tf.train.Checkpoint(optimizer=optimizer).save(str(tmp_path / "ckpt"))
    fresh = ref.mlp()
    fresh_optimizer = _accumulator(keras.optimizers.Adam(1e-3), noise_scale_smoothing=0.9)
    fresh_optimizer.build(fresh.trainable_variables)
    assert math.isnan(fresh_optimizer.noise_scale)
    tf.train.Checkpoint(optimizer=fresh_optimizer).restore(path).assert_existing_objects_matched()
    np.testing.assert_allclose(_readings(fresh_optimizer), expected, rtol=1e-6)


def test_config_round_trip():
    optimizer = _accumulator(noise_scale_smoothing=0.95)
    config = optimizer.get_config()
    assert config["measure_noise_scale"] is True and config["noise_scale_smoothing"] == 0.95
    again = GradientAccumulator.from_config(config)
    assert again.measure_noise_scale and again.noise_scale_smoothing == 0.95
    assert math.isnan(again.noise_scale)            # not built: nothing measured


@pytest.mark.parametrize("value", [1, 0, "yes", None, np.float32(1.0)])
def test_bad_measure_noise_scale_raises_naming_the_parameter(value):
    with pytest.raises(ValueError, match=r"`measure_noise_scale` must be True or False"):
        GradientAccumulator(keras.optimizers.SGD(), 4, measure_noise_scale=value)


@pytest.mark.parametrize("value", [1.0, -0.5, float("nan"), "0.9", None])
def test_bad_smoothing_raises_naming_the_parameter(value):
    with pytest.raises(ValueError, match=r"`noise_scale_smoothing` must be a float in \[0, 1\)"):
        GradientAccumulator(keras.optimizers.SGD(), 4, measure_noise_scale=True, noise_scale_smoothing=value)


def test_a_pass_through_cannot_measure():
    with pytest.raises(ValueError, match="accum_steps >= 2"):
        GradientAccumulator(keras.optimizers.SGD(), 1, measure_noise_scale=True)
    # A schedulable one at 1 can: its windows of 1 are skipped until it grows.
    assert GradientAccumulator(keras.optimizers.SGD(), 1, schedulable=True, measure_noise_scale=True)


def test_overwrite_with_gradient_variables_are_left_out():
    """A float8-style variable whose "gradient" is its new value (large here) must
    not enter either norm: the estimate equals the one without it."""
    rng = np.random.RandomState(0)
    grads = [rng.randn(3, 2).astype("float32") for _ in range(8)]
    readings = []
    for with_scale in (False, True):
        weights = keras.Variable(np.zeros((3, 2), "float32"), name="w")
        variables = [weights]
        if with_scale:
            scale = keras.Variable(np.zeros((4,), "float32"), name="amax", trainable=False)
            scale.overwrite_with_gradient = True
            variables.append(scale)
        optimizer = _accumulator(noise_scale_smoothing=0.5)
        optimizer.build(variables)
        for k, g in enumerate(grads):
            step_grads = [g] + ([np.full((4,), 100.0 + k, "float32")] if with_scale else [])
            optimizer.apply(step_grads, variables, micro_batch_weight=4.0 + k % 4)
        readings.append(_readings(optimizer))
    assert int(optimizer.noise_scale_estimate.window_count) == 2
    np.testing.assert_allclose(readings[1], readings[0], rtol=1e-6)


def _sequence_noise_scales(monkeypatch=None, length=12):
    """B_simple of one sequence model, its loss written per token ("mse" on (b, L, 1): D = b L)
    and per sample (a mean over the sequence in the loss: D = b): the same gradients."""
    from keras import ops
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, length, 3)).astype("float32")
    y = (x.sum(-1, keepdims=True) + rng.normal(size=(64, length, 1))).astype("float32")
    found = []
    for loss in ("mse", lambda t, p: ops.mean(ops.square(t - p), axis=(1, 2))):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((length, 3)), keras.layers.Dense(4, activation="tanh"),
                                  keras.layers.Dense(1)])
        optimizer = _accumulator(keras.optimizers.SGD(0.01), 4, noise_scale_smoothing=0.5)
        model.compile(optimizer, loss)
        model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
        found.append(optimizer.noise_scale)
    return found


def test_sequence_outputs_give_the_noise_scale_in_samples_not_tokens(monkeypatch):
    per_token, per_sample = _sequence_noise_scales()
    assert np.isfinite(per_sample) and per_token == pytest.approx(per_sample, rel=1e-4)
    # Control: sizes in the loss's elements (the rule before) count each sequence 12 times.
    from tfx_gradient_accumulator.accumulator.window import weighting
    monkeypatch.setattr(weighting, "loss_samples", lambda model, x, y, y_pred: weighting.loss_denominator(
        model, x, y, y_pred, None))
    per_token, per_sample = _sequence_noise_scales()
    assert per_token == pytest.approx(12 * per_sample, rel=1e-3)
