"""TrainingBackup: a `fit` interrupted mid-window resumes at its step, exactly.

The interruption here is an exception from a callback at a given step (the
process-level SIGKILL tests are in tests/components/test_cluster.py); the
resumed run builds a new model and optimizer, as a restarted process does.
"""

import functools
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, hooks
from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile
from tfx_gradient_accumulator.accumulator.batch.backup import LATEST, TrainingBackup
from tests.accumulator import reference as ref

MICRO, ACCUM = 8, 4


class Interrupted(Exception):
    pass


class _StopAt(keras.callbacks.Callback):
    """Interrupts training after `step` steps (counted over all epochs)."""

    def __init__(self, step):
        super().__init__()
        self.step, self.seen = step, 0

    def on_train_batch_end(self, batch, logs=None):
        self.seen += 1
        if self.seen == self.step:
            raise Interrupted(f"interrupted after step {self.step}")


def _model(embedding=False):
    model = ref.embedding_model() if embedding else ref.mlp()
    inner = keras.optimizers.Adam(1e-2) if embedding else keras.optimizers.AdamW(
        keras.optimizers.schedules.ExponentialDecay(1e-2, 3, 0.6), weight_decay=0.05, global_clipnorm=0.1)
    model.compile(optimizer=GradientAccumulator(inner, ACCUM), loss="mse")
    return model


def _dataset(samples, repeat, embedding=False):
    x, y = ref.token_data(samples) if embedding else ref.regression_data(samples)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    return dataset.repeat() if repeat else dataset


def _fit(model, dataset, steps, epochs, callbacks=()):
    model.fit(dataset, steps_per_epoch=steps, epochs=epochs, verbose=0, callbacks=list(callbacks))
    return model


@functools.lru_cache(maxsize=None)
def _uninterrupted(samples, repeat, steps, epochs, embedding=False):
    """The uninterrupted run's (weights, updates): a case below and the control share one."""
    model = _fit(_model(embedding), _dataset(samples, repeat, embedding), steps, epochs)
    return model.get_weights(), int(model.optimizer.iterations.numpy())


# The second case apart (13 s): the finite data's case resumes mid-epoch too and runs the
# epoch after it; repeated data is the TFX shape's.
@pytest.mark.parametrize("repeat, steps, epochs, stop_at, embedding", [
    (True, 22, 1, 13, False),    # the TFX shape: one epoch of train_steps; killed 1 micro-batch into a window
    pytest.param(True, 10, 3, 17, False, marks=pytest.mark.apart),   # the interrupted epoch, then the epochs after it
    (False, None, 3, 15, False),  # finite data, 9 micro-batches an epoch: the epoch restarts the data
    (True, 10, 2, 14, True),     # embedding: the window's rows are in the backup
])
def test_interrupted_fit_resumes_with_the_weights_of_the_uninterrupted_one(
        repeat, steps, epochs, stop_at, embedding, tmp_path):
    samples = MICRO * (9 if not repeat else 11)
    expected_weights, expected_updates = _uninterrupted(samples, repeat, steps, epochs, embedding)
    directory = str(tmp_path / "backup")
    with hooks.fits_backed_up(TrainingBackup(directory, every_steps=ACCUM * 2 + 1)):   # mid-window backups
        with pytest.raises(Interrupted):
            _fit(_model(embedding), _dataset(samples, repeat, embedding), steps, epochs, [_StopAt(stop_at)])
    backup = TrainingBackup(directory, every_steps=ACCUM * 2 + 1)     # as a restarted process makes it
    saved = backup.latest()
    assert 0 < saved["steps"] < stop_at
    with hooks.fits_backed_up(backup):
        resumed = _fit(_model(embedding), _dataset(samples, repeat, embedding), steps, epochs)
    assert backup.resumed_from["steps"] == saved["steps"] and backup.resumed_from["resumes"] == 1
    assert int(resumed.optimizer.iterations.numpy()) == expected_updates
    print(f"[measured] resumed: max |dw| = {ref.max_abs_diff(resumed.get_weights(), expected_weights):.1e}")
    assert ref.max_abs_diff(resumed.get_weights(), expected_weights) <= 1e-6


@pytest.mark.apart   # a control of Keras' own callback, not of ours (48 s)
def test_control_keras_backup_and_restore_counts_the_interrupted_epochs_steps_twice(tmp_path):
    """Keras' own callback resumes the epoch from its first batch: not exact."""
    dataset = _dataset(MICRO * 11, repeat=True)
    expected_weights, expected_updates = _uninterrupted(MICRO * 11, True, 22, 1)
    callback = keras.callbacks.BackupAndRestore(str(tmp_path / "keras"), save_freq=ACCUM * 2 + 1)
    with pytest.raises(Interrupted):
        _fit(_model(), dataset, 22, 1, [callback, _StopAt(13)])
    resumed = _fit(_model(), dataset, 22, 1, [callback])
    print(f"[measured] Keras BackupAndRestore resumed: max |dw| = "
          f"{ref.max_abs_diff(resumed.get_weights(), expected_weights):.1e}")
    assert int(resumed.optimizer.iterations.numpy()) > expected_updates
    assert ref.max_abs_diff(resumed.get_weights(), expected_weights) > 1e-3


