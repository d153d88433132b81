"""Save, load and resume: the open window survives, nothing counts twice."""

import json
import os
import sys

import numpy as np
import pytest
import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests import fork_server
from tests.accumulator import reference as ref

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MICRO = 8
ACCUM = 4


def _optimizer(partial_window="apply"):
    return GradientAccumulator(
        keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 4, 0.7), clipnorm=0.2),
        accum_steps=ACCUM,
        partial_window=partial_window,
    )


def _compiled(seed=0, partial_window="apply"):
    model = ref.mlp(seed)
    model.compile(optimizer=_optimizer(partial_window), loss="mse")
    return model


_FRESH_PROCESS = """
import json, sys, traceback
import numpy as np, keras
paths = json.loads(sys.argv[1])
# First, the library not imported: what load_model does then (the saving docs).
try:
    without = {"loaded": type(keras.models.load_model(paths["plain"]).optimizer).__name__}
except Exception:
    without = {"error": traceback.format_exc()}
from tfx_gradient_accumulator import accumulator  # registers the class: no custom_objects needed
model = keras.models.load_model(paths["mid_window"])
opt = model.optimizer
info = dict(cls=type(opt).__name__, accum=opt.accum_steps, micro=int(opt.micro_step.numpy()),
            inner=opt.inner_optimizer.get_config()['clipnorm'],
            acc_nonzero=bool(any(np.any(a.numpy()) for a in opt.accumulators)))
data = np.load(paths["rest"])
model.fit(data['x'], data['y'], batch_size=%d, shuffle=False, verbose=0)
np.savez(paths["out"], *model.get_weights())
print(json.dumps(dict(info=info, without=without)))
""" % MICRO


@pytest.fixture(scope="module")
def fresh_process(tmp_path_factory):
    """One new Python process for the two tests below (a TensorFlow import each saved): it
    loads a trained model's file before the library is imported, then imports the library
    and loads a model saved 2 micro-batches into a window, and trains it on."""
    folder = tmp_path_factory.mktemp("fresh_process")
    paths = {"plain": str(folder / "plain.keras"), "mid_window": str(folder / "mid_window.keras"),
             "rest": str(folder / "rest.npz"), "out": str(folder / "out.npz")}
    x, y = ref.regression_data(MICRO * 16)
    first = MICRO * 6   # stop 2 micro-batches into a window
    model = _compiled(partial_window="carry")   # training goes on in the other process
    model.fit(x[:first], y[:first], batch_size=MICRO, shuffle=False, verbose=0)
    assert int(model.optimizer.micro_step.numpy()) == 2
    model.save(paths["mid_window"])
    np.savez(paths["rest"], x=x[first:], y=y[first:])
    plain = _compiled()
    plain.fit(x[:MICRO * 4], y[:MICRO * 4], batch_size=MICRO, shuffle=False, verbose=0)
    plain.save(paths["plain"])
    # Outside the checkout's root: nothing but the installed package is importable by name.
    # Forked from a process that has imported TensorFlow and Keras, not the library (tests/fork_server.py).
    out = fork_server.run([sys.executable, "-c", _FRESH_PROCESS, json.dumps(paths)], cwd=folder,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"), capture_output=True, timeout=300)
    return out, paths


def test_keras_file_loads_in_a_fresh_process_without_custom_objects(fresh_process):
    out, paths = fresh_process
    assert out.returncode == 0, out.stderr[-3000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])["info"]
    assert info == dict(cls="GradientAccumulator", accum=ACCUM, micro=2, inner=0.2, acc_nonzero=True)
    x, y = ref.regression_data(MICRO * 16)
    uninterrupted = _compiled()
    uninterrupted.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    resumed = np.load(paths["out"])
    resumed = [resumed[f"arr_{i}"] for i in range(len(resumed.files))]
    assert ref.max_abs_diff(resumed, uninterrupted.get_weights()) <= 1e-6


# Keras 3.9 stopped importing the module a saved class names, unless it is Keras' own.
KERAS_IMPORTS_SAVED_MODULES = tuple(int(p) for p in keras.version().split(".")[:2]) < (3, 9)


def test_loading_without_the_library_imported_fails_naming_the_module_to_import(fresh_process):
    """What the saving docs tell the user: `load_model` needs the library imported first, and
    Keras' error names the module (docs/guide/index.md, "Saving"); Keras before 3.9 imports
    it itself."""
    out, _ = fresh_process
    assert out.returncode == 0, out.stderr[-3000:]
    without = json.loads(out.stdout.strip().splitlines()[-1])["without"]
    if KERAS_IMPORTS_SAVED_MODULES:
        assert without == {"loaded": "GradientAccumulator"}, without
        return
    assert "error" in without, without
    assert "Could not locate class 'GradientAccumulator'" in without["error"], without["error"][-3000:]
    assert "'module': 'tfx_gradient_accumulator.accumulator.optimizer'" in without["error"], without["error"][-3000:]


def test_tf_train_checkpoint_mid_window_resumes_exactly(tmp_path):
    x, y = ref.regression_data(MICRO * 18)
    loss_fn = keras.losses.MeanSquaredError()

    def train(model, optimizer, start, stop):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        for i in range(start, stop):
            step(x[i * MICRO:(i + 1) * MICRO], y[i * MICRO:(i + 1) * MICRO])

    uninterrupted, opt_u = ref.mlp(), _optimizer()
    train(uninterrupted, opt_u, 0, 18)

    model, opt = ref.mlp(), _optimizer()
    opt.build(model.trainable_variables)
    train(model, opt, 0, 7)  # window 2 holds 3 micro-batches
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(str(tmp_path / "ckpt"))

    restored, opt_r = ref.mlp(seed=1), _optimizer()  # different init: must be overwritten
    opt_r.build(restored.trainable_variables)
    tf.train.Checkpoint(model=restored, optimizer=opt_r).restore(path).assert_consumed()
    assert int(opt_r.micro_step.numpy()) == 3
    assert int(opt_r.iterations.numpy()) == 1
    train(restored, opt_r, 7, 18)
    assert ref.max_abs_diff(restored.get_weights(), uninterrupted.get_weights()) <= 1e-6


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("simulated preemption")


