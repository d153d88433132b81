"""The cluster runner compiles offline: trainer on GPU worker pools, accumulation set."""

import json

import pytest

from tfx_gradient_accumulator.pipelines.compile_kubeflow import compile_pipeline


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
    assert executor["args"][:2] == ["--executor_class_path", "tfx_gradient_accumulator.components.cloud.VertexExecutor"]


def test_the_spec_carries_the_pools_the_image_and_the_backup_a_restarted_cluster_resumes_from(tmp_path):
    spec = _compile(tmp_path, pipeline_root="gs://bucket/root", backup_every=50)
    trainer = spec["root"]["dag"]["tasks"]["VertexAccumulatingTrainer"]
    params = {k: v["runtimeValue"]["constantValue"] for k, v in trainer["inputs"]["parameters"].items()}
    assert params["backup_dir"] == {"stringValue": "gs://bucket/root/trainer-backups"}
    assert params["backup_every"] == {"intValue": "50"}
    job = json.loads(params["custom_config"]["stringValue"])["ai_platform_training_args"]
    assert job["scheduling"] == {"restart_job_on_worker_restart": True}   # a preempted replica restarts them all
    assert [p["replica_count"] for p in job["worker_pool_specs"]] == [1, 2]
    assert {p["container_spec"]["image_uri"] for p in job["worker_pool_specs"]} == {"img:1"}
    executor = spec["deploymentSpec"]["executors"]["VertexAccumulatingTrainer_executor"]["container"]
    assert executor["image"] == "img:1"

    spec = _compile(tmp_path, backup_dir="none")
    trainer = spec["root"]["dag"]["tasks"]["VertexAccumulatingTrainer"]
    assert "backup_dir" not in trainer["inputs"]["parameters"]
    config = json.loads(trainer["inputs"]["parameters"]["custom_config"]["runtimeValue"]["constantValue"]
                        ["stringValue"])
    assert "scheduling" not in config["ai_platform_training_args"]


def test_the_learning_rate_settings_reach_the_trainer_and_its_check(tmp_path):
    spec = _compile(tmp_path, lr_scaling="sqrt")
    trainer = spec["root"]["dag"]["tasks"]["VertexAccumulatingTrainer"]
    params = {k: v["runtimeValue"]["constantValue"] for k, v in trainer["inputs"]["parameters"].items()}
    assert params["lr_scaling"] == {"stringValue": "sqrt"}
    with pytest.raises(ValueError, match="`lr_scaling`"):
        _compile(tmp_path, lr_scaling="cubic")
    # The Tuner picks a fixed accum_steps: the batch never changes, so a ramp is refused before compiling.
    with pytest.raises(ValueError, match="`lr_ramp_updates` ramps the learning rate after a change of the batch"):
        _compile(tmp_path, lr_ramp_updates=10)


def test_effective_batch_must_divide_over_all_replicas(tmp_path):
    # 3 workers x 2 GPUs x accum 4 = 24 does not divide 64.
    with pytest.raises(ValueError, match="divide evenly"):
        _compile(tmp_path, effective_batch_size=64)


# Run in a fresh process: Python's audit hooks (which cannot be removed) record every
# file opened for writing, every directory made and every network connection; TFX's
# file layer is made to refuse any gs:// path (TensorFlow's GCS client is C++, out of
# the audit hooks' sight, and reaches the cloud only through it).
_OFFLINE_COMPILE = r'''
import json, os, sys

tmp = os.path.realpath(sys.argv[1])
events = []

def outside(path):
    path = os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else None
    return path is not None and not os.path.realpath(path).startswith(tmp + os.sep) \
        and path != os.devnull

def audit(event, args):
    if event == "open" and args[0] is not None:
        mode, flags = args[1], args[2]
        writes = (mode and any(c in mode for c in "wax+")) or (
            mode is None and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT))
        if writes and outside(args[0]):
            events.append(("write", os.fsdecode(args[0])))
    elif event in ("os.mkdir", "os.rename", "os.remove", "shutil.copyfile") and outside(args[0]):
        events.append((event, os.fsdecode(args[0])))
    elif event in ("socket.connect", "socket.getaddrinfo"):
        events.append((event, repr(args[1] if event == "socket.connect" else args[0])))

sys.addaudithook(audit)

from tfx.dsl.io import fileio

_get_filesystem = fileio._get_filesystem

def refuse_remote(path):
    if str(path).startswith("gs://"):
        events.append(("gs", str(path)))
        raise RuntimeError(f"compiling touched {path}")
    return _get_filesystem(path)

fileio._get_filesystem = refuse_remote

from tfx_gradient_accumulator.pipelines.compile_kubeflow import compile_pipeline

compile_pipeline(
    output=os.path.join(tmp, "pipeline.json"), project="proj", region="us-central1", image="img:1",
    pipeline_root="gs://my-bucket/root", data_root="gs://my-bucket/digits",
    serving_model_dir="gs://my-bucket/serving", workers=2, gpus_per_worker=1,
    machine_type="n1-standard-8", accelerator_type="NVIDIA_TESLA_T4", accum_steps=4,
    effective_batch_size=64)
print("EVENTS " + json.dumps(events))
'''