def test_a_backup_is_in_force_only_once_written_whole(tmp_path):
    backup = TrainingBackup(str(tmp_path / "backup"), every_steps=4)
    with hooks.fits_backed_up(backup):
        with pytest.raises(Interrupted):
            _fit(_model(), _dataset(MICRO * 11, True), 22, 1, [_StopAt(13)])
    assert backup.latest()["steps"] == 12
    assert sorted(os.listdir(tmp_path / "backup")) == [LATEST, "step-12-epoch-0-12", "step-8-epoch-0-8"]  # two kept
    # A save killed after its folder was begun: `latest` still names the whole one.
    os.makedirs(tmp_path / "backup" / "step-16-epoch-0-16")
    assert backup.latest()["steps"] == 12
    backup.remove()
    assert not os.path.exists(tmp_path / "backup")


def test_accumulating_compile_backs_up_the_fit_of_unchanged_training_code(tmp_path):
    def training_code(callbacks=()):
        model = ref.mlp()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return _fit(model, _dataset(MICRO * 11, True), 20, 1, callbacks)

    with accumulating_compile(ACCUM):
        expected = training_code()
    with accumulating_compile(ACCUM, backup=TrainingBackup(str(tmp_path / "backup"), every_steps=6)):
        with pytest.raises(Interrupted):
            training_code([_StopAt(9)])
    backup = TrainingBackup(str(tmp_path / "backup"), every_steps=6)
    with accumulating_compile(ACCUM, backup=backup):
        resumed = training_code()
    assert backup.resumed_from["steps"] == 6
    assert ref.max_abs_diff(resumed.get_weights(), expected.get_weights()) <= 1e-6


def test_what_a_backup_cannot_resume_is_refused_before_training(tmp_path):
    backup = TrainingBackup(str(tmp_path / "backup"), every_steps=4)
    x, y = ref.regression_data(64)
    with hooks.fits_backed_up(backup):
        with pytest.raises(ValueError, match="tf.data.Dataset"):
            _model().fit(x, y, batch_size=MICRO, verbose=0)
        with pytest.raises(ValueError, match="needs `steps_per_epoch`"):
            _model().fit(_dataset(64, True), verbose=0)
        with pytest.raises(ValueError, match="fewer than steps_per_epoch x epochs"):
            _fit(_model(), _dataset(64, False), 5, 2)
        model = _model()
        _fit(model, _dataset(64, True), 2, 1)
        with pytest.raises(ValueError, match="a second time"):
            _fit(model, _dataset(64, True), 2, 1)
    other = TrainingBackup(str(tmp_path / "other"), every_steps=2)
    with hooks.fits_backed_up(other):
        with pytest.raises(Interrupted):
            _fit(_model(), _dataset(64, True), 6, 1, [_StopAt(3)])
    with hooks.fits_backed_up(TrainingBackup(str(tmp_path / "other"), every_steps=2)):
        with pytest.raises(ValueError, match="resumes only the same training"):
            _fit(_model(), _dataset(64, True), 7, 1)
    assert not np.isnan(model.get_weights()[0]).any()
    with pytest.raises(ValueError, match="every_steps"):
        TrainingBackup(str(tmp_path), every_steps=0)


def test_a_gradient_cache_run_resumes_exactly(tmp_path):
    """In-batch negatives: each step is a whole batch in micro-batches; the backup is the model's and Adam's."""
    from tfx_gradient_accumulator.accumulator import GradientCache
    from tests.accumulator import contrastive_models as cm

    data = tf.data.Dataset.from_tensor_slices(cm.interactions(64 * 6)).batch(64)   # finite: 6 steps an epoch

    def train(callbacks=()):
        model = GradientCache(cm.built("two_tower"), accum_steps=4)
        model.compile(optimizer=keras.optimizers.Adam(1e-2))
        model.fit(data, epochs=2, verbose=0, callbacks=list(callbacks))
        return model

    expected = train()
    with hooks.fits_backed_up(TrainingBackup(str(tmp_path / "backup"), every_steps=2)):
        with pytest.raises(Interrupted):
            train([_StopAt(9)])
    backup = TrainingBackup(str(tmp_path / "backup"), every_steps=2)
    with hooks.fits_backed_up(backup):
        resumed = train()
    assert (backup.resumed_from["epoch"], backup.resumed_from["batch"]) == (1, 2)   # step 8: 2 into epoch 2
    assert ref.max_abs_diff(resumed.get_weights(), expected.get_weights()) <= 1e-6
