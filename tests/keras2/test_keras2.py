"""Keras 2 (`tf_keras`, or TF <= 2.15's `tf.keras`): the same exact accumulation.

Run by `make test` on the TFX 1.16 stack (tf_keras 2.16 beside Keras 3), on
TF 2.15 (Keras 2 built in) and on the newest TF with tf_keras and
TF_USE_LEGACY_KERAS=1. Every test compares against an independent reference:
the large-batch `fit` or a hand-written `GradientTape` loop.
"""

import importlib.util
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator import accumulator
from tfx_gradient_accumulator.accumulator import GradientAccumulator, hooks
from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow
from tests import deltas, saved_0_3, sweeps

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICES = ["/cpu:0", "/cpu:1"]


def data(samples=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.1 * rng.normal(size=(samples, 1))).astype("float32")
    return x, y


def mlp(seed=0, dtype=None):
    k2.utils.set_random_seed(seed)
    return k2.Sequential([
        k2.layers.Dense(8, activation="tanh", input_shape=(5,), dtype=dtype),
        k2.layers.Dense(1, dtype=dtype if dtype != "mixed_float16" else "float32"),
    ])


def fit_pair(make_inner, accum=4, micro=8, samples=64, epochs=2, loss="mse", sample_weight=None,
             jit_compile=None, **fit):
    """(accumulated model, large-batch model), trained from the same start."""
    x, y = data(samples)
    runs = []
    for optimizer, batch in ((GradientAccumulator(make_inner(), accum_steps=accum), micro),
                             (make_inner(), micro * accum)):
        model = mlp()
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
        model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0,
                  sample_weight=sample_weight, **fit)
        runs.append(model)
    return runs


# ------------------------------------------------------------------ one name
def test_one_name_picks_the_keras_2_class_from_the_optimizer():
    optimizer = GradientAccumulator(k2.optimizers.Adam(), accum_steps=4)
    assert type(optimizer).__module__ == "tfx_gradient_accumulator.accumulator.keras2"
    assert isinstance(optimizer, k2.optimizers.Optimizer) and isinstance(optimizer, AccumulationWindow)
    assert optimizer.accum_steps == 4 and optimizer.inner_optimizer.__class__.__name__ == "Adam"


def test_the_package_name_picks_the_keras_2_class():
    # What the seed project's users import instead of `GradientAccumulator.accumulator`.
    from tfx_gradient_accumulator import GradientAccumulator as TopName

    wrapped = TopName(k2.optimizers.Adam(1e-3), accum_steps=4)
    assert isinstance(wrapped, AccumulationWindow) and wrapped.accum_steps == 4
    assert type(wrapped).__module__ == "tfx_gradient_accumulator.accumulator.keras2"


@pytest.mark.skipif(not flavours.tf_keras_is_keras2(), reason="tf.keras is Keras 3 here")
def test_tf_keras_optimizers_and_names_get_the_keras_2_class():
    assert type(GradientAccumulator(tf.keras.optimizers.SGD(), accum_steps=2)).__module__ == "tfx_gradient_accumulator.accumulator.keras2"
    assert type(GradientAccumulator("adam", accum_steps=2)).__module__ == "tfx_gradient_accumulator.accumulator.keras2"


def test_legacy_optimizers_are_refused_with_the_class_to_use():
    with pytest.raises(TypeError, match=r"optimizers\.Adam` instead of .*legacy\.Adam"):
        GradientAccumulator(k2.optimizers.legacy.Adam(), accum_steps=2)


