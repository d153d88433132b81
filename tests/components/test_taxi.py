"""TFX's own Trainer test module (`tfx/components/testdata/module_file/trainer_module.py`,
the Chicago taxi wide-and-deep model that TFX's Trainer executor tests train) on TFX's
own transformed taxi examples and transform graph, through AccumulatingTrainer against
the stock Trainer.

The module, as TFX wrote it: `tf.keras` (Keras 2 under Transform), `Normalization` and
`CategoryEncoding` inputs, Adam, a fixed batch of 40 in its `_input_fn`,
`MirroredStrategy()` in run_fn, a TensorBoard callback and `tf.saved_model.save` with
Transform's serving signatures. Changed only so that two runs compare:
`shuffle=False` in its dataset options and `set_random_seed(0)` before the model.

Both runs share one process (`executors_process`): much of each run's time is AutoGraph
converting Keras 2's code for the first `fit`, which the second reuses.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests.accumulator.reference import max_abs_diff
from tests.components import fixtures, local_cluster, shipped

TESTDATA = os.path.join(shipped.PACKAGE, "components", "testdata")
CHANGES = {"trainer_module.py": [
    ("batch_size=batch_size, label_key=_transformed_name(_LABEL_KEY)\n",
     "batch_size=batch_size, label_key=_transformed_name(_LABEL_KEY), shuffle=False\n"),
    ("  mirrored_strategy = tf.distribute.MirroredStrategy()\n",
     "  tf.keras.utils.set_random_seed(0)\n  mirrored_strategy = tf.distribute.MirroredStrategy()\n"),
]}
STEPS, ACCUM, BATCH = 6, 4, 40            # the module's batch: 4 micro-batches of 10
STOCK = "tfx.components.trainer.executor.GenericExecutor"


@pytest.fixture(scope="module")
def module_file(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("taxi_module"))
    return shipped.changed_copy(os.path.join(TESTDATA, "module_file"), CHANGES, folder)["trainer_module.py"]


def _artifacts():
    from tfx.types import artifact_utils, standard_artifacts
    examples, graph = standard_artifacts.Examples(), standard_artifacts.TransformGraph()
    examples.uri = os.path.join(TESTDATA, "transform", "transformed_examples")
    examples.split_names = artifact_utils.encode_split_names(["train", "eval"])
    graph.uri = os.path.join(TESTDATA, "transform", "transform_graph")
    return examples, graph


def _runs(module_file, tmp, **accumulation):
    """The stock Trainer, then ours with `accumulation`, on one replica, with Keras 2 as TFX
    gives it under Transform (TF_USE_LEGACY_KERAS=1): each as `run_executor` runs it, one
    after the other in one process (`executors_process`: the second reuses the first's
    AutoGraph conversions). [(served variables, served outputs)] of both, and ours' stdout
    and stderr."""
    examples, graph = _artifacts()
    runs, commands = [], []
    for name, executor, arguments in (("stock", STOCK, {}), ("ours", local_cluster.EXECUTOR, accumulation)):
        inputs, outputs, properties = fixtures.executor_arguments(tmp / name, examples, num_steps=STEPS,
                                                                  module=module_file, **arguments)
        inputs["transform_graph"] = [graph]
        runs.append(outputs)
        commands.append(local_cluster.container_command(inputs, outputs, properties, executor))
    (tmp / "commands.json").write_text(json.dumps(commands))
    (tmp / "tmp").mkdir()
    done = subprocess.run([sys.executable, "-m", "tests.components.executors_process", str(tmp / "commands.json")],
                          cwd=local_cluster.ROOT, capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHONPATH=local_cluster.ROOT, TF_USE_LEGACY_KERAS="1",
                                   TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=str(tmp / "tmp")))
    assert done.returncode == 0, done.stderr[-3000:]
    ours_stderr = done.stderr[done.stderr.rindex(local_cluster.EXECUTOR + " do:"):]
    raw = shipped.raw_examples(os.path.join(TESTDATA, "csv_example_gen", "Split-eval"))
    return [shipped.served(outputs["model"][0].uri, raw) for outputs in runs], done.stdout, ours_stderr


def test_tfx_taxi_trainer_module_trains_like_the_stock_trainer(module_file, tmp_path):
    [(stock_variables, stock_outputs), (variables, outputs)], stdout, stderr = _runs(
        module_file, tmp_path, accum_steps=ACCUM, effective_batch_size=BATCH)
    assert "run_fn constructed tf.distribute.MirroredStrategy" in stderr
    print(f"[measured] TFX's taxi Trainer module, accum_steps={ACCUM} vs the stock Trainer at batch {BATCH}: "
          f"max |dw| = {max_abs_diff(variables, stock_variables):.1e}, "
          f"served outputs {np.abs(outputs - stock_outputs).max():.1e}")
    assert len(variables) == len(stock_variables) == 10      # 5 Dense layers
    assert max_abs_diff(variables, stock_variables) <= 1e-5
    assert np.abs(outputs - stock_outputs).max() <= 1e-5
    recorded = local_cluster.custom_properties(local_cluster.published(stdout)["model"][0])
    assert {k: recorded[k] for k in ("accum_steps", "effective_batch_size", "optimizer_updates")} == {
        "accum_steps": ACCUM, "effective_batch_size": BATCH, "optimizer_updates": STEPS}
