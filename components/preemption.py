"""`AccumulatingTrainer(backup_dir=...)`: training that survives a killed worker.

The run backs up to `<backup_dir>/<run key>` (`accumulator.backup.TrainingBackup`:
every `backup_every` optimizer updates, at window boundaries, and at epoch ends).
The run key is a digest of what decides the training: the input artifacts'
URIs, the execution properties and the module file's contents. A restarted
executor (a preempted Vertex replica, a retried component) with the same key
resumes where the backup was, exactly; a run with other data, parameters or
code never picks up a backup that is not its own. The backup is removed once
the model is published.

Recorded on the output artifacts (ML Metadata) and in TensorBoard:
`backup_resumes` (0 for a run that started fresh), `resumed_at_step` (fit
steps, i.e. micro-steps, already trained when it resumed), `resumed_at_update`
(optimizer updates then), and the string `backup_dir`.
"""

import hashlib
import json
import os
from typing import Optional

from tfx.dsl.io import fileio

from tfx_gradient_accumulator.accumulator.backup import TrainingBackup
from tfx_gradient_accumulator.accumulator.validation import integer_at_least

BACKUP_DIR_KEY = "backup_dir"
BACKUP_EVERY_KEY = "backup_every"
DEFAULT_BACKUP_EVERY = 100


def run_key(input_dict, exec_properties) -> str:
    """What decides the training, as a digest (16 hex digits)."""
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


def backup_for(input_dict, exec_properties, steps_per_update, chief) -> Optional[TrainingBackup]:
    """The run's `TrainingBackup`, or None without `backup_dir`."""
    directory = exec_properties.get(BACKUP_DIR_KEY)
    if not directory:
        return None
    every = integer_at_least(exec_properties.get(BACKUP_EVERY_KEY) or DEFAULT_BACKUP_EVERY, BACKUP_EVERY_KEY)
    return TrainingBackup(os.path.join(directory, run_key(input_dict, exec_properties)),
                          every_steps=every * steps_per_update, chief=chief)


def properties(backup: Optional[TrainingBackup]):
    """(integers, strings) recorded for the run's backup; empty without one."""
    if backup is None:
        return {}, {}
    resumed = backup.resumed_from or {"resumes": 0, "steps": 0, "updates": 0}
    return ({"backup_resumes": resumed["resumes"], "resumed_at_step": resumed["steps"],
             "resumed_at_update": resumed["updates"]},
            {"backup_dir": backup.directory})
