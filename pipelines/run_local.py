"""Runs the digits pipeline locally: Beam DirectRunner, SQLite ML Metadata.

    python -m pipelines.run_local --output_dir=work/digits

Writes the shipped data as CSV, runs the pipeline (a second run reuses cached
results), and prints the chosen hyperparameters, the Trainer's record (with the
gradient noise scale it measured), the evaluation and where the pushed model is.
"""

import json
import os

from absl import app, flags, logging

OUTPUT_DIR = flags.DEFINE_string("output_dir", "work/digits", "Where data, artifacts, metadata and the pushed model go.")
TRAIN_UPDATES = flags.DEFINE_integer("train_updates", 400, "Optimizer updates of the Trainer (TrainArgs.num_steps).")
TUNER_UPDATES = flags.DEFINE_integer("tuner_updates", 60, "Optimizer updates of each tuning trial.")
MAX_TRIALS = flags.DEFINE_integer("max_trials", 4, "Tuning trials.")
THRESHOLD = flags.DEFINE_float("accuracy_threshold", 0.8, "Evaluator's accuracy lower bound for blessing.")
MEASURE = flags.DEFINE_boolean("measure_noise_scale", True,
                               "The Trainer measures the gradient noise scale (the critical batch).")


def summarize(metadata_path, pipeline_name):
    """Reads the run's outcome back from ML Metadata; returns a dict."""
    import ml_metadata as mlmd
    from tfx import v1 as tfx

    store = mlmd.MetadataStore(tfx.orchestration.metadata.sqlite_metadata_connection_config(metadata_path))

    def latest(type_name):
        artifacts = store.get_artifacts_by_type(type_name)
        return max(artifacts, key=lambda a: a.id) if artifacts else None

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


def noise_scale_line(trainer):
    """What the Trainer's record says about the gradient noise scale; None if it did not measure."""
    if "noise_scale_status" not in trainer:
        return None
    if "noise_scale" not in trainer:
        return f"gradient noise scale: none recorded ({trainer['noise_scale_status']})"
    return (f"gradient noise scale: B_simple = {trainer['noise_scale']:.1f} samples "
            f"(from {trainer['noise_scale_windows']} windows; the effective batch was "
            f"{trainer.get('effective_batch_size')}): larger batches than this would save "
            "few updates")


def main(argv):
    del argv
    from tfx.orchestration.beam.beam_dag_runner import BeamDagRunner

    from pipelines.digits.data import write_digits_csv
    from pipelines.digits.pipeline import create_pipeline

    logging.set_verbosity(logging.INFO)
    root = os.path.abspath(OUTPUT_DIR.value)
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
        train_updates=TRAIN_UPDATES.value,
        tuner_updates=TUNER_UPDATES.value,
        max_trials=MAX_TRIALS.value,
        accuracy_threshold=THRESHOLD.value,
        measure_noise_scale=MEASURE.value,
    )
    BeamDagRunner().run(pipeline)
    summary = summarize(metadata_path, name)
    print("\n=== digits pipeline ===")
    print("best hyperparameters:", json.dumps(summary.get("best_hyperparameters"), sort_keys=True))
    print("trainer:", json.dumps(summary.get("trainer"), sort_keys=True))
    noise = noise_scale_line(summary.get("trainer") or {})
    if noise:
        print(noise)
    print("evaluation:", json.dumps(summary.get("evaluation"), sort_keys=True))
    print("blessed:", summary.get("blessed"), "| pushed:", summary.get("pushed"))
    print("pushed model:", summary.get("pushed_to"))


if __name__ == "__main__":
    app.run(main)