@pytest.mark.parametrize("bad, match", [(0, "accum_steps"), (2.5, "accum_steps")])
def test_bad_accum_steps_are_refused_naming_the_parameter(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        GradientAccumulator(k2.optimizers.SGD(), accum_steps=bad)


def test_keras_own_hooks_are_installed_on_the_keras_2_model():
    assert {"keras2_fit", "keras2_compute_loss"} <= set(hooks.installed_hooks())


# ------------------------------------------------------------ exactness, fit
SCHEDULE = dict(initial_learning_rate=0.05, decay_steps=2, decay_rate=0.5)
INNERS = {
    "sgd_momentum": lambda: k2.optimizers.SGD(0.05, momentum=0.9),
    "adam_schedule": lambda: k2.optimizers.Adam(k2.optimizers.schedules.ExponentialDecay(**SCHEDULE)),
    "adam_clipnorm": lambda: k2.optimizers.Adam(0.01, clipnorm=0.05),
    "adam_global_clipnorm": lambda: k2.optimizers.Adam(0.01, global_clipnorm=0.05),
    "adamw_weight_decay": lambda: k2.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop_ema": lambda: k2.optimizers.RMSprop(0.01, use_ema=True, ema_momentum=0.5),
}


@pytest.mark.parametrize("name", sorted(INNERS))
def test_fit_matches_the_large_batch(name):
    accumulated, large = fit_pair(INNERS[name])
    assert int(accumulated.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 4
    assert deltas.max_abs_diff(accumulated.get_weights(), large.get_weights()) < 1e-5


def test_uneven_micro_batches_and_sample_weights_are_weighted_exactly():
    # 60 samples: windows of 8+8+8+8 and 8+8+8+4; the large batch's last batch holds 28.
    weights = np.random.default_rng(1).uniform(0.2, 2.0, size=60).astype("float32")
    accumulated, large = fit_pair(lambda: k2.optimizers.SGD(0.1), samples=60, epochs=1, sample_weight=weights)
    assert int(accumulated.optimizer.iterations.numpy()) == 2
    assert deltas.max_abs_diff(accumulated.get_weights(), large.get_weights()) < 1e-5


@pytest.mark.parametrize("name", ["adam_schedule", "adamw_weight_decay"])
def test_xla_compiled_fit_matches_the_compiled_large_batch(name):
    # What a GPU's jit_compile runs; XLA compiles the same ops on CPU. 60 samples:
    # uneven windows and a short last batch, both sides compiled.
    accumulated, large = fit_pair(INNERS[name], samples=60, jit_compile=True)
    assert accumulated.jit_compile is True
    assert int(accumulated.optimizer.iterations.numpy()) == 4
    assert deltas.max_abs_diff(accumulated.get_weights(), large.get_weights()) < 1e-5


def test_partial_window_drop_discards_and_carry_holds():
    x, y = data(40)          # 5 micro-batches of 8 at accum 2: one left over each epoch
    for mode, updates, held in (("drop", 2, 0), ("carry", 2, 1)):
        model = mlp()
        model.compile(GradientAccumulator(k2.optimizers.SGD(0.1), accum_steps=2, partial_window=mode), loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        assert int(model.optimizer.iterations.numpy()) == updates
        assert int(model.optimizer.micro_step.numpy()) == held


# -------------------------------------------------------- exactness, custom
def _tape_reference(model, optimizer, x, y, batch):
    for start in range(0, len(x), batch):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[start:start + batch]) - y[start:start + batch]))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))


def test_custom_tape_loop_matches_a_hand_written_large_batch_loop():
    x, y = data(64)
    model, reference = mlp(), mlp()
    optimizer = GradientAccumulator(k2.optimizers.Adam(0.01), accum_steps=4)

    @tf.function
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb) - yb))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    for start in range(0, 64, 4):
        micro_step(x[start:start + 4], y[start:start + 4])
    _tape_reference(reference, k2.optimizers.Adam(0.01), x, y, 16)
    assert int(optimizer.iterations.numpy()) == 4
    assert deltas.max_abs_diff(model.get_weights(), reference.get_weights()) < 1e-5


