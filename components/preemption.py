"""`AccumulatingTrainer(options=TrainerOptions(backup_dir=...))`: training that survives a killed worker.

A restarted executor with the same run key (the inputs, the execution
properties and the module file) resumes from `<backup_dir>/<run key>`, exactly;
the resume is recorded on the output artifacts and in TensorBoard.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional

from tfx.dsl.io import fileio

from tfx_gradient_accumulator.accumulator.batch.backup import TrainingBackup
from tfx_gradient_accumulator.accumulator.core.validation import integer_at_least

BACKUP_DIR_KEY = "backup_dir"
BACKUP_EVERY_KEY = "backup_every"
DEFAULT_BACKUP_EVERY = 100


def run_key(input_dict: dict, exec_properties: dict) -> str:
    """What decides the training, as a digest.

    A run with other data, parameters or code never picks up a backup that is
    not its own; a restarted executor of the same run does.

    Args:
        input_dict: TFX's input artifacts, by key (their URIs count).
        exec_properties: the execution properties (all but `backup_dir` and
            `backup_every` count, and the contents of `module_file`).

    Returns:
        16 hex digits.
    """
    described = {
        "inputs": {key: sorted(a.uri for a in artifacts) for key, artifacts in sorted(input_dict.items())},
        "properties": {k: v for k, v in sorted(exec_properties.items())
                       if k not in (BACKUP_DIR_KEY, BACKUP_EVERY_KEY)},
    }
    module_file = exec_properties.get("module_file")
    if module_file and fileio.exists(module_file):
        with fileio.open(module_file, "rb") as f:
            described["module"] = hashlib.sha256(f.read()).hexdigest()
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def backup_for(input_dict: dict, exec_properties: dict, steps_per_update: int,
               chief: bool) -> Optional[TrainingBackup]:
    """The run's `TrainingBackup`, in `<backup_dir>/<run key>`.

    It backs up every `backup_every` optimizer updates (at window boundaries)
    and at epoch ends, and is removed once the model is published.

    Args:
        input_dict: TFX's input artifacts, by key.
        exec_properties: the execution properties (`backup_dir`, `backup_every`).
        steps_per_update: fit steps per optimizer update (`accum_steps`, or 1
            with `gradient_cache`).
        chief: whether this process writes the backups.

    Returns:
        The backup, or None without `backup_dir`.

    Raises:
        ValueError: `backup_every` < 1.
        TypeError: `backup_every` is not an integer.
    """
    directory = exec_properties.get(BACKUP_DIR_KEY)
    if not directory:
        return None
    every = integer_at_least(exec_properties.get(BACKUP_EVERY_KEY) or DEFAULT_BACKUP_EVERY, BACKUP_EVERY_KEY)
    return TrainingBackup(os.path.join(directory, run_key(input_dict, exec_properties)),
                          every_steps=every * steps_per_update, chief=chief)


def properties(backup: Optional[TrainingBackup]) -> tuple[dict, dict]:
    """What is recorded (ML Metadata, TensorBoard) for the run's backup.

    Args:
        backup: the run's backup, after training; None without `backup_dir`.

    Returns:
        `(integers, strings)`: `backup_resumes` (0 for a run that started
        fresh), `resumed_at_step` (fit steps, i.e. micro-steps, already trained
        when it resumed), `resumed_at_update` (optimizer updates then); and
        `backup_dir`. Both empty without a backup.
    """
    if backup is None:
        return {}, {}
    resumed = backup.resumed_from or {"resumes": 0, "steps": 0, "updates": 0}
    return ({"backup_resumes": resumed["resumes"], "resumed_at_step": resumed["steps"],
             "resumed_at_update": resumed["updates"]},
            {"backup_dir": backup.directory})
