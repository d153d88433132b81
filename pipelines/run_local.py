"""Runs a pipeline locally: Beam DirectRunner, SQLite ML Metadata.

    python -m tfx_gradient_accumulator.pipelines.run_local --output_dir=work/digits
    python -m tfx_gradient_accumulator.pipelines.run_local --pipeline=retrieval --output_dir=work/retrieval

`digits` (the default): writes the shipped data as CSV, runs the pipeline (a
second run reuses cached results), and prints the chosen hyperparameters, the
Trainer's record (with the gradient noise scale it measured), the evaluation
and where the pushed model is. `--micro_batch_size=16` (or `auto`) trains the
Trainer with `micro_batch_size` instead of `accum_steps`: the run_fn reads
batches of the effective batch, each one update split into micro-batches of 16
inside the training step (no noise scale then):

    python -m tfx_gradient_accumulator.pipelines.run_local --micro_batch_size=16

`retrieval`: writes synthetic user-item interactions with latent clusters,
trains a two-tower model with in-batch negatives under
`AccumulatingTrainer(gradient_cache=True)`, and prints the chosen
hyperparameters, the Trainer's record and the held-out recall@10 of the
exported model, beside what the generating distribution and chance reach.
`--retrieval_model=tfrs` trains the same model written with TensorFlow
Recommenders (a `tfrs.Model` on Keras 2) instead of Keras 3, without the Tuner:

    python -m tfx_gradient_accumulator.pipelines.run_local --pipeline=retrieval --retrieval_model=tfrs

TFRS needs `tf.keras` to be Keras 2, and TFX's own imports resolve `tf.keras`
(TensorFlow Model Analysis does, before TensorFlow Transform sets
`TF_USE_LEGACY_KERAS=1`): so with `tfrs` this process sets `TF_USE_LEGACY_KERAS=1`
before it imports TFX, and refuses to run if `tf.keras` was already Keras 3.

Both run their Beam components (CsvExampleGen, StatisticsGen; digits' Evaluator)
on Beam's direct runner in memory, one worker, unless told otherwise:

    python -m tfx_gradient_accumulator.pipelines.run_local --beam_running_mode=multi_processing --beam_workers=2

starts two SDK worker processes per Beam component and splits the data between
them; the outputs are the same records and statistics
(`tests/pipelines/test_beam_multiprocessing.py`).
"""

import json
import os
import sys
from typing import Optional

from absl import app, flags, logging

PIPELINE = flags.DEFINE_enum("pipeline", "digits", ["digits", "retrieval"],
                             "digits: a CNN with AccumBatchNormalization (GradientAccumulator); retrieval: a "
                             "two-tower model with in-batch negatives (GradientCache).")
OUTPUT_DIR = flags.DEFINE_string("output_dir", None, "Where data, artifacts, metadata and the pushed model go "
                                 "(default work/<pipeline>).")
RETRIEVAL_MODELS = ("keras", "tfrs")
RETRIEVAL_MODEL = flags.DEFINE_enum(
    "retrieval_model", "keras", RETRIEVAL_MODELS,
    "retrieval: the module file's framework: keras (Keras 3, pipelines/retrieval/model.py, tuned by the "
    "Tuner) or tfrs (TensorFlow Recommenders on Keras 2, pipelines/retrieval/tfrs_model.py: no Tuner, "
    "so --max_trials must be 0, its default there; sets TF_USE_LEGACY_KERAS=1 for this process).")
# Each pipeline's defaults when a flag is not given: {pipeline: (train, tuner updates, trials)}.
DEFAULTS = {"digits": (400, 60, 4), "retrieval": (300, 30, 2)}
TRAIN_UPDATES = flags.DEFINE_integer("train_updates", None, "Optimizer updates of the Trainer (TrainArgs.num_steps); "
                                     "default: digits 400, retrieval 300.")
TUNER_UPDATES = flags.DEFINE_integer("tuner_updates", None, "Optimizer updates of each tuning trial; "
                                     "default: digits 60, retrieval 30.")
