"""Compiles the digits pipeline for Kubeflow Pipelines v2 / Vertex AI Pipelines.

    python -m tfx_gradient_accumulator.pipelines.compile_kubeflow --project=my-project --region=us-central1 \\
        --image=us-docker.pkg.dev/my-project/tfx/accumulator:latest \\
        --pipeline_root=gs://my-bucket/root --data_root=gs://my-bucket/digits \\
        --workers=2 --gpus_per_worker=1 --output=digits_pipeline.json

The trainer runs as a Vertex AI CustomJob on `--workers` GPU machines under
`MultiWorkerMirroredStrategy`; the effective batch stays what you set, the
micro-batch per replica is effective / (accum_steps x replicas); with
`--micro_batch_size=b` each update is one training step at the effective batch,
split inside the step into micro-batches of b (global). Compiling
needs no cloud access and reads or writes nothing under `--pipeline_root`: the
Tuner and Trainer name their code by import path (`pipelines.digits.model.tuner_fn`
/ `.run_fn`), which the image has (`pip install --no-deps .`), so TFX packages no
module file as a wheel. Submit the JSON with the Vertex AI SDK or the KFP UI.
"""

import os
from typing import Optional

from absl import app, flags

PROJECT = flags.DEFINE_string("project", "my-gcp-project", "GCP project of the training job.")
REGION = flags.DEFINE_string("region", "us-central1", "Vertex AI region.")
IMAGE = flags.DEFINE_string("image", "gcr.io/my-gcp-project/tfx-accumulator:latest",
                            "Container image with TFX 1.16 and this project installed.")
PIPELINE_ROOT = flags.DEFINE_string("pipeline_root", "gs://my-bucket/tfx-accumulator", "Pipeline root.")
DATA_ROOT = flags.DEFINE_string("data_root", "gs://my-bucket/digits/data", "Folder holding digits.csv.")
SERVING_DIR = flags.DEFINE_string("serving_model_dir", "gs://my-bucket/digits/serving", "Push destination.")
WORKERS = flags.DEFINE_integer("workers", 2, "Training machines (chief included).")
GPUS = flags.DEFINE_integer("gpus_per_worker", 1, "GPUs per machine.")
MACHINE = flags.DEFINE_string("machine_type", "n1-standard-8", "Machine type of each worker.")
ACCELERATOR = flags.DEFINE_string("accelerator_type", "NVIDIA_TESLA_T4", "GPU type.")
ACCUM = flags.DEFINE_integer("accum_steps", 4, "Default accum_steps (the Tuner's best wins).")
EFFECTIVE = flags.DEFINE_integer("effective_batch_size", 64, "Default effective batch (the Tuner's best wins).")
BACKUP_DIR = flags.DEFINE_string(
    "backup_dir", None, "Where the Trainer backs training up, so a preempted worker's restart resumes "
    "(every replica restarts with it); default <pipeline_root>/trainer-backups; 'none': no backup.")
BACKUP_EVERY = flags.DEFINE_integer("backup_every", 100, "Optimizer updates between the Trainer's backups.")
LR_SCALING = flags.DEFINE_enum("lr_scaling", "none", ["none", "linear", "sqrt"],
                               "The Trainer's learning-rate rule when the effective batch changes.")
LR_RAMP = flags.DEFINE_integer("lr_ramp_updates", None, "The Trainer's learning-rate ramp, in updates, after a "
                               "change of the batch (default: the Trainer's).")
MICRO_BATCH_SIZE = flags.DEFINE_string(
    "micro_batch_size", None, "The Trainer's micro_batch_size (an int, global over all replicas, or 'auto'): "
    "its run_fn reads batches of the effective batch, each one update split into micro-batches inside the "
    "training step, instead of --accum_steps fit steps. Default: unset (accum_steps).",
    allow_override=True)     # the other pipeline runner defines it too (one process may import both)
OUTPUT = flags.DEFINE_string("output", "digits_pipeline.json", "Where to write the pipeline JSON.")


