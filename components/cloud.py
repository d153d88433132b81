"""`AccumulatingTrainer` on Vertex AI worker pools (multi-worker GPU training).

`VertexAccumulatingTrainer` is `AccumulatingTrainer` whose executor starts a
Vertex AI CustomJob (through TFX's Cloud AI Platform extension) that runs our
executor on every replica of the worker pools. Vertex sets `TF_CONFIG` on each
replica, so `strategy="auto"` picks `MultiWorkerMirroredStrategy` there, and
`effective_batch_size` is divided over all replicas of all pools.

Each replica's executor sets ML Metadata properties on artifacts that stay in
its own process; the chief also writes them to `accumulation/record.json` in
the ModelRun, and `VertexExecutor` copies them from there onto the artifacts
it publishes once the job has succeeded (a job without one fails).

The container image must have this project installed (see the manual's
"Going to a cluster", docs/cluster.md).
"""

import json
import os

from google.protobuf import json_format
from ml_metadata.proto import metadata_store_pb2
from tfx.dsl.components.base import executor_spec
from tfx.dsl.io import fileio
from tfx.extensions.google_cloud_ai_platform import constants as vertex_constants
from tfx.extensions.google_cloud_ai_platform.trainer import executor as cloud_executor
from tfx.types import standard_component_specs

from tfx_gradient_accumulator.accumulator.validation import integer_at_least
from tfx_gradient_accumulator.components import executor
from tfx_gradient_accumulator.components.component import AccumulatingTrainer


class VertexExecutor(cloud_executor.GenericExecutor):
    """Starts the CustomJob; each replica runs `tfx_gradient_accumulator.components.executor.Executor`."""

    def _GetExecutorClass(self):
        return executor.Executor

    def Do(self, input_dict, output_dict, exec_properties):
        super().Do(input_dict, output_dict, exec_properties)
        copy_record(output_dict)


def copy_record(output_dict):
    """Sets the properties the chief recorded (`record.json`) on `output_dict`'s artifacts."""
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


def vertex_training_config(project, region, image, workers=2, machine_type="n1-standard-8",
                           accelerator_type="NVIDIA_TESLA_T4", gpus_per_worker=1,
                           restart_job_on_worker_restart=False):
    """The `custom_config` that puts training on `workers` machines with GPUs.

    Pool 0 is the chief (1 replica), pool 1 the other `workers - 1` workers.
    `restart_job_on_worker_restart`: Vertex restarts every replica when one is
    restarted (a preempted machine), so the cluster resumes together from the
    Trainer's backup (`backup_dir`); without it, the job fails.
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