MAX_TRIALS = flags.DEFINE_integer("max_trials", None, "Tuning trials; default: digits 4, retrieval 2 "
                                  "(retrieval: 0 leaves the Tuner out; --retrieval_model=tfrs: 0 only).")
THRESHOLD = flags.DEFINE_float("accuracy_threshold", 0.8, "digits: Evaluator's accuracy lower bound for blessing.")
BEAM_RUNNING_MODES = ("in_memory", "multi_threading", "multi_processing")
BEAM_RUNNING_MODE = flags.DEFINE_enum(
    "beam_running_mode", "in_memory", BEAM_RUNNING_MODES,
    "How Beam's direct runner runs the Beam components (CsvExampleGen, StatisticsGen, Evaluator): "
    "in_memory (one worker, in this process), multi_threading (--beam_workers threads) or "
    "multi_processing (--beam_workers SDK worker processes).")
BEAM_WORKERS = flags.DEFINE_integer(
    "beam_workers", None, "Beam's worker count (direct_num_workers). in_memory takes only 1, its default; "
    "multi_threading and multi_processing default to the machine's CPU count.", lower_bound=1)
MEASURE = flags.DEFINE_boolean("measure_noise_scale", True,
                               "digits: the Trainer measures the gradient noise scale (the critical batch). "
                               "Not with retrieval (GradientCache gives no honest estimate), nor with "
                               "--micro_batch_size (off by default then).")
MICRO_BATCH_SIZE = flags.DEFINE_string(
    "micro_batch_size", None,
    "digits: the Trainer's micro_batch_size, an int or 'auto': its run_fn reads batches of the effective "
    "batch (the Tuner's best), each one optimizer update split into micro-batches of this size inside the "
    "training step, instead of accum_steps fit steps. Default: unset (accum_steps).",
    allow_override=True)     # the other pipeline runner defines it too (one process may import both)


def beam_pipeline_args(running_mode: str = "in_memory", workers: Optional[int] = None) -> list:
    """The pipeline's `beam_pipeline_args` for the direct runner.

    In memory with one worker, Beam's own defaults, the list is empty: given any
    arguments, each of TFX's Beam components first packs TFX's own source into a
    source distribution for a remote runner's workers (about 6 s each on 2 cores), which
    the direct runner never reads.

    Args:
        running_mode: one of `BEAM_RUNNING_MODES`.
        workers: Beam's `direct_num_workers`: 1 in memory; else default the
            CPU count.

    Returns:
        The arguments, as a list of flags.

    Raises:
        ValueError: another running mode, or workers other than 1 in memory
            (or below 1).
    """
    if running_mode not in BEAM_RUNNING_MODES:
        raise ValueError(f"running_mode={running_mode!r}: one of {', '.join(BEAM_RUNNING_MODES)}")
    if workers is None:
        workers = 1 if running_mode == "in_memory" else os.cpu_count() or 1
    if workers < 1 or (running_mode == "in_memory" and workers != 1):
        raise ValueError(f"workers={workers} with running_mode={running_mode!r}: in_memory takes 1, "
                         "multi_threading and multi_processing 1 or more")
    if running_mode == "in_memory":
        return []
    return [f"--direct_running_mode={running_mode}", f"--direct_num_workers={workers}"]


@flags.multi_flags_validator(["beam_running_mode", "beam_workers"],
                             message="--beam_workers above 1 needs --beam_running_mode=multi_processing or "
                                     "multi_threading: in_memory runs one worker")
def _beam_flags_agree(values):
    return values["beam_running_mode"] != "in_memory" or values["beam_workers"] in (None, 1)


def _beam_args():
    return beam_pipeline_args(BEAM_RUNNING_MODE.value, BEAM_WORKERS.value)