def compile_pipeline(output: str, project: str, region: str, image: str, pipeline_root: str, data_root: str,
                     serving_model_dir: str, workers: int, gpus_per_worker: int, machine_type: str,
                     accelerator_type: str, accum_steps: int, effective_batch_size: int,
                     backup_dir: Optional[str] = None, backup_every: int = 100, lr_scaling: str = "none",
                     lr_ramp_updates: Optional[int] = None, micro_batch_size=None) -> str:
    """Writes the digits pipeline's KFP v2 JSON, its Trainer on Vertex AI.

    Args:
        output: the JSON file to write.
        project: the Google Cloud project.
        region: the Vertex AI region.
        image: the container image (this project installed in it).
        pipeline_root: where the components' artifacts go (nothing is read or
            written there when compiling).
        data_root: the folder holding `digits.csv`.
        serving_model_dir: the Pusher's destination.
        workers: training machines, the chief included.
        gpus_per_worker: GPUs per machine.
        machine_type: every training machine's type.
        accelerator_type: the GPUs' type.
        accum_steps: the Trainer's default; the Tuner's best value replaces it.
        effective_batch_size: the Trainer's default; the Tuner's best value
            replaces it.
        backup_dir: where the Trainer backs up (default
            `<pipeline_root>/trainer-backups`; "none" for no backup); with a
            backup, Vertex restarts every replica when one restarts, so the job
            resumes together from the backup instead of failing.
        backup_every: optimizer updates between backups.
        lr_scaling: the Trainer's `lr_scaling` ("none", "linear" or "sqrt").
        lr_ramp_updates: the Trainer's `lr_ramp_updates` (None: its default); a ramp
            needs a change of the batch, which this pipeline's Tuner (fixed
            `accum_steps` values) never makes, so a value > 0 is refused here.
        micro_batch_size: None (split the effective batch into `accum_steps` fit
            steps), or the Trainer's `micro_batch_size` (an int, global over all
            replicas, or "auto"); `accum_steps` is then not applied.

    Returns:
        The JSON file's absolute path.

    Raises:
        ValueError: settings the Trainer's executor would refuse (e.g. an
            effective batch that the micro-batches of all replicas do not divide).
    """
    from tfx.orchestration.kubeflow.v2 import kubeflow_v2_dag_runner

    from tfx_gradient_accumulator.components.cloud import VertexAccumulatingTrainer, vertex_training_config
    from tfx_gradient_accumulator.components.settings import resolve
    from tfx_gradient_accumulator.components.trainer_options import TrainerOptions
    from tfx_gradient_accumulator.pipelines.digits.pipeline import MODULE, create_pipeline

    # The executor's own check, with the replicas the worker pools will have.
    if micro_batch_size is not None:
        accum_steps = None      # micro_batch_size splits the effective batch instead
    resolve(None, accum_steps, effective_batch_size, replicas=workers * max(gpus_per_worker, 1),
            options=TrainerOptions(lr_scaling=lr_scaling, lr_ramp_updates=lr_ramp_updates),
            micro_batch_size=micro_batch_size)
    if backup_dir is None:
        backup_dir = f"{pipeline_root.rstrip('/')}/trainer-backups"
    backup_dir = None if backup_dir.lower() == "none" else backup_dir
    pipeline = create_pipeline(
        pipeline_name="digits-accumulation",
        pipeline_root=pipeline_root,
        data_root=data_root,
        serving_model_dir=serving_model_dir,
        module=MODULE,     # by import path: no wheel written under pipeline_root
        accum_steps=accum_steps,
        effective_batch_size=effective_batch_size,
        trainer_class=VertexAccumulatingTrainer,
        trainer_custom_config=vertex_training_config(
            project, region, image, workers=workers, machine_type=machine_type,
            accelerator_type=accelerator_type, gpus_per_worker=gpus_per_worker,
            restart_job_on_worker_restart=backup_dir is not None,
        ),
        backup_dir=backup_dir,
        backup_every=backup_every if backup_dir is not None else None,
        lr_scaling=lr_scaling,
        lr_ramp_updates=lr_ramp_updates,
        micro_batch_size=micro_batch_size,
        beam_pipeline_args=[f"--project={project}", f"--temp_location={pipeline_root}/beam-tmp"],
    )
    output = os.path.abspath(output)
    runner = kubeflow_v2_dag_runner.KubeflowV2DagRunner(
        config=kubeflow_v2_dag_runner.KubeflowV2DagRunnerConfig(default_image=image),
        output_dir=os.path.dirname(output),
        output_filename=os.path.basename(output),
    )
    runner.run(pipeline)
    return output


def _micro_batch_size(value):
    """--micro_batch_size as the Trainer takes it: None, "auto" or an int (`run_local`'s rule)."""
    from tfx_gradient_accumulator.pipelines.run_local import micro_batch_size_flag

    return micro_batch_size_flag(value)


def main(argv):
    del argv
    path = compile_pipeline(
        OUTPUT.value, PROJECT.value, REGION.value, IMAGE.value, PIPELINE_ROOT.value, DATA_ROOT.value,
        SERVING_DIR.value, WORKERS.value, GPUS.value, MACHINE.value, ACCELERATOR.value,
        ACCUM.value, EFFECTIVE.value, BACKUP_DIR.value, BACKUP_EVERY.value, LR_SCALING.value, LR_RAMP.value,
        _micro_batch_size(MICRO_BATCH_SIZE.value),
    )
    print(f"Pipeline compiled to {path}")


if __name__ == "__main__":
    app.run(main)
