"""Picks the `tf.distribute` strategy that the environment calls for.

Order: several workers in `TF_CONFIG` → `MultiWorkerMirroredStrategy`; several
local GPUs → `MirroredStrategy`; one GPU → `OneDeviceStrategy` on it; otherwise
the default strategy. The TFX component uses this so the same pipeline runs on
a laptop and on GPU worker pools.
"""

import json
import os

import tensorflow as tf

from tfx_gradient_accumulator.accumulator import seam

KINDS = ("multi_worker", "mirrored", "one_device", "default")
_WORKER_TYPES = ("chief", "worker")


def parse_tf_config(raw):
    """Validates a `TF_CONFIG` string; returns the parsed dict, or {} if empty."""
    if raw is None or not raw.strip():
        return {}
    try:
        config = json.loads(raw)
    except json.JSONDecodeError as err:
        raise ValueError(f"TF_CONFIG is not valid JSON ({err}): {raw!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"TF_CONFIG must be a JSON object with 'cluster' and 'task'; got {raw!r}")
    cluster = config.get("cluster", {})
    if not isinstance(cluster, dict) or not all(
        isinstance(v, list) and all(isinstance(a, str) and ":" in a for a in v) for v in cluster.values()
    ):
        raise ValueError(
            "TF_CONFIG['cluster'] must map job names to lists of 'host:port' strings; "
            f"got {cluster!r}"
        )
    if cluster:
        task = config.get("task")
        if not isinstance(task, dict) or "type" not in task or "index" not in task:
            raise ValueError(
                "TF_CONFIG['task'] must be an object with 'type' and 'index' when a "
                f"cluster is given; got {task!r}"
            )
        if task["type"] not in cluster:
            raise ValueError(
                f"TF_CONFIG['task']['type'] is {task['type']!r}, which is not a job of "
                f"the cluster ({sorted(cluster)})"
            )
        index = task["index"]
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(cluster[task["type"]]):
            raise ValueError(
                f"TF_CONFIG['task']['index'] must be an int in [0, {len(cluster[task['type']])}) "
                f"for job {task['type']!r}; got {index!r}"
            )
    return config


def _training_processes(cluster):
    """How many processes of a TF_CONFIG cluster train (its chief and workers)."""
    return sum(len(cluster.get(job, [])) for job in _WORKER_TYPES)


def choose_strategy_kind(tf_config, num_gpus):
    """The decision alone: one of `KINDS`, from a parsed TF_CONFIG and a GPU count."""
    if _training_processes(tf_config.get("cluster", {})) > 1:
        return "multi_worker"
    if num_gpus > 1:
        return "mirrored"
    if num_gpus == 1:
        return "one_device"
    return "default"


def cluster_role(tf_config):
    """`(chief, task, workers)` of this process in a parsed TF_CONFIG: whether it is
    the chief (the "chief" task; worker 0 where the cluster names none; a process
    alone), its name ("chief", "worker 1", ...) and how many processes train."""
    cluster = tf_config.get("cluster", {})
    workers = _training_processes(cluster)
    if workers <= 1:
        return True, "chief", max(workers, 1)
    task_type, index = tf_config["task"]["type"], tf_config["task"]["index"]
    chief = task_type == "chief" or (task_type == "worker" and index == 0 and "chief" not in cluster)
    return chief, f"{task_type} {index}", workers


def strategy_from_environment(kind="auto"):
    """Returns a strategy for `kind` ("auto" reads TF_CONFIG and the local GPUs)."""
    if kind not in KINDS + ("auto",):
        raise ValueError(f"`kind` must be one of {('auto',) + KINDS}; got {kind!r}")
    # Physical, not logical: listing logical devices initialises the runtime,
    # after which MultiWorkerMirroredStrategy can no longer be created.
    gpus = tf.config.list_physical_devices("GPU")
    if kind == "auto":
        kind = choose_strategy_kind(parse_tf_config(os.environ.get("TF_CONFIG")), len(gpus))
    if kind == "multi_worker":
        return tf.distribute.MultiWorkerMirroredStrategy()
    if kind == "mirrored":
        return seam.mirrored_strategy()     # its own collective keys: not the last run's
    if kind == "one_device":
        return tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0")
    return tf.distribute.get_strategy()


def num_replicas(strategy=None):
    strategy = strategy or tf.distribute.get_strategy()
    return strategy.num_replicas_in_sync