def latest_artifacts(metadata_path: str):
    """A reader of the newest artifacts in a SQLite ML Metadata store.

    Args:
        metadata_path: the store's file.

    Returns:
        `latest(type_name)`: the newest artifact of that type, or None.
    """
    import ml_metadata as mlmd
    from tfx import v1 as tfx

    store = mlmd.MetadataStore(tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path))

    def latest(type_name):
        artifacts = store.get_artifacts_by_type(type_name)
        return max(artifacts, key=lambda a: a.id) if artifacts else None

    return latest


def summarize(metadata_path: str, pipeline_name: str) -> dict:
    """Reads the run's outcome back from ML Metadata.

    Args:
        metadata_path: the run's SQLite store.
        pipeline_name: the pipeline's name (not read: the run's store is its own).

    Returns:
        What it found of `best_hyperparameters`, `trainer` (the model's
        recorded properties), `evaluation`, `blessed`, `pushed`, `pushed_to`.
    """
    latest = latest_artifacts(metadata_path)

    summary = {}
    hp = latest("HyperParameters")
    if hp:
        path = os.path.join(hp.uri, "best_hyperparameters.txt")
        with open(path) as f:
            summary["best_hyperparameters"] = json.load(f)["values"]
    model = latest("Model")
    if model:
        summary["trainer"] = {
            k: getattr(v, v.WhichOneof("value")) for k, v in model.custom_properties.items()
            if v.WhichOneof("value") in ("int_value", "string_value", "double_value")
        }
    evaluation = latest("ModelEvaluation")
    if evaluation:
        import tensorflow_model_analysis as tfma
        result = tfma.load_eval_result(evaluation.uri)
        metrics = result.slicing_metrics[0][1][""][""]
        summary["evaluation"] = {k: v.get("doubleValue") for k, v in metrics.items()}
    blessing = latest("ModelBlessing")
    if blessing:
        summary["blessed"] = bool(blessing.custom_properties["blessed"].int_value)
    pushed = latest("PushedModel")
    if pushed:
        summary["pushed"] = bool(pushed.custom_properties["pushed"].int_value)
        summary["pushed_to"] = pushed.custom_properties["pushed_destination"].string_value
    return summary


def noise_scale_line(trainer: dict) -> Optional[str]:
    """What the Trainer's record says about the gradient noise scale.

    Args:
        trainer: the model's recorded properties (`summarize`'s `trainer`).

    Returns:
        One line, or None if the Trainer did not measure.
    """
    if "noise_scale_status" not in trainer:
        return None
    if "noise_scale" not in trainer:
        return f"gradient noise scale: none recorded ({trainer['noise_scale_status']})"
    return (f"gradient noise scale: B_simple = {trainer['noise_scale']:.1f} samples "
            f"(from {trainer['noise_scale_windows']} windows; the effective batch was "
            f"{trainer.get('effective_batch_size')}): larger batches than this would save "
            "few updates")


def micro_batch_line(trainer: dict) -> Optional[str]:
    """What the Trainer's record says about its micro-batches with `micro_batch_size`.

    Args:
        trainer: the model's recorded properties (`summarize`'s `trainer`).

    Returns:
        One line, or None if the Trainer trained with `accum_steps` instead.
    """
    if "micro_batches_per_update" not in trainer:
        return None
    changes = json.loads(trainer.get("micro_batch_changes") or "[]")
    found = " (found by the run: 'auto')" if trainer.get("micro_batch_size_auto") else ""
    return (f"micro-batches: each update of {trainer.get('effective_batch_size')} samples trained as "
            f"{trainer['micro_batches_per_update']} micro-batches of {trainer.get('micro_batch_size')}{found} "
            f"inside one step; {len(changes)} change(s) of the micro-batch, "
            f"{trainer.get('micro_batch_out_of_memory_errors', 0)} out-of-memory error(s)")


def retrieval_recall(metadata_path: str, k: int = 10) -> dict:
    """Held-out recall@k of the newest trained model on the newest examples' eval split.

    Args:
        metadata_path: the run's SQLite store.
        k: how many of the top-scored items count.

    Returns:
        `evaluate.held_out_recall`'s dict.
    """
    from tfx.utils import path_utils

    from tfx_gradient_accumulator.pipelines.retrieval.evaluate import held_out_recall

    latest = latest_artifacts(metadata_path)
    model, examples = latest("Model"), latest("Examples")
    return held_out_recall(path_utils.serving_model_path(model.uri), examples.uri, k)


