"""`AccumulatingTrainer` on Vertex AI worker pools (multi-worker GPU training).

`VertexAccumulatingTrainer` runs the Trainer's executor on every replica of a
Vertex AI CustomJob; `vertex_training_config` makes its `custom_config`. The
container image must have this project installed ("Going to a cluster").
"""

from __future__ import annotations

import json
import os

from google.protobuf import json_format
from ml_metadata.proto import metadata_store_pb2
from tfx.dsl.components.base import executor_spec
from tfx.dsl.io import fileio
from tfx.extensions.google_cloud_ai_platform import constants as vertex_constants
from tfx.extensions.google_cloud_ai_platform.trainer import executor as cloud_executor
from tfx.types import standard_component_specs

from tfx_gradient_accumulator.accumulator.core.validation import integer_at_least
from tfx_gradient_accumulator.components import executor
from tfx_gradient_accumulator.components.component import AccumulatingTrainer


class VertexExecutor(cloud_executor.GenericExecutor):
    """Starts the CustomJob; each replica runs `tfx_gradient_accumulator.components.executor.Executor`.

    Each replica sets ML Metadata properties on artifacts that stay in its own
    process, so the chief also writes them to `record.json`, and this executor
    copies them onto the artifacts it publishes once the job has succeeded.
    """

    def _GetExecutorClass(self):
        return executor.Executor

    def Do(self, input_dict: dict, output_dict: dict, exec_properties: dict) -> None:
        """Runs the CustomJob to its end, then records the chief's properties (`copy_record`).

        Args:
            input_dict: TFX's input artifacts, by key.
            output_dict: TFX's output artifacts, by key (`model`, `model_run`, ...).
            exec_properties: the component's execution properties.

        Raises:
            RuntimeError: the job ended without the chief's `record.json`.
        """
        super().Do(input_dict, output_dict, exec_properties)
        copy_record(output_dict)


def copy_record(output_dict: dict) -> None:
    """Sets the properties the chief recorded (`record.json`) on the output artifacts.

    Args:
        output_dict: TFX's output artifacts, by key; the record is read from the
            `model_run` artifact's folder and set on `model` and `model_run`.

    Raises:
        RuntimeError: there is no `record.json` (a job that cannot be shown to
            have trained records nothing).
    """
    model_run = output_dict[standard_component_specs.MODEL_RUN_KEY][0]
    path = os.path.join(model_run.uri, executor.TENSORBOARD_SUBDIR, executor.RECORD_FILE)
    if not fileio.exists(path):
        raise RuntimeError(f"The training job ended without the chief's record ({path}): nothing is "
                           "recorded for a run that cannot be shown to have trained.")
    with fileio.open(path) as f:
        record = json.load(f)
    for key in (standard_component_specs.MODEL_KEY, standard_component_specs.MODEL_RUN_KEY):
        for artifact in output_dict.get(key, []):
            for name, value in record.items():
                artifact.mlmd_artifact.custom_properties[name].CopyFrom(
                    json_format.ParseDict(value, metadata_store_pb2.Value()))


class VertexAccumulatingTrainer(AccumulatingTrainer):
    """`AccumulatingTrainer` that trains on Vertex AI; configure it with `vertex_training_config`."""

    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(VertexExecutor)


def vertex_training_config(project: str, region: str, image: str, workers: int = 2,
                           machine_type: str = "n1-standard-8", accelerator_type: str = "NVIDIA_TESLA_T4",
                           gpus_per_worker: int = 1, restart_job_on_worker_restart: bool = False) -> dict:
    """The `custom_config` that puts training on `workers` machines with GPUs.

    Pool 0 is the chief (1 replica), pool 1 the other `workers - 1` workers.
    Vertex sets `TF_CONFIG` on each replica, so `strategy="auto"` picks
    `MultiWorkerMirroredStrategy` there, and `effective_batch_size` is divided
    over all replicas of all pools.

    Args:
        project: the Google Cloud project of the CustomJob.
        region: the Vertex AI region.
        image: the container image (this project installed in it).
        workers: machines in all, the chief included.
        machine_type: every machine's type.
        accelerator_type: the GPUs' type (unused without GPUs).
        gpus_per_worker: GPUs per machine; 0 for none.
        restart_job_on_worker_restart: Vertex restarts every replica when one
            is restarted (a preempted machine), so the cluster resumes together
            from the Trainer's backup (`backup_dir`); without it, the job fails.

    Returns:
        The dict for the Trainer's `custom_config`.

    Raises:
        ValueError: `workers` < 1 or `gpus_per_worker` < 0.
        TypeError: either is not an integer.
    """
    workers = integer_at_least(workers, "workers")
    gpus_per_worker = integer_at_least(gpus_per_worker, "gpus_per_worker", minimum=0)
    machine_spec = {"machine_type": machine_type}
    if gpus_per_worker:
        machine_spec.update(accelerator_type=accelerator_type, accelerator_count=gpus_per_worker)
    pool = {"machine_spec": machine_spec, "container_spec": {"image_uri": image}}
    pools = [{**pool, "replica_count": 1}]
    if workers > 1:
        pools.append({**pool, "replica_count": workers - 1})
    job = {"project": project, "worker_pool_specs": pools}
    if restart_job_on_worker_restart:
        job["scheduling"] = {"restart_job_on_worker_restart": True}
    return {
        vertex_constants.ENABLE_VERTEX_KEY: True,
        vertex_constants.VERTEX_REGION_KEY: region,
        cloud_executor.TRAINING_ARGS_KEY: job,
    }
