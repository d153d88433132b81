"""`TrainingBackup`: backs a `fit` up to a directory and resumes it at its step.

Keras' `BackupAndRestore` resumes at an epoch; a run resumed from a
`TrainingBackup` ends with the weights of the uninterrupted run.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.schedules.auto_batch import auto_rule_of
from tfx_gradient_accumulator.accumulator.core.validation import integer_at_least

logger = logging.getLogger(__name__)

LATEST = "latest"
WEIGHTS = "state.weights.h5"
KERAS2_WEIGHTS = "state"            # a TensorFlow checkpoint: state.index, state.data-*
PROGRESS = "progress.json"
KEEP = 2


class TrainingBackup:
    """Saves `fit`'s state every `every_steps` steps to `directory` and resumes there.

    The model's and the optimizer's state (weights, slots, the accumulator's
    window: its sums, rows, counts) is saved with the position (epoch, step in
    the epoch, steps in all) every `every_steps` fit steps and at every epoch's
    end, after the epoch's window is closed. Each backup is a new folder that
    the file `latest` names only once it is written whole; two are kept. The
    next `fit` with the same arguments restores the latest backup when
    training begins and skips the data already trained: a repeated
    `tf.data.Dataset` (`fit(..., steps_per_epoch=k)`, the TFX way) skips the
    steps done, a finite one the steps of the interrupted epoch. That epoch
    runs to its own end, then the rest as asked; with data in a fixed order
    (no shuffle, or a seeded one that does not reshuffle) the weights are those
    of the uninterrupted run.

    Under `MultiWorkerMirroredStrategy` every worker saves (reading the
    window's rows is a collective) and reads the chief's backup; only the
    chief writes to `directory`, which every worker must read (a bucket on a
    cluster). One `fit` per run. A Keras 3 model is saved with `save_weights`
    (`.weights.h5`), a Keras 2 one as a TensorFlow checkpoint.

    After the `fit`, `resumed_from` is the progress it resumed from (a dict
    with `epoch`, `batch`, `steps`, `updates`, `resumes`), or None for a fresh
    run; `remove()` deletes the backups once the run's outputs are safe.

    Args:
        directory: where the backups go (local or `gs://`); one run's alone.
        every_steps: fit steps (micro-steps) between backups; epoch ends
            are backed up too.
        chief: whether this process writes the backups (the chief of a
            multi-worker cluster; True on one machine).

    Raises:
        ValueError: `directory` is empty or not a string, or `every_steps` < 1.
        TypeError: `every_steps` is not an integer.
    """

    def __init__(self, directory: str, every_steps: int, chief: bool = True):
        if not directory or not isinstance(directory, str):
            raise ValueError(f"`directory` must be a non-empty path; received {directory!r}.")
        self.directory = directory
        self.every_steps = integer_at_least(every_steps, "every_steps")
        self.chief = bool(chief)
        self.resumed_from = None
        self._fits = 0

    # ------------------------------------------------------------ the files
    def latest(self) -> dict | None:
        """The backup in force.

        Returns:
            Its progress (`epoch`, `batch`, `steps`, `updates`, `resumes`, `fit`,
            `callback_states`, and `path`, its folder), or None when there is none.
        """
        pointer = os.path.join(self.directory, LATEST)
        if not tf.io.gfile.exists(pointer):
            return None
        with tf.io.gfile.GFile(pointer) as f:
            name = f.read().strip()
        with tf.io.gfile.GFile(os.path.join(self.directory, name, PROGRESS)) as f:
            progress = json.load(f)
        progress["path"] = os.path.join(self.directory, name)
        return progress

    def save(self, model: keras.Model, progress: dict) -> None:
        """Writes a backup of `model` at `progress`.

        Every worker calls it: reading the window's rows is a collective. A
        worker other than the chief writes to a temporary folder, removed at once.

        Args:
            model: the model being trained (Keras 3 or Keras 2).
            progress: the position and what a resume restores (`epoch`, `batch`,
                `steps`, `updates`, `resumes`, `fit`, `callback_states`).
        """
        # Named by the position, so a save never rewrites the backup in force (an epoch's
        # end can follow a backup at the same step).
        name = f"step-{progress['steps']}-epoch-{progress['epoch']}-{progress['batch']}"
        if self.chief:
            target = os.path.join(self.directory, name)
            if tf.io.gfile.exists(target):       # a save of this position killed before `latest` named it
                tf.io.gfile.rmtree(target)
            tf.io.gfile.makedirs(target)
        else:
            target = tempfile.mkdtemp()
        model.save_weights(os.path.join(target, _weights_file(model)))
        if not self.chief:
            shutil.rmtree(target, ignore_errors=True)
            return
        with tf.io.gfile.GFile(os.path.join(target, PROGRESS), "w") as f:
            json.dump(progress, f, sort_keys=True)
        pointer = os.path.join(self.directory, LATEST)
        with tf.io.gfile.GFile(pointer + ".tmp", "w") as f:
            f.write(os.path.basename(target))
        tf.io.gfile.rename(pointer + ".tmp", pointer, overwrite=True)
        self._prune(keep=os.path.basename(target))

    def _prune(self, keep):
        backups = sorted((int(name.rstrip("/").split("-")[1]), name.rstrip("/"))
                         for name in tf.io.gfile.listdir(self.directory) if name.startswith("step-"))
        # Oldest first; the one just written (`keep`) is never removed.
        for _, name in backups[:-KEEP]:
            if name != keep:
                tf.io.gfile.rmtree(os.path.join(self.directory, name))

    def remove(self) -> None:
        """Deletes the backups (the chief's); call it when the run's outputs are written."""
        if self.chief and tf.io.gfile.exists(self.directory):
            tf.io.gfile.rmtree(self.directory)

    # ------------------------------------------------------------ the fit
    def fit(self, fit, model: keras.Model, arguments: dict):
        """Runs `fit(model, **arguments)` backed up, resumed from the latest backup.

        Args:
            fit: the function that trains, `fit(model, **arguments)` (Keras'
                `Model.fit` as the caller found it).
            model: the compiled model.
            arguments: `fit`'s keyword arguments; `x` must be a `tf.data.Dataset`.

        Returns:
            The `History` of the last `fit` call (a resume may make two).

        Raises:
            ValueError: a second `fit` of this backup; data it cannot position (not
                a `tf.data.Dataset`, a repeated one without `steps_per_epoch`, one
                shorter than `steps_per_epoch` x `epochs`); `steps_per_execution`
                other than 1; a backup in force of another `fit`.
        """
        if self._fits:
            raise ValueError(
                "TrainingBackup (AccumulatingTrainer's backup_dir) resumes a run that calls `fit` once; "
                "this one called `fit` a second time. Train in one `fit`, or leave backup_dir unset.")
        shape = _fit_shape(model, arguments)
        self._fits += 1
        progress = self.latest()
        if progress is not None and progress["fit"] != shape:
            raise ValueError(
                f"The backup in {self.directory} is of a fit with {progress['fit']}; this fit has {shape}. "
                "A backup resumes only the same training: remove it, or use another directory.")
        if progress is not None:
            progress["resumes"] += 1
            self.resumed_from = {k: v for k, v in progress.items() if k != "path"}
            logger.info("Resuming from the backup at %s: epoch %d, step %d of it, %d steps, %d updates.",
                        progress["path"], progress["epoch"], progress["batch"], progress["steps"],
                        progress["updates"])
        saver = _callback_class(model)(self, shape, progress)
        # Callbacks that decide during training (AutoAccumulation) keep their decisions in the backup.
        saver.stateful = [c for c in arguments.get("callbacks") or []
                          if callable(getattr(c, "state", None)) and callable(getattr(c, "restore_state", None))]
        optimizer = getattr(model, "optimizer", None)
        auto = getattr(optimizer, "auto_accumulation", None)
        if auto is None and getattr(optimizer, "auto", None) is not None and not saver.stateful:
            auto = auto_rule_of(optimizer, flavours.keras_package_of(model), arguments)  # accum_steps="auto"
        if auto is not None and auto not in saver.stateful:     # the one accumulating_compile made
            saver.stateful.append(auto)
        history = None
        for call in _calls(arguments, shape, progress):
            call["callbacks"] = [saver] + list(call.get("callbacks") or [])
            history = fit(model, **call)
        return history


def _fit_shape(model, arguments):
    """What a resume must know of the `fit`; refuses data it cannot position."""
    x, steps, epochs = arguments.get("x"), arguments.get("steps_per_epoch"), arguments.get("epochs", 1)
    if not isinstance(x, tf.data.Dataset):
        raise ValueError(
            "TrainingBackup (AccumulatingTrainer's backup_dir) resumes a `fit` on a tf.data.Dataset, "
            f"whose position it can restore; this fit got {type(x).__name__}. Give fit a tf.data.Dataset "
            "(repeated, with steps_per_epoch; or finite, without), or leave backup_dir unset.")
    cardinality = int(x.cardinality())
    if steps is None and cardinality == tf.data.INFINITE_CARDINALITY:
        raise ValueError("TrainingBackup: fit on a dataset that repeats needs `steps_per_epoch`.")
    if steps is not None and 0 <= cardinality < steps * epochs:
        raise ValueError(
            f"TrainingBackup: the dataset has {cardinality} batches, fewer than steps_per_epoch x epochs = "
            f"{steps * epochs}, so Keras would restart it part-way and a resume could not know where it "
            "was. Repeat it (`dataset.repeat()`), or drop steps_per_epoch.")
    # Keras 2 holds it in a variable (a MirroredVariable under a strategy).
    if int(tf.convert_to_tensor(getattr(model, "steps_per_execution", 1) or 1).numpy()) != 1:
        raise ValueError("TrainingBackup (AccumulatingTrainer's backup_dir) needs compile(steps_per_execution=1): "
                         "it counts the steps `fit` reports.")
    return {"epochs": int(epochs), "steps_per_epoch": steps, "initial_epoch": int(arguments.get("initial_epoch") or 0),
            "batches": steps or (cardinality if cardinality >= 0 else None)}


def _calls(arguments, shape, progress):
    """The `fit` calls that finish the run from `progress`: the interrupted
    epoch's remaining steps, then the epochs after it."""
    if progress is None:
        return [arguments]
    x, steps, epochs = arguments["x"], shape["steps_per_epoch"], shape["epochs"]
    epoch, batch, done = progress["epoch"], progress["batch"], progress["steps"]
    calls = []
    if batch and epoch < epochs:
        rest = {**arguments, "x": x.skip(done if steps else batch), "initial_epoch": epoch, "epochs": epoch + 1}
        if steps:
            rest["steps_per_epoch"] = steps - batch
        calls.append(rest)
        done, epoch = done + (steps - batch if steps else 0), epoch + 1
    if epoch < epochs or not calls:
        calls.append({**arguments, "x": x.skip(done) if steps else x, "initial_epoch": min(epoch, epochs)})
    return calls


def _weights_file(model):
    """The backup's file name: a TensorFlow checkpoint for Keras 2, `.weights.h5` for Keras 3."""
    return KERAS2_WEIGHTS if flavours.is_keras2_object(model) else WEIGHTS


_callback_classes = {}


def _callback_class(model):
    """`_Backup` as a callback of the model's Keras (a Keras 3 callback does not run in Keras 2's `fit`)."""
    package = flavours.keras_package_of(model) or keras
    if package not in _callback_classes:
        base = package.callbacks.Callback
        _callback_classes[package] = _Backup if base is keras.callbacks.Callback else \
            type("_Backup", (_BackupSteps, base), {})
    return _callback_classes[package]


class _BackupSteps:
    """Restores the backup when training begins; saves every `every_steps` and at epoch ends."""

    def __init__(self, backup, shape, progress):
        super().__init__()
        self.backup, self.shape = backup, shape
        self.restore = progress
        progress = progress or {"epoch": shape["initial_epoch"], "batch": 0, "steps": 0, "resumes": 0}
        self.epoch, self.steps, self.resumes = progress["epoch"], progress["steps"], progress["resumes"]
        self.offset = progress["batch"]           # steps of the resumed epoch done before the restore
        self.saved_at = self.steps
        self.stateful = []

    def on_train_begin(self, logs=None):
        if self.restore is not None:
            optimizer = self.model.optimizer
            if optimizer is not None and not getattr(optimizer, "built", False):
                optimizer.build(self.model.trainable_variables)      # its slots and window, to load into
            self.model.load_weights(os.path.join(self.restore["path"], _weights_file(self.model)))
            for callback, state in zip(self.stateful, self.restore.get("callback_states", [])):
                callback.restore_state(state)
            self.restore = None

    def on_epoch_begin(self, epoch, logs=None):
        if epoch != self.epoch:
            self.epoch, self.offset = epoch, 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1
        done = self.offset + batch + 1
        # An epoch's last step is backed up at the epoch's end, after its window is closed.
        if self.steps - self.saved_at >= self.backup.every_steps and done != self.shape["batches"]:
            self._save(self.epoch, done)

    def on_epoch_end(self, epoch, logs=None):
        self.epoch, self.offset = epoch + 1, 0
        self._save(epoch + 1, 0)

    def _save(self, epoch, batch):
        updates = int(self.model.optimizer.iterations.numpy()) if self.model.optimizer is not None else 0
        self.backup.save(self.model, {"epoch": epoch, "batch": batch, "steps": self.steps, "updates": updates,
                                      "resumes": self.resumes, "fit": self.shape,
                                      "callback_states": [c.state() for c in self.stateful]})
        self.saved_at = self.steps


class _Backup(_BackupSteps, keras.callbacks.Callback):
    pass