def _option(flag, index):
    return flag.value if flag.value is not None else DEFAULTS[PIPELINE.value][index]


def use_keras_2_for_tfrs():
    """Makes `tf.keras` Keras 2 in this process, as TensorFlow Recommenders needs:
    sets TF_USE_LEGACY_KERAS=1, which TensorFlow reads when it first resolves
    `tf.keras`. Raises app.UsageError where TensorFlow already resolved it to Keras 3."""
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    if "tensorflow" not in sys.modules:
        return                # not imported yet: tf.keras will be Keras 2
    import tensorflow as tf
    version = tf.keras.version() if hasattr(tf.keras, "version") else "2"   # Keras 2 may have none
    if version.startswith("3"):
        raise app.UsageError(
            f"--retrieval_model=tfrs needs tf.keras to be Keras 2 (TensorFlow Recommenders "
            f"is built on it), but this process had already resolved tf.keras to Keras {version}: "
            "run it in a fresh process, or start the process with TF_USE_LEGACY_KERAS=1.")


def micro_batch_size_flag(value: Optional[str]):
    """--micro_batch_size as the Trainer takes it: None, "auto" or an int.

    Args:
        value: the flag's text, or None.

    Returns:
        None, "auto" or the int.

    Raises:
        app.UsageError: anything else.
    """
    if value is None or value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise app.UsageError(f"--micro_batch_size={value!r}: an int >= 1 or 'auto'") from None


def _digits_measure(micro_batch_size) -> bool:
    """--measure_noise_scale for digits: off by default with --micro_batch_size (each step is a
    whole update: no windows to measure over), refused when asked for with it."""
    if micro_batch_size is None:
        return MEASURE.value
    if MEASURE.present and MEASURE.value:
        raise app.UsageError("--measure_noise_scale with --micro_batch_size: the noise scale is measured over "
                             "windows of several fit steps, and with micro_batch_size each step is one whole "
                             "update. Leave --measure_noise_scale out.")
    return False


def run_digits(root: str) -> None:
    """Writes the data, runs the digits pipeline under `root` and prints its outcome."""
    from tfx.orchestration.beam.beam_dag_runner import BeamDagRunner

    from tfx_gradient_accumulator.pipelines.digits.data import write_digits_csv
    from tfx_gradient_accumulator.pipelines.digits.pipeline import create_pipeline

    micro_batch_size = micro_batch_size_flag(MICRO_BATCH_SIZE.value)
    measure = _digits_measure(micro_batch_size)
    data_root = os.path.join(root, "data")
    write_digits_csv(data_root)
    metadata_path = os.path.join(root, "metadata.sqlite")
    name = "digits_accumulation"
    pipeline = create_pipeline(
        pipeline_name=name,
        pipeline_root=os.path.join(root, "pipeline_root"),
        data_root=data_root,
        serving_model_dir=os.path.join(root, "serving_model"),
        metadata_path=metadata_path,
        train_updates=_option(TRAIN_UPDATES, 0),
        tuner_updates=_option(TUNER_UPDATES, 1),
        max_trials=_option(MAX_TRIALS, 2),
        accuracy_threshold=THRESHOLD.value,
        measure_noise_scale=measure,
        micro_batch_size=micro_batch_size,
        beam_pipeline_args=_beam_args(),
    )
    BeamDagRunner().run(pipeline)
    summary = summarize(metadata_path, name)
    print("\n=== digits pipeline ===")
    print("best hyperparameters:", json.dumps(summary.get("best_hyperparameters"), sort_keys=True))
    print("trainer:", json.dumps(summary.get("trainer"), sort_keys=True))
    for line in (noise_scale_line(summary.get("trainer") or {}), micro_batch_line(summary.get("trainer") or {})):
        if line:
            print(line)
    print("evaluation:", json.dumps(summary.get("evaluation"), sort_keys=True))
    print("blessed:", summary.get("blessed"), "| pushed:", summary.get("pushed"))
    print("pushed model:", summary.get("pushed_to"))


