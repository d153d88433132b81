"""What each process of a training cluster writes, and what a failed one becomes.

Vertex AI and Kubeflow run the Trainer's executor once on every replica of the
worker pools, each with its own `TF_CONFIG` and the same output artifacts. The
stock Trainer leaves it to the user's module "to export the model only once";
a penguin-style module exports from every worker into the same folder. Here,
with the module unchanged:

* the chief's run_fn exports into a staging folder beside `Format-Serving`,
  which becomes `Format-Serving` only when the run succeeded and was recorded:
  the model artifact holds a whole model or none;
* every other worker's run_fn gets its own temporary folders for the serving
  model and the run's logs (removed after), as Keras' multi-worker guide does:
  it must still save (saving runs collectives), but nowhere that clobbers;
* a peer that dies makes the collectives fail (`UnavailableError`, ...), which
  becomes one error that says so, with what a restart resumes from.
"""

import contextlib
import copy
import dataclasses
import json
import os
import shutil
import tempfile

import tensorflow as tf
from absl import logging
from tfx.dsl.io import fileio

from tfx_gradient_accumulator.accumulator.distribute import cluster_role, parse_tf_config

STAGING = ".Format-Serving.incomplete"
# The errors a collective raises when a peer is gone (TF 2.16: a reset connection
# is UnavailableError; an aborted collective, Cancelled/Aborted/DeadlineExceeded).
PEER_ERRORS = (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError,
               tf.errors.DeadlineExceededError)


@dataclasses.dataclass(frozen=True)
class Role:
    chief: bool = True
    task: str = "chief"
    workers: int = 1


def role_from_environment() -> Role:
    return Role(*cluster_role(parse_tf_config(os.environ.get("TF_CONFIG"))))


def refuse_one_strategy_per_worker(role: Role, strategy) -> None:
    """Several processes must train as one (MultiWorkerMirroredStrategy), or each
    would train a model of its own and the chief export only its part."""
    if role.workers > 1 and not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        raise ValueError(
            f"TF_CONFIG names a cluster of {role.workers} training processes, but the strategy is "
            f"{type(strategy).__name__}, under which each would train alone. Use strategy='auto' "
            "(or 'multi_worker') on a cluster.")


class WorkerOutputs:
    """This process's `fn_args` (its output folders) and the model's publication."""

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

    def check_exported(self):
        if not fileio.exists(self.fn_args.serving_model_dir):
            raise RuntimeError("run_fn failed to generate model.")

    def publish(self):
        """The chief's model becomes the artifact's `Format-Serving`; the others' temporary folders go."""
        if self.role.chief:
            fileio.rename(self.staging, self.serving_model_dir)
        self.discard()

    def discard(self):
        if self.role.chief:
            if fileio.exists(self.staging):
                fileio.rmtree(self.staging)
        else:
            shutil.rmtree(self.temporary, ignore_errors=True)


@contextlib.contextmanager
def worker_outputs(fn_args, role: Role, backup=None):
    """`WorkerOutputs` for the run; on failure nothing is published, and a dead
    peer is said to be one."""
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
    if role.workers == 1:
        return "one process"
    duty = "exports the model and records the run" if role.chief else "exports to a temporary folder"
    return f"{role.task} of {role.workers} processes ({duty})"


def write_json(path, value):
    """Writes `value` as JSON to `path` through a temporary name (whole or absent)."""
    fileio.makedirs(os.path.dirname(path))
    with fileio.open(path + ".tmp", "w") as f:
        f.write(json.dumps(value, indent=1, sort_keys=True))
    fileio.rename(path + ".tmp", path, overwrite=True)