def test_none_and_sparse_gradients():
    # An embedding (IndexedSlices gradients) and a variable no loss touches (None).
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 20, size=(32, 3))
    targets = rng.normal(size=(32, 1)).astype("float32")

    def make():
        k2.utils.set_random_seed(0)
        embedding = k2.layers.Embedding(20, 4)
        dense = k2.layers.Dense(1)
        unused = k2.layers.Dense(1)
        embedding.build((None, 3))
        dense.build((None, 4))
        unused.build((None, 2))
        return embedding, dense, unused

    results = []
    for micro, accum in ((4, 4), (16, 1)):
        embedding, dense, unused = make()
        variables = embedding.trainable_variables + dense.trainable_variables + unused.trainable_variables
        inner = k2.optimizers.Adam(0.05)
        optimizer = GradientAccumulator(inner, accum_steps=accum) if accum > 1 else inner
        for start in range(0, 32, micro):
            with tf.GradientTape() as tape:
                out = dense(tf.reduce_mean(embedding(ids[start:start + micro]), axis=1))
                loss = tf.reduce_mean(tf.square(out - targets[start:start + micro]))
            grads = tape.gradient(loss, variables)
            assert isinstance(grads[0], tf.IndexedSlices) and grads[-1] is None
            optimizer.apply_gradients(zip(grads, variables))
        results.append([v.numpy() for v in variables])
        if accum > 1:
            # The table's window state is its rows (3 ids x 4 samples x 4 micro-batches),
            # not a dense buffer of the table (a one-row stand-in).
            assert int(tf.size(optimizer.accumulators[0])) == 4
            assert int(tf.shape(optimizer.window_rows[0].values)[0]) == 3 * micro * accum
    assert deltas.max_abs_diff(*results) < 1e-5


# ------------------------------------------------------------ mixed precision
def test_mixed_float16_keeps_loss_scaling_inside_the_window():
    x, y = data(64)
    k2.mixed_precision.set_global_policy("mixed_float16")
    try:
        runs = []
        for accumulate in (True, False):
            model = mlp()
            inner = k2.mixed_precision.LossScaleOptimizer(k2.optimizers.SGD(0.05), initial_scale=256.0)
            optimizer = GradientAccumulator(inner, accum_steps=4) if accumulate else inner
            model.compile(optimizer, loss="mse")
            # Keras 2's compile wraps any optimizer that is not a LossScaleOptimizer: not ours.
            assert model.optimizer is optimizer
            model.fit(x, y, batch_size=8 if accumulate else 32, epochs=1, shuffle=False, verbose=0)
            runs.append(model)
    finally:
        k2.mixed_precision.set_global_policy("float32")
    assert isinstance(runs[0].optimizer, k2.mixed_precision.LossScaleOptimizer)
    assert int(runs[0].optimizer.iterations.numpy()) == 2
    assert deltas.max_abs_diff(runs[0].get_weights(), runs[1].get_weights()) < 2e-3


def test_a_non_finite_micro_batch_skips_its_whole_window_once():
    model = mlp()
    inner = k2.mixed_precision.LossScaleOptimizer(k2.optimizers.SGD(0.1), initial_scale=1024.0)
    optimizer = GradientAccumulator(inner, accum_steps=2)
    x, y = data(8)
    variables = model.trainable_variables
    before = [v.numpy() for v in variables]
    for poison in (False, True):             # one window: a finite and an infinite micro-batch
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x[:4]) - y[:4]))
            scaled = optimizer.get_scaled_loss(loss * (np.inf if poison else 1.0))
        grads = optimizer.get_unscaled_gradients(tape.gradient(scaled, variables))
        optimizer.apply_gradients(zip(grads, variables))
    assert deltas.max_abs_diff(before, [v.numpy() for v in variables]) == 0.0
    assert float(optimizer.loss_scale.numpy()) == 512.0       # halved once, for the window
    assert int(optimizer.micro_step.numpy()) == 0


# ------------------------------------------------------------- tf.distribute
def test_mirrored_fit_matches_one_device_with_one_reduction_per_window():
    x, y = data(64)
    from tests.accumulator.reference import CountingReduction

    counter = CountingReduction()
    strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=counter)
    with strategy.scope():
        model = mlp()
        model.compile(GradientAccumulator(k2.optimizers.Adam(0.01, global_clipnorm=0.5), accum_steps=4),
                      loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)   # global micro-batch 8
    reference = mlp()
    reference.compile(k2.optimizers.Adam(0.01, global_clipnorm=0.5), loss="mse")
    reference.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    assert int(counter.count.numpy()) == 2          # one batched all-reduce per window
    assert deltas.max_abs_diff(model.get_weights(), reference.get_weights()) < 1e-5


