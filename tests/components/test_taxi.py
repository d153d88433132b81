"""TFX's own Trainer test module (`tfx/components/testdata/module_file/trainer_module.py`,
the Chicago taxi wide-and-deep model that TFX's Trainer executor tests train) on TFX's
own transformed taxi examples and transform graph, through AccumulatingTrainer against
the stock Trainer.

The module, as TFX wrote it: `tf.keras` (Keras 2 under Transform), `Normalization` and
`CategoryEncoding` inputs, Adam, a fixed batch of 40 in its `_input_fn`,
`MirroredStrategy()` in run_fn, a TensorBoard callback and `tf.saved_model.save` with
Transform's serving signatures. Changed only so that two runs compare:
`shuffle=False` in its dataset options and `set_random_seed(0)` before the model.
"""

import os

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


def _run(module_file, tmp, executor=local_cluster.EXECUTOR, **accumulation):
    """One replica, with Keras 2 as TFX gives it under Transform (TF_USE_LEGACY_KERAS=1)."""
    examples, graph = _artifacts()
    inputs, outputs, properties = fixtures.executor_arguments(tmp / "run", examples, num_steps=STEPS,
                                                              module=module_file, **accumulation)
    inputs["transform_graph"] = [graph]
    env = {0: {"PYTHONPATH": local_cluster.ROOT, "TF_USE_LEGACY_KERAS": "1"}}
    [(code, stdout, stderr)] = local_cluster.run(local_cluster.container_command(inputs, outputs, properties, executor), 1,
                                            tmp / "tmp", env=env)
    assert code == 0, stderr[-3000:]
    raw = shipped.raw_examples(os.path.join(TESTDATA, "csv_example_gen", "Split-eval"))
    return shipped.served(outputs["model"][0].uri, raw), stdout, stderr


def test_tfx_taxi_trainer_module_trains_like_the_stock_trainer(module_file, tmp_path):
    (stock_variables, stock_outputs), _, _ = _run(module_file, tmp_path / "stock", executor=STOCK)
    (variables, outputs), stdout, stderr = _run(module_file, tmp_path / "ours", accum_steps=ACCUM,
                                                effective_batch_size=BATCH)
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