def test_compiles_offline_with_a_cloud_pipeline_root(tmp_path):
    """The documented command: a gs:// root, no cloud access, nothing written outside the output."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HOME=str(tmp_path), TMPDIR=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-c", _OFFLINE_COMPILE, str(tmp_path)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    events = json.loads(done.stdout.rsplit("EVENTS ", 1)[1])
    assert events == [], events       # no gs:// access, no socket, no write outside tmp_path

    text = (tmp_path / "pipeline.json").read_text()
    spec = json.loads(text)
    assert spec["runtimeConfig"]["gcsOutputDirectory"] == "gs://my-bucket/root"
    # No local path (the module file, a wheel built here) and no wheel under the root.
    for local in (root, str(tmp_path), os.path.realpath(str(tmp_path)), "/tmp/", "/home/", "file://"):
        assert local not in text, local
    assert ".whl" not in text and "_wheels" not in text
    tasks = spec["pipelineSpec"]["root"]["dag"]["tasks"]
    params = {name: {k: v["runtimeValue"]["constantValue"] for k, v in task["inputs"]["parameters"].items()}
              for name, task in tasks.items() if name in ("Tuner", "VertexAccumulatingTrainer")}
    assert params["VertexAccumulatingTrainer"]["run_fn"] == {"stringValue": "tfx_gradient_accumulator.pipelines.digits.model.run_fn"}
    assert params["Tuner"]["tuner_fn"] == {"stringValue": "tfx_gradient_accumulator.pipelines.digits.model.tuner_fn"}
    for p in params.values():
        assert "module_file" not in p and "module_path" not in p


def test_micro_batch_size_reaches_the_trainer_in_place_of_accum_steps(tmp_path):
    """`--micro_batch_size`: global over the 6 replicas, so 48 divides; accum_steps is not passed."""
    spec = _compile(tmp_path, micro_batch_size=48)
    trainer = spec["root"]["dag"]["tasks"]["VertexAccumulatingTrainer"]
    params = {k: v["runtimeValue"]["constantValue"] for k, v in trainer["inputs"]["parameters"].items()}
    assert params["micro_batch_size"] == {"intValue": "48"}
    assert params["micro_batch_size_auto"] == {"intValue": "0"}
    assert params["effective_batch_size"] == {"intValue": "96"}
    assert "accum_steps" not in params
    auto = _compile(tmp_path, micro_batch_size="auto")["root"]["dag"]["tasks"]["VertexAccumulatingTrainer"]
    assert auto["inputs"]["parameters"]["micro_batch_size_auto"]["runtimeValue"]["constantValue"] == {"intValue": "1"}
    with pytest.raises(ValueError, match=r"`micro_batch_size=50` is global.*divide by 6"):
        _compile(tmp_path, micro_batch_size=50)


def _trainer_ir(tmp_path, name, **accumulation):
    """The Kubeflow V2 IR of ExampleGen -> AccumulatingTrainer, the Trainer given `accumulation`."""
    import warnings

    from tfx import v1 as tfx
    from tfx.orchestration.kubeflow.v2 import kubeflow_v2_dag_runner

    from tfx_gradient_accumulator.components import AccumulatingTrainer

    example_gen = tfx.components.CsvExampleGen(input_base=str(tmp_path / "data"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)      # the old way of giving options, compiled alike
        trainer = AccumulatingTrainer(run_fn="tfx_gradient_accumulator.pipelines.digits.model.run_fn",
                                      examples=example_gen.outputs["examples"], **accumulation)
    pipeline = tfx.dsl.Pipeline(pipeline_name="options", pipeline_root=str(tmp_path / "root"),
                                components=[example_gen, trainer])
    kubeflow_v2_dag_runner.KubeflowV2DagRunner(
        config=kubeflow_v2_dag_runner.KubeflowV2DagRunnerConfig(default_image="img:1"),
        output_dir=str(tmp_path), output_filename=f"{name}.json").run(pipeline, write_out=True)
    spec = json.loads((tmp_path / f"{name}.json").read_text())["pipelineSpec"]
    spec.pop("sdkVersion", None)
    return spec


def test_options_compile_to_the_same_ir_as_keywords_and_runtime_parameters_stay_pipeline_parameters(tmp_path):
    from tfx.orchestration import data_types

    from tfx_gradient_accumulator.components import TrainerOptions

    def runtime(name, ptype, default):
        return data_types.RuntimeParameter(name=name, ptype=ptype, default=default)

    old = _trainer_ir(tmp_path, "old", accum_steps=4, effective_batch_size=64, lr_scaling="sqrt",
                      measure_noise_scale=runtime("measure", int, 1), backup_dir=runtime("backup", str, "gs://b"),
                      backup_every=runtime("every", int, 50), verify_exactness=True)
    new = _trainer_ir(tmp_path, "new", accum_steps=4, effective_batch_size=64, options=TrainerOptions(
        lr_scaling="sqrt", measure_noise_scale=runtime("measure", int, 1), backup_dir=runtime("backup", str, "gs://b"),
        backup_every=runtime("every", int, 50), verify_exactness=True))
    assert new == old
    assert set(new["root"]["inputDefinitions"]["parameters"]) == {"measure", "backup", "every"}
    parameters = new["root"]["dag"]["tasks"]["AccumulatingTrainer"]["inputs"]["parameters"]
    assert parameters["backup_dir"] == {"componentInputParameter": "backup"}
    assert parameters["measure_noise_scale"] == {"componentInputParameter": "measure"}
    assert parameters["lr_scaling"]["runtimeValue"]["constantValue"] == {"stringValue": "sqrt"}
    assert parameters["verify_exactness"]["runtimeValue"]["constantValue"] == {"stringValue": "record"}
