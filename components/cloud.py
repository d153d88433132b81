"""`AccumulatingTrainer` on Vertex AI worker pools (multi-worker GPU training).

`VertexAccumulatingTrainer` is `AccumulatingTrainer` whose executor starts a
Vertex AI CustomJob (through TFX's Cloud AI Platform extension) that runs our
executor on every replica of the worker pools. Vertex sets `TF_CONFIG` on each
replica, so `strategy="auto"` picks `MultiWorkerMirroredStrategy` there, and
`effective_batch_size` is divided over all replicas of all pools.

The container image must have this project installed (see the manual's
"Going to a cluster", docs/cluster.md).
"""

from tfx.dsl.components.base import executor_spec
from tfx.extensions.google_cloud_ai_platform import constants as vertex_constants
from tfx.extensions.google_cloud_ai_platform.trainer import executor as cloud_executor

from accumulator.validation import integer_at_least
from components import executor
from components.component import AccumulatingTrainer


class VertexExecutor(cloud_executor.GenericExecutor):
    """Starts the CustomJob; each replica runs `components.executor.Executor`."""

    def _GetExecutorClass(self):
        return executor.Executor


class VertexAccumulatingTrainer(AccumulatingTrainer):
    """`AccumulatingTrainer` that trains on Vertex AI; configure it with `vertex_training_config`."""

    EXECUTOR_SPEC = executor_spec.ExecutorClassSpec(VertexExecutor)


def vertex_training_config(project, region, image, workers=2, machine_type="n1-standard-8",
                           accelerator_type="NVIDIA_TESLA_T4", gpus_per_worker=1):
    """The `custom_config` that puts training on `workers` machines with GPUs.

    Pool 0 is the chief (1 replica), pool 1 the other `workers - 1` workers.
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
    return {
        vertex_constants.ENABLE_VERTEX_KEY: True,
        vertex_constants.VERTEX_REGION_KEY: region,
        cloud_executor.TRAINING_ARGS_KEY: {"project": project, "worker_pool_specs": pools},
    }
