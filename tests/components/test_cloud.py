"""The Vertex AI training config: worker pools, and bad sizes refused up front."""

import pytest
from tfx.extensions.google_cloud_ai_platform import constants as vertex_constants
from tfx.extensions.google_cloud_ai_platform.trainer import executor as cloud_executor

from tfx_gradient_accumulator.components.cloud import vertex_training_config


def _pools(config):
    return config[cloud_executor.TRAINING_ARGS_KEY]["worker_pool_specs"]


def test_chief_pool_then_the_other_workers_with_their_gpus():
    config = vertex_training_config("p", "europe-west4", "img:1", workers=4, gpus_per_worker=2)
    assert config[vertex_constants.ENABLE_VERTEX_KEY] is True
    pools = _pools(config)
    assert [p["replica_count"] for p in pools] == [1, 3]
    assert all(p["machine_spec"]["accelerator_count"] == 2 for p in pools)
    assert all(p["container_spec"]["image_uri"] == "img:1" for p in pools)


def test_one_cpu_worker_is_one_pool_without_accelerators():
    pools = _pools(vertex_training_config("p", "r", "img", workers=1, gpus_per_worker=0))
    assert len(pools) == 1 and "accelerator_count" not in pools[0]["machine_spec"]


@pytest.mark.parametrize("kwargs, error, message", [
    ({"workers": 0}, ValueError, r"`workers` must be a positive integer \(1, 2, 3, ...\); received 0"),
    ({"workers": 2.0}, TypeError, "`workers`"),
    ({"gpus_per_worker": -1}, ValueError, r"`gpus_per_worker` must be a non-negative integer"),
    ({"gpus_per_worker": True}, TypeError, "`gpus_per_worker`"),
])
def test_bad_sizes_are_refused(kwargs, error, message):
    with pytest.raises(error, match=message):
        vertex_training_config("p", "r", "img", **kwargs)
