"""The cluster runner compiles offline: trainer on GPU worker pools, accumulation set."""

import json

import pytest

from pipelines.compile_kubeflow import compile_pipeline


def _compile(tmp_path, **overrides):
    args = dict(
        output=str(tmp_path / "pipeline.json"), project="proj", region="europe-west4", image="img:1",
        pipeline_root=str(tmp_path / "root"), data_root=str(tmp_path / "data"),
        serving_model_dir=str(tmp_path / "serving"), workers=3, gpus_per_worker=2,
        machine_type="n1-standard-16", accelerator_type="NVIDIA_TESLA_V100", accum_steps=4,
        effective_batch_size=96,
    )
    args.update(overrides)
    with open(compile_pipeline(**args)) as f:
        return json.load(f)["pipelineSpec"]


def test_trainer_runs_on_gpu_worker_pools_with_accumulation(tmp_path):
    spec = _compile(tmp_path)
    tasks = spec["root"]["dag"]["tasks"]
    assert set(tasks) == {"CsvExampleGen", "StatisticsGen", "SchemaGen", "Tuner",
                          "VertexAccumulatingTrainer", "Evaluator", "Pusher"}
    trainer = tasks["VertexAccumulatingTrainer"]
    params = {k: v["runtimeValue"]["constantValue"] for k, v in trainer["inputs"]["parameters"].items()}
    assert params["accum_steps"] == {"intValue": "4"}
    assert params["effective_batch_size"] == {"intValue": "96"}
    assert params["strategy"] == {"stringValue": "auto"}
    assert params["partial_window"] == {"stringValue": "apply"}   # epoch ends applied on the cluster too
    assert trainer["inputs"]["artifacts"]["hyperparameters"]["taskOutputArtifact"]["producerTask"] == "Tuner"

    config = json.loads(params["custom_config"]["stringValue"])
    assert config["ai_platform_enable_vertex"] is True
    assert config["ai_platform_vertex_region"] == "europe-west4"
    pools = config["ai_platform_training_args"]["worker_pool_specs"]
    assert [p["replica_count"] for p in pools] == [1, 2]     # chief + 2 workers
    for pool in pools:
        assert pool["machine_spec"] == {"machine_type": "n1-standard-16",
                                        "accelerator_type": "NVIDIA_TESLA_V100", "accelerator_count": 2}
        assert pool["container_spec"]["image_uri"] == "img:1"

    executor = spec["deploymentSpec"]["executors"]["VertexAccumulatingTrainer_executor"]["container"]
    assert executor["args"][:2] == ["--executor_class_path", "components.cloud.VertexExecutor"]


def test_effective_batch_must_divide_over_all_replicas(tmp_path):
    # 3 workers x 2 GPUs x accum 4 = 24 does not divide 64.
    with pytest.raises(ValueError, match="divide evenly"):
        _compile(tmp_path, effective_batch_size=64)