@pytest.mark.parametrize("partial_window, updates", [   # apply's apart (30 s): carry keeps the open window
    ("carry", 10), pytest.param("apply", 12, marks=pytest.mark.apart)])             # across the epoch end too
def test_backup_and_restore_keeps_the_open_window(partial_window, updates, tmp_path):
    # 10 micro-batches an epoch, windows of 4: epoch 0 ends 2 micro-batches into
    # a window, which the backup holds ("carry") or which is applied ("apply").
    x, y = ref.regression_data(MICRO * 10)
    uninterrupted = _compiled(partial_window=partial_window)
    uninterrupted.fit(x, y, batch_size=MICRO, epochs=4, shuffle=False, verbose=0)

    backup = str(tmp_path / "backup")
    model = _compiled(partial_window=partial_window)
    try:
        model.fit(x, y, batch_size=MICRO, epochs=4, shuffle=False, verbose=0,
                  callbacks=[keras.callbacks.BackupAndRestore(backup), _Interrupt(1, 6)])
    except RuntimeError:
        pass
    assert os.path.exists(backup)

    resumed = _compiled(seed=1, partial_window=partial_window)
    seen = []
    resumed.fit(x, y, batch_size=MICRO, epochs=4, shuffle=False, verbose=0,
                callbacks=[keras.callbacks.BackupAndRestore(backup),
                           keras.callbacks.LambdaCallback(on_epoch_begin=lambda e, l: seen.append(e))])
    assert seen == [1, 2, 3]
    assert int(resumed.optimizer.iterations.numpy()) == updates
    assert ref.max_abs_diff(resumed.get_weights(), uninterrupted.get_weights()) <= 1e-6


def test_a_scheduled_accum_steps_survives_saving_and_restoring(tmp_path):
    from tfx_gradient_accumulator.accumulator.schedules.callbacks import AccumulationSchedule
    x, y = ref.regression_data(MICRO * 8)
    model = ref.mlp()
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.05), 2, schedulable=True), "mse")
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
              callbacks=[AccumulationSchedule({0: 2, 1: 4})])
    assert model.optimizer.accum_steps == 4
    model.save(tmp_path / "model.keras")
    path = tf.train.Checkpoint(optimizer=model.optimizer).save(str(tmp_path / "ckpt"))

    loaded = keras.models.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.accum_steps == 4
    assert loaded.optimizer.get_config()["accum_steps"] == 4

    fresh = GradientAccumulator(keras.optimizers.SGD(0.05), 2, schedulable=True)
    fresh.build(ref.mlp().trainable_variables)
    tf.train.Checkpoint(optimizer=fresh).restore(path).assert_existing_objects_matched()
    assert fresh.accum_steps == 4
    # It acts: 8 micro-batches in windows of 4 make 2 more updates.
    loaded.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == int(model.optimizer.iterations.numpy()) + 2


@pytest.mark.parametrize("route", ["keras_file", "checkpoint"])
# The MLP's apart (6 s both routes): the embedding model's cases restore a Dense layer's sums
# (its one-row bias) beside the table's rows, on both routes.
@pytest.mark.parametrize("name", [pytest.param("mlp", marks=pytest.mark.apart), "embedding"])
def test_a_restored_open_window_closes_at_once_like_the_one_saved(name, route, tmp_path):
    """A window saved open (2 of 4 micro-batches held), restored into a process that has
    not trained yet (a fresh model: which variables the window holds is otherwise learnt
    as steps are traced), then `close_partial_window("apply")` before any step: the same
    update as closing the saved window itself. Embedding: its rows, dense: its sums (with a
    one-row bias). It used to fail ("No gradients provided for any variable")."""
    build, (x, y) = ((ref.embedding_model, ref.token_data(MICRO * 2)) if name == "embedding"
                     else (ref.mlp, ref.regression_data(MICRO * 2)))

    def compiled():
        model = build()
        model.compile(optimizer=_optimizer("carry"), loss="mse")
        return model

    saved = compiled()
    saved.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert saved.optimizer.held_micro_batches == 2
    if route == "keras_file":
        saved.save(tmp_path / "model.keras")
        restored = keras.models.load_model(tmp_path / "model.keras")
    else:
        path = tf.train.Checkpoint(model=saved, optimizer=saved.optimizer).save(str(tmp_path / "ckpt"))
        restored = compiled()
        restored.optimizer.build(restored.trainable_variables)
        tf.train.Checkpoint(model=restored, optimizer=restored.optimizer).restore(path).assert_consumed()
    assert restored.optimizer.held_micro_batches == 2
    before = restored.get_weights()
    assert saved.optimizer.close_partial_window("apply") == 2
    assert restored.optimizer.close_partial_window("apply") == 2
    assert ref.max_abs_diff(restored.get_weights(), before) > 1e-3              # it applied
    assert ref.max_abs_diff(restored.get_weights(), saved.get_weights()) == 0.0
    assert int(restored.optimizer.iterations.numpy()) == int(saved.optimizer.iterations.numpy()) == 1