def test_mirrored_fit_of_an_embedding_with_repeated_ids_matches_keras_2s_large_batch():
    """Sparse rows under a strategy: Keras 2 makes the window's buffers SyncOnRead
    variables, whose wrapper refuses `scatter_add` (it raised NotImplementedError)."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 20, size=(64, 5))            # 5 ids of 20 per sample: rows repeat
    y = rng.normal(size=(64, 1)).astype("float32")

    def embedding_model():
        model = k2.Sequential([k2.layers.Embedding(20, 4), k2.layers.GlobalAveragePooling1D(),
                               k2.layers.Dense(1)])
        model.build((None, 5))
        return model

    tf.random.set_seed(0)
    initial = embedding_model().get_weights()

    def fit(optimizer, batch_size):
        strategy = tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())
        with strategy.scope():
            model = embedding_model()
            model.set_weights(initial)
            model.compile(optimizer(), loss="mse")
        model.fit(ids, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    adam = lambda: k2.optimizers.Adam(0.01)
    accumulated = fit(lambda: GradientAccumulator(adam(), accum_steps=4), 8)
    large = fit(adam, 32)
    assert deltas.max_abs_diff(large, initial) > 1e-2                        # control: it trained
    assert deltas.max_abs_diff(accumulated, large) < 1e-5


# ------------------------------------------------------------------- saving
def _trained(accum=4, steps=6):
    x, y = data(64)
    model = mlp()
    model.compile(GradientAccumulator(k2.optimizers.Adam(0.01), accum_steps=accum, partial_window="carry"),
                  loss="mse")
    model.fit(x[:8 * steps], y[:8 * steps], batch_size=8, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("fmt", ["savedmodel", "h5", "keras"])
def test_saved_models_load_without_custom_objects(tmp_path, fmt):
    if fmt == "keras" and flavours.version_tuple(k2.__version__) < (2, 13):
        pytest.skip("the .keras format needs Keras >= 2.13")
    model = _trained()
    path = str(tmp_path / {"savedmodel": "model", "h5": "model.h5", "keras": "model.keras"}[fmt])
    model.save(path)
    loaded = k2.models.load_model(path)
    assert isinstance(loaded.optimizer, AccumulationWindow) and loaded.optimizer.accum_steps == 4
    assert deltas.max_abs_diff(model.get_weights(), loaded.get_weights()) == 0.0
    x, y = data(16)
    assert np.allclose(model.predict(x, verbose=0), loaded.predict(x, verbose=0))


def test_set_weights_carries_the_open_window_and_the_inner_state():
    trained = _trained(steps=6)                        # one update and 2 micro-batches held
    fresh = mlp()
    fresh.compile(GradientAccumulator(k2.optimizers.Adam(0.01), accum_steps=4, partial_window="carry"),
                  loss="mse")
    fresh.optimizer.build(fresh.trainable_variables)
    fresh.optimizer.set_weights(trained.optimizer.get_weights())
    assert int(fresh.optimizer.micro_step.numpy()) == 2 and int(fresh.optimizer.iterations.numpy()) == 1
    assert deltas.max_abs_diff(fresh.optimizer.get_weights(), trained.optimizer.get_weights()) == 0.0
    with pytest.raises(ValueError, match="must hold"):
        fresh.optimizer.set_weights(trained.optimizer.get_weights()[:-1])


def test_checkpoint_resumes_mid_window_exactly(tmp_path):
    x, y = data(64)
    uninterrupted = _trained(steps=8)                  # 8 micro-batches: 2 windows
    first = _trained(steps=6)                          # 6: one window and a half
    assert int(first.optimizer.micro_step.numpy()) == 2
    tf.train.Checkpoint(model=first, optimizer=first.optimizer).write(str(tmp_path / "ckpt"))
    resumed = mlp()
    resumed.compile(GradientAccumulator(k2.optimizers.Adam(0.01), accum_steps=4, partial_window="carry"),
                    loss="mse")
    resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).read(str(tmp_path / "ckpt")).assert_consumed()
    assert int(resumed.optimizer.micro_step.numpy()) == 2
    resumed.fit(x[48:64], y[48:64], batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(resumed.optimizer.iterations.numpy()) == 2
    assert deltas.max_abs_diff(uninterrupted.get_weights(), resumed.get_weights()) < 1e-6


# -------------------------------------------------------------- noise scale
def test_noise_scale_is_measured_and_logged_in_fit():
    x, y = data(256)
    model = mlp()
    model.compile(GradientAccumulator(k2.optimizers.SGD(0.01), accum_steps=4, measure_noise_scale=True),
                  loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0)
    logged = history.history["noise_scale"]
    assert len(logged) == 2 and all(np.isfinite(logged)) and logged[-1] == model.optimizer.noise_scale > 0


def test_an_optimizer_saved_by_version_0_3_loads_with_its_estimates():
    """As for Keras 3 (`test_noise_scale`): Adam's estimates carry over, the open window
    trains on as saved and is left out of the estimate."""
    x, y = data(96)
    runs = []
    for _ in range(2):
        model = mlp()
        model.compile(GradientAccumulator(k2.optimizers.Adam(0.01), accum_steps=4, measure_noise_scale=True,
                                          noise_scale_smoothing=0.9, partial_window="carry"), loss="mse")
        runs.append(model)
    model, loaded_model = runs
    model.fit(x[:80], y[:80], batch_size=8, shuffle=False, verbose=0)
    optimizer, loaded = model.optimizer, loaded_model.optimizer
    old = saved_0_3.in_the_0_3_layout(optimizer)
    assert len(old) == len(optimizer.variables) + 11
    loaded_model.set_weights(model.get_weights())
    loaded.build(loaded_model.trainable_variables)
    loaded.load_own_variables({str(i): value for i, value in enumerate(old)})
    for name in ("noise_scale_estimate", "preconditioned_noise_scale_estimate"):
        np.testing.assert_allclose(getattr(loaded, name).state.numpy(), getattr(optimizer, name).state.numpy(),
                                   rtol=1e-6)
    for fitted in (model, loaded_model):
        fitted.fit(x[:48], y[:48], batch_size=8, shuffle=False, verbose=0)
    assert deltas.max_abs_diff(loaded_model.get_weights(), model.get_weights()) < 1e-6
    assert (int(optimizer.noise_scale_estimate.window_count), int(loaded.noise_scale_estimate.window_count)) == (4, 3)


def test_schedule_by_update_with_sqrt_lr_scaling_equals_keras_fits_chained():
    # 3 updates of 16 samples, then 2 of 32, the schedule's LR times sqrt(2) from then on.
    from tfx_gradient_accumulator.accumulator.schedules.callbacks import window_callback_classes
    from tfx_gradient_accumulator.accumulator.schedules.lr_scaling import scaled_schedule_class
    x, y = data(112)
    decay = lambda: k2.optimizers.schedules.ExponentialDecay(1e-2, 3, 0.7)  # noqa: E731
    model = mlp()
    optimizer = GradientAccumulator(k2.optimizers.Adam(decay()), 2, schedulable=True)
    model.compile(optimizer, "mse")
    history = model.fit(x, y, batch_size=8, shuffle=False, verbose=0, callbacks=[
        window_callback_classes(k2)[1]({0: 2, 3: 4}, by="update", lr_scaling="sqrt")])
    scaled = scaled_schedule_class(k2)(decay())
    expected = mlp()
    expected.compile(k2.optimizers.Adam(scaled), "mse")
    expected.fit(x[:48], y[:48], batch_size=16, shuffle=False, verbose=0)
    scaled.multiplier.assign(2 ** 0.5)
    expected.fit(x[48:], y[48:], batch_size=32, shuffle=False, verbose=0)
    assert history.history["lr_multiplier"] == [pytest.approx(2 ** 0.5)]
    assert int(optimizer.iterations.numpy()) == 5
    assert deltas.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6
    scaled.multiplier.assign(1.0)                        # control: unscaled from the start
    control = mlp()
    control.compile(k2.optimizers.Adam(scaled), "mse")
    control.fit(x[:48], y[:48], batch_size=16, shuffle=False, verbose=0)
    control.fit(x[48:], y[48:], batch_size=32, shuffle=False, verbose=0)
    assert deltas.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-4


def test_accum_steps_auto_grows_a_keras_2_fit_and_its_schedule_replays_exactly(easy_auto):
    from tfx_gradient_accumulator.accumulator.schedules.callbacks import window_callback_classes
    x, y = data(256)
    y = y + np.random.default_rng(1).normal(size=y.shape).astype("float32")   # noisy: large B_simple
    model = mlp()
    optimizer = GradientAccumulator(k2.optimizers.SGD(0.02), accum_steps="auto", max_effective_batch_size=32,
                                    lr_scaling="linear")
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0)
    taken = optimizer.auto_accumulation.schedule
    assert len(taken) >= 2 and max(taken.values()) * 4 <= 32, taken
    replay = mlp()
    replay_optimizer = GradientAccumulator(k2.optimizers.SGD(0.02), 2, schedulable=True)
    replay.compile(replay_optimizer, "mse")
    replay.fit(x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[
        window_callback_classes(k2)[1](taken, by="update", lr_scaling="linear")])
    assert int(replay_optimizer.iterations.numpy()) == int(optimizer.iterations.numpy())
    assert deltas.max_abs_diff(replay.get_weights(), model.get_weights()) <= 1e-6
    assert optimizer.get_config()["accum_steps"] == "auto"


@pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                    reason="TF <= 2.15: tf.keras is Keras 2 without TF_USE_LEGACY_KERAS")
def test_import_accumulator_under_tf_use_legacy_keras_in_a_fresh_process():
    code = ("import tensorflow as tf; from tfx_gradient_accumulator import accumulator;"
            "o = accumulator.GradientAccumulator(tf.keras.optimizers.Adam(), accum_steps=2);"
            "print(type(o).__module__)")
    env = dict(os.environ, TF_USE_LEGACY_KERAS="1")
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "tfx_gradient_accumulator.accumulator.keras2"


def test_two_worker_fit_matches_one_device_large_batch(tmp_path):
    """MultiWorkerMirroredStrategy, 2 worker processes on 127.0.0.1, global micro-batch 16,
    accum 4, AdamW with a schedule, weight decay and global clipping."""
    from tests.accumulator import multiworker, reference
    from tests.accumulator.multiworker_worker import keras2_mlp

    micro, accum, steps = 16, 4, 32
    codes, output, result = multiworker.run_cluster(
        tmp_path / "result", "--keras2", "--micro", micro, "--accum", accum, "--steps-per-epoch", steps)
    assert codes == [0, 0], output[-3000:]
    weights, iterations = result
    x, y = reference.regression_data(micro * steps)
    model = keras2_mlp(k2, x.shape[1])
    model.compile(k2.optimizers.AdamW(k2.optimizers.schedules.ExponentialDecay(1e-2, 4, 0.5),
                                      weight_decay=0.05, global_clipnorm=0.05), loss="mse")
    model.fit(x, y, batch_size=micro * accum, epochs=1, shuffle=False, verbose=0)
    assert iterations == steps // accum == int(model.optimizer.iterations.numpy())
    assert deltas.max_abs_diff(weights, model.get_weights()) < 1e-5


# ------------------------------------------------------- saving before training
K2_INNER = sorted(name for name, cls in vars(k2.optimizers).items() if k2 is not None
                  and isinstance(cls, type) and issubclass(cls, k2.optimizers.Optimizer)
                  and name not in ("Optimizer", "LossScaleOptimizer")) if k2 is not None else []


def _saved_and_loaded(name, built, fmt, tmp_path):
    model = mlp()
    model.compile(GradientAccumulator(getattr(k2.optimizers, name)(), accum_steps=2), loss="mse")
    if built:
        model.optimizer.build(model.trainable_variables)
    assert model.optimizer._window_built() == built
    path = str(tmp_path / {"savedmodel": "model", "h5": "model.h5", "keras": "model.keras"}[fmt])
    model.save(path)
    return model, k2.models.load_model(path)


@pytest.mark.parametrize("strategy", [False, True], ids=["one-device", "mirrored"])
@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
@pytest.mark.parametrize("name", [pytest.param(name, marks=sweeps.marks(name)) for name in K2_INNER])
def test_a_model_saves_and_pickles_before_training(name, built, strategy, tmp_path):
    scope = (tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=tf.distribute.ReductionToOneDevice())
             if strategy else tf.distribute.get_strategy()).scope()
    with scope:
        model, loaded = _saved_and_loaded(name, built, "keras", tmp_path)
        assert isinstance(loaded.optimizer, AccumulationWindow) and loaded.optimizer.accum_steps == 2
        assert type(loaded.optimizer.inner_optimizer) is type(model.optimizer.inner_optimizer)
        if built:   # the built window's state round-trips value for value
            saved, restored = model.optimizer.get_weights(), loaded.optimizer.get_weights()
            assert len(restored) == len(saved) > 5 and deltas.max_abs_diff(restored, saved) == 0.0
        # pickle: as Keras 2 pickles the inner optimizer alone (its optimizers refuse:
        # they hold weak references), never the window's own error.
        outcomes = []
        for optimizer in (model.optimizer, model.optimizer.inner_optimizer):
            try:
                pickle.loads(pickle.dumps(optimizer))
                outcomes.append(None)
            except TypeError as error:
                outcomes.append(str(error))
        assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("fmt", ["savedmodel", "h5"])
def test_a_model_saved_before_training_in_the_older_formats_trains_as_the_original(fmt, tmp_path):
    x, y = data(64)
    model, loaded = _saved_and_loaded("Adam", False, fmt, tmp_path)
    initial = model.get_weights()
    for m in (model, loaded):
        m.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 4
    assert deltas.max_abs_diff(model.get_weights(), initial) > 1e-3          # control: it trained
    assert deltas.max_abs_diff(loaded.get_weights(), model.get_weights()) <= 1e-6

# ------------------------------------------------------------ TrainingBackup
class _Preempted(Exception):
    pass


def _backed_up_fit(directory, stop_after=None, every_steps=3):
    """16 micro-steps (2 epochs of 8) in windows of 4, backed up every `every_steps`;
    `stop_after`: the run dies after that many steps. Returns (model, backup, what the
    optimizer held when training began: micro-steps in its window, updates)."""
    from tfx_gradient_accumulator.accumulator.batch.backup import TrainingBackup

    x, y = data(64)
    began = {}

    class Watch(k2.callbacks.Callback):
        steps = 0

        def on_train_begin(self, logs=None):       # after the backup's own restore
            if backup.resumed_from is None:
                return                              # a fresh run: nothing built yet
            began.setdefault("window", int(self.model.optimizer.micro_step.numpy()))
            began.setdefault("updates", int(self.model.optimizer.iterations.numpy()))

        def on_train_batch_end(self, batch, logs=None):
            Watch.steps += 1
            if Watch.steps == stop_after:
                raise _Preempted()

    model = mlp()
    backup = TrainingBackup(str(directory), every_steps=every_steps)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()
    arguments = dict(x=dataset, steps_per_epoch=8, epochs=2, verbose=0, callbacks=[Watch()])
    if flavours.keras_is_3():           # beside Keras 3: the library's context, as the TFX Trainer uses it
        from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile
        with accumulating_compile(accum_steps=4, backup=backup):
            model.compile(optimizer=k2.optimizers.Adam(0.01), loss="mse")
            model.fit(**arguments)
    else:                           # TF 2.15 (no Keras 3, no accumulating_compile): the backup's own fit
        model.compile(optimizer=GradientAccumulator(k2.optimizers.Adam(0.01), accum_steps=4), loss="mse")
        backup.fit(type(model).fit, model, arguments)
    return model, backup, began


def test_training_backup_resumes_a_keras_2_fit_mid_window_exactly(tmp_path):
    """Backups at steps 3, 6, 8 (the epoch's end) and 11; killed after step 13. The backup in
    force is step 11 (epoch 1, 3 steps in): 2 updates and 3 micro-batches held in the window.
    The restarted fit restores it (weights, Adam's slots, the window's sums and count) and
    trains the 5 steps left."""
    uninterrupted, _, _ = _backed_up_fit(tmp_path / "whole")
    with pytest.raises(_Preempted):
        _backed_up_fit(tmp_path / "run", stop_after=13)
    resumed, backup, began = _backed_up_fit(tmp_path / "run")
    assert {k: backup.resumed_from[k] for k in ("epoch", "batch", "steps", "updates")} == {
        "epoch": 1, "batch": 3, "steps": 11, "updates": 2}
    assert began == {"window": 3, "updates": 2}                     # mid-window, as backed up
    assert type(resumed.optimizer).__module__ == "tfx_gradient_accumulator.accumulator.keras2"
    assert int(resumed.optimizer.iterations.numpy()) == int(uninterrupted.optimizer.iterations.numpy()) == 4
    assert deltas.max_abs_diff(resumed.get_weights(), uninterrupted.get_weights()) == 0.0
    assert deltas.max_abs_diff(resumed.optimizer.get_weights(), uninterrupted.optimizer.get_weights()) == 0.0


# ------------------------------------------------- one encoder called twice (a sentence pair)
def _pair_model(seed=0):
    """One encoder for both sentences: token and position tables, and a token-type table
    looked up with zeros like the ids (BERT's segment ids), called twice."""
    k2.utils.set_random_seed(seed)
    tokens, types = k2.layers.Embedding(30, 8), k2.layers.Embedding(2, 8)
    positions, dense = k2.layers.Embedding(6, 8), k2.layers.Dense(8, activation="tanh")

    def encode(ids):
        hidden = tokens(ids) + types(tf.zeros_like(ids)) + positions(tf.range(6))
        return tf.reduce_mean(dense(hidden), axis=1)

    anchor, positive = k2.Input((6,), dtype="int32"), k2.Input((6,), dtype="int32")
    similarity = k2.layers.Dot(axes=1, normalize=True)([encode(anchor), encode(positive)])
    return k2.Model([anchor, positive], similarity)


@pytest.mark.parametrize("make_inner", [lambda: k2.optimizers.Adam(1e-2),
                                        lambda: k2.optimizers.SGD(0.5, global_clipnorm=0.05)],
                         ids=["adam", "sgd-global_clipnorm"])
def test_one_encoder_called_twice_keeps_its_token_type_rows_apart(make_inner):
    # Keras 2 merges repeated rows before Adam, so only clipping (which reads the rows as
    # they stand) told the token-type table's rows summed across the window from apart.
    rng = np.random.default_rng(0)
    anchor = rng.integers(0, 30, (128, 6)).astype("int32")
    x = [anchor, np.where(rng.random((128, 6)) < 0.7, anchor, rng.integers(0, 30, (128, 6))).astype("int32")]
    y = rng.random((128, 1)).astype("float32")
    runs = []
    for optimizer, batch in ((GradientAccumulator(make_inner(), accum_steps=4), 8), (make_inner(), 32)):
        model = _pair_model()
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        runs.append(model)
    assert deltas.max_abs_diff(runs[1].get_weights(), _pair_model().get_weights()) > 1e-3
    assert deltas.max_abs_diff(runs[0].get_weights(), runs[1].get_weights()) < 1e-5
    kinds = runs[0].optimizer.gradient_kinds
    assert sorted(kinds[table] for table in kinds if "rows" in kinds[table]) == ["rows", "rows"], kinds

