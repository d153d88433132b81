"""Picks the `tf.distribute` strategy that the environment calls for.

Order: several workers in `TF_CONFIG` → `MultiWorkerMirroredStrategy`; several
local GPUs → `MirroredStrategy`; one GPU → `OneDeviceStrategy` on it; otherwise
the default strategy. The TFX component uses this so the same pipeline runs on
a laptop and on GPU worker pools.
"""

from __future__ import annotations

import json
import os

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import seam

KINDS = ("multi_worker", "mirrored", "one_device", "default")
_WORKER_TYPES = ("chief", "worker")


def parse_tf_config(raw: str | None) -> dict:
    """Parses and validates a `TF_CONFIG` string.

    Args:
        raw: the variable's value (None or blank: no cluster).

    Returns:
        The parsed dict, or {} when `raw` is empty.

    Raises:
        ValueError: naming the field that is malformed (not JSON, a cluster that
            is not lists of "host:port", a task without type or index, a task
            outside the cluster).
    """
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


def choose_strategy_kind(tf_config: dict, num_gpus: int) -> str:
    """The decision alone, without making a strategy.

    Args:
        tf_config: a parsed TF_CONFIG (`parse_tf_config`).
        num_gpus: the local GPUs.

    Returns:
        One of `KINDS`.
    """
    if _training_processes(tf_config.get("cluster", {})) > 1:
        return "multi_worker"
    if num_gpus > 1:
        return "mirrored"
    if num_gpus == 1:
        return "one_device"
    return "default"


def cluster_role(tf_config: dict) -> tuple[bool, str, int]:
    """This process's place in a cluster.

    Args:
        tf_config: a parsed TF_CONFIG (`parse_tf_config`).

    Returns:
        `(chief, task, workers)`: whether it is the chief (the "chief" task;
        worker 0 where the cluster names none; a process alone), its name
        ("chief", "worker 1", ...) and how many processes train.
    """
    cluster = tf_config.get("cluster", {})
    workers = _training_processes(cluster)
    if workers <= 1:
        return True, "chief", max(workers, 1)
    task_type, index = tf_config["task"]["type"], tf_config["task"]["index"]
    chief = task_type == "chief" or (task_type == "worker" and index == 0 and "chief" not in cluster)
    return chief, f"{task_type} {index}", workers


def strategy_from_environment(kind: str = "auto") -> tf.distribute.Strategy:
    """The `tf.distribute` strategy the environment calls for.

    Args:
        kind: "auto" or one of `KINDS` ("multi_worker", "mirrored",
            "one_device", "default"). "auto" reads TF_CONFIG and the local GPUs:
            several workers in TF_CONFIG give `MultiWorkerMirroredStrategy`,
            several GPUs `MirroredStrategy`, one GPU `OneDeviceStrategy` on it,
            otherwise the default strategy.

    Returns:
        A new strategy (the default one for "default").

    Raises:
        ValueError: `kind` is not one of those, or TF_CONFIG is malformed.
    """
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


def num_replicas(strategy: tf.distribute.Strategy | None = None) -> int:
    """The replicas in sync of a strategy.

    Args:
        strategy: a `tf.distribute` strategy; None: the current one.

    Returns:
        Its `num_replicas_in_sync`.
    """
    strategy = strategy or tf.distribute.get_strategy()
    return strategy.num_replicas_in_sync