def recall_line(recall: dict) -> str:
    """The held-out recall@k, read between what the generating distribution and chance reach.

    Args:
        recall: `evaluate.held_out_recall`'s dict.

    Returns:
        One line.
    """
    k = recall["k"]
    return (f"held-out recall@{k}: {recall['recall_at_k']:.3f} over {recall['interactions']} interactions "
            f"(ranking by the generating distribution: {recall['oracle_recall_at_k']:.3f}; "
            f"chance: {recall['chance_recall_at_k']:.3f})")


def _retrieval_max_trials():
    """--max_trials for the chosen model: the Tuner tunes Keras 3 models only."""
    if RETRIEVAL_MODEL.value == "keras":
        return _option(MAX_TRIALS, 2)
    if MAX_TRIALS.value:
        raise app.UsageError(
            f"--max_trials={MAX_TRIALS.value} with --retrieval_model={RETRIEVAL_MODEL.value}: that model "
            "trains without the Tuner (KerasTuner builds Keras 3 models only, keras-team/keras-tuner#1039); "
            "leave --max_trials out or pass --max_trials=0, or use --retrieval_model=keras.")
    return 0


def run_retrieval(root: str) -> None:
    """Writes the data, runs the retrieval pipeline under `root` and prints its outcome."""
    if MICRO_BATCH_SIZE.present:
        raise app.UsageError("--micro_batch_size is the digits pipeline's: the retrieval pipeline trains with "
                             "gradient_cache=True, which splits each batch itself.")
    if MEASURE.present:
        raise app.UsageError("--measure_noise_scale is the digits pipeline's: the retrieval pipeline trains "
                             "with gradient_cache=True, which gives the noise scale no honest estimate.")
    max_trials = _retrieval_max_trials()
    if RETRIEVAL_MODEL.value == "tfrs":
        use_keras_2_for_tfrs()     # before TFX's imports below resolve tf.keras

    from tfx.orchestration.beam.beam_dag_runner import BeamDagRunner

    from tfx_gradient_accumulator.pipelines.retrieval.data import write_interactions_csv
    from tfx_gradient_accumulator.pipelines.retrieval.pipeline import create_pipeline

    data_root = os.path.join(root, "data")
    write_interactions_csv(data_root)
    metadata_path = os.path.join(root, "metadata.sqlite")
    name = "retrieval_gradient_cache"
    BeamDagRunner().run(create_pipeline(
        pipeline_name=name,
        pipeline_root=os.path.join(root, "pipeline_root"),
        data_root=data_root,
        metadata_path=metadata_path,
        train_updates=_option(TRAIN_UPDATES, 0),
        tuner_updates=_option(TUNER_UPDATES, 1),
        max_trials=max_trials,
        beam_pipeline_args=_beam_args(),
        model=RETRIEVAL_MODEL.value,
    ))
    summary = summarize(metadata_path, name)
    print(f"\n=== retrieval pipeline ({RETRIEVAL_MODEL.value}) ===")
    print("best hyperparameters:", json.dumps(summary.get("best_hyperparameters"), sort_keys=True))
    print("trainer:", json.dumps(summary.get("trainer"), sort_keys=True))
    print(recall_line(retrieval_recall(metadata_path)))


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    if RETRIEVAL_MODEL.present and PIPELINE.value != "retrieval":
        raise app.UsageError(f"--retrieval_model is the retrieval pipeline's; --pipeline={PIPELINE.value} "
                             "has one model (pass --pipeline=retrieval).")
    root = os.path.abspath(OUTPUT_DIR.value or os.path.join("work", PIPELINE.value))
    (run_retrieval if PIPELINE.value == "retrieval" else run_digits)(root)


if __name__ == "__main__":
    app.run(main)
