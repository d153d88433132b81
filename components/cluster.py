"""What each process of a training cluster writes, and what a failed one becomes.

The chief exports through a staging folder (the model artifact holds a whole
model or none), the other workers into temporary folders; a peer that dies
becomes one error that says so.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import tempfile
from typing import TYPE_CHECKING

import tensorflow as tf
from absl import logging
from tfx.dsl.io import fileio

from tfx_gradient_accumulator.accumulator.core.distribute import cluster_role, parse_tf_config

if TYPE_CHECKING:
    from tfx_gradient_accumulator.accumulator.batch.backup import TrainingBackup

STAGING = ".Format-Serving.incomplete"
# The errors a collective raises when a peer is gone (TF 2.16: a reset connection
# is UnavailableError; an aborted collective, Cancelled/Aborted/DeadlineExceeded).
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
               tf.errors.DeadlineExceededError)


@dataclasses.dataclass(frozen=True)
class Role:
    """This process's place in the cluster.

    Attributes:
        chief: whether it exports the model and records the run.
        task: its name ("chief", "worker 1", ...).
        workers: the processes that train (1: no cluster).
    """

    chief: bool = True
    task: str = "chief"
    workers: int = 1


def role_from_environment() -> Role:
    """This process's `Role`, from `TF_CONFIG` (a process alone without one).

    Raises:
        ValueError: `TF_CONFIG` is malformed.
    """
    return Role(*cluster_role(parse_tf_config(os.environ.get("TF_CONFIG"))))


def refuse_one_strategy_per_worker(role: Role, strategy: tf.distribute.Strategy) -> None:
    """Refuses a cluster whose processes would each train alone.

    Several processes must train as one (MultiWorkerMirroredStrategy), or each
    would train a model of its own and the chief export only its part.

    Args:
        role: this process's place in the cluster.
        strategy: the strategy the run trains under.

    Raises:
        ValueError: several processes, and a strategy other than
            `MultiWorkerMirroredStrategy`.
    """
    if role.workers > 1 and not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise ValueError(
            f"TF_CONFIG names a cluster of {role.workers} training processes, but the strategy is "
            f"{type(strategy).__name__}, under which each would train alone. Use strategy='auto' "
            "(or 'multi_worker') on a cluster.")


class WorkerOutputs:
    """This process's `fn_args` (its output folders) and the model's publication.

    The chief's `fn_args.serving_model_dir` is a staging folder beside
    `Format-Serving` (an earlier attempt's folders are removed); another
    worker's serving and run folders are temporary ones of its own, since it
    must still save (saving runs collectives) but nowhere that clobbers.

    Attributes:
        fn_args: a copy of the run's `fn_args` with this process's folders.

    Args:
        fn_args: the run's `FnArgs`, as the executor made them.
        role: this process's place in the cluster.
    """

    def __init__(self, fn_args, role: Role):
        self.role = role
        self.serving_model_dir = fn_args.serving_model_dir
        self.fn_args = copy.copy(fn_args)
        if role.chief:
            self.staging = os.path.join(os.path.dirname(fn_args.serving_model_dir.rstrip("/")), STAGING)
            for stale in (self.staging, self.serving_model_dir):    # an earlier attempt's
                if fileio.exists(stale):
                    logging.warning("Removing %s, left by an earlier attempt of this run.", stale)
                    fileio.rmtree(stale)
            self.fn_args.serving_model_dir = self.staging
        else:
            self.temporary = tempfile.mkdtemp(prefix=f"workertemp_{role.task.replace(' ', '_')}_")
            self.fn_args.serving_model_dir = os.path.join(self.temporary, "serving_model")
            self.fn_args.model_run_dir = os.path.join(self.temporary, "model_run")

    def check_exported(self) -> None:
        """Raises `RuntimeError` when the run_fn wrote no model (as the stock Trainer does)."""
        if not fileio.exists(self.fn_args.serving_model_dir):
            raise RuntimeError("run_fn failed to generate model.")

    def publish(self) -> None:
        """The chief's model becomes the artifact's `Format-Serving`; the others' temporary folders go."""
        if self.role.chief:
            fileio.rename(self.staging, self.serving_model_dir)
        self.discard()

    def discard(self) -> None:
        """Removes what this process wrote (the chief's staging folder, another's temporary one)."""
        if self.role.chief:
            if fileio.exists(self.staging):
                fileio.rmtree(self.staging)
        else:
            shutil.rmtree(self.temporary, ignore_errors=True)


@contextlib.contextmanager
def worker_outputs(fn_args, role: Role, backup: TrainingBackup | None = None):
    """`WorkerOutputs` for the run, discarded if the run fails.

    Args:
        fn_args: the run's `FnArgs`.
        role: this process's place in the cluster.
        backup: the run's `TrainingBackup`, if any: the error of a dead peer
            says what a restart resumes from.

    Yields:
        The `WorkerOutputs`; nothing is published on failure.

    Raises:
        RuntimeError: on a cluster, a collective failed because a peer died or
            became unreachable (`PEER_ERRORS`); it says so, and what a restart
            resumes from.
    """
    outputs = WorkerOutputs(fn_args, role)
    try:
        yield outputs
    except PEER_ERRORS as err:
        outputs.discard()
        if role.workers == 1:
            raise
        raise RuntimeError(_peer_failed(role, err, backup)) from err
    except BaseException:
        outputs.discard()
        raise


def _peer_failed(role, err, backup):
    """The message of a run stopped by a dead peer, with what a restart resumes from."""
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    if backup is not None:
        latest = backup.latest()
        resume = (f"Restart the job: it resumes from the backup in {backup.directory} at fit step "
                  f"{latest['steps']} ({latest['updates']} optimizer updates)." if latest else
                  f"No backup was written yet in {backup.directory}: a restart starts over.")
    else:
        resume = "Without backup_dir, a restart trains from the start."
    return (f"AccumulatingTrainer: training stopped on {role.task} of a {role.workers}-process cluster "
            f"because another process failed or became unreachable ({type(err).__name__}: {first_line}). "
            f"No model was exported. {resume}")


def describe(role: Role) -> str:
    """One phrase for the log: "one process", or the task and what it does.

    Args:
        role: this process's place in the cluster.

    Returns:
        E.g. "worker 1 of 2 processes (exports to a temporary folder)".
    """
    if role.workers == 1:
        return "one process"
    duty = "exports the model and records the run" if role.chief else "exports to a temporary folder"
    return f"{role.task} of {role.workers} processes ({duty})"


def write_json(path: str, value) -> None:
    """Writes `value` as JSON to `path` through a temporary name (whole or absent).

    Args:
        path: the file (local or a `tf.io.gfile` path); its folder is made.
        value: anything `json.dumps` takes.
    """
    fileio.makedirs(os.path.dirname(path))
    with fileio.open(path + ".tmp", "w") as f:
        f.write(json.dumps(value, indent=1, sort_keys=True))
    fileio.rename(path + ".tmp", path, overwrite=True)
