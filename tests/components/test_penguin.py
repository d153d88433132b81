"""TFX's own penguin Keras module (as the installed tfx ships it; see `penguin.py` for
the two changes) through Transform and AccumulatingTrainer on a 2-process cluster, as
Vertex AI runs it, against the stock Trainer in one process.

Its run_fn constructs `tf.distribute.MirroredStrategy()` and builds a `tf.keras` model:
inside TFX, importing tensorflow_transform sets TF_USE_LEGACY_KERAS=1, so that is Keras 2
(tf_keras), as TFX gives it to its users.
"""

import glob
import os
import signal
import sys

import numpy as np
import pytest

from tests.accumulator.reference import max_abs_diff
from tests.components import fixtures, local_cluster, penguin, shipped

STEPS, ACCUM, EFFECTIVE = 6, 2, 20         # the module's batch, 20: 2 replicas x 5 x 2 micro-steps
STOCK = "tfx.components.trainer.executor.GenericExecutor"


@pytest.fixture(scope="module")
def transformed(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("penguin_module"))
    module_file = penguin.module(folder)
    sys.path.insert(0, folder)
    try:
        examples, graph = penguin.transform(module_file, str(tmp_path_factory.mktemp("transform")))
    finally:
        sys.path.remove(folder)
    return module_file, examples, graph


def _arguments(tmp, transformed, **accumulation):
    module_file, examples, graph = transformed
    inputs, outputs, properties = fixtures.executor_arguments(tmp, examples, num_steps=STEPS, module=module_file,
                                                              **accumulation)
    inputs["transform_graph"] = [graph]
    return inputs, outputs, properties


def _run(transformed, tmp, workers, executor=local_cluster.EXECUTOR, legacy=None, env=None, **accumulation):
    """`legacy`: TF_USE_LEGACY_KERAS in the replicas' environment (None: unset, as a fresh container starts)."""
    inputs, outputs, properties = _arguments(tmp / "run", transformed, **accumulation)
    path = os.pathsep.join([local_cluster.ROOT, os.path.dirname(transformed[0])])
    env = {i: {"PYTHONPATH": path, "TF_USE_LEGACY_KERAS": legacy, **((env or {}).get(i) or {})}
           for i in range(workers)}
    results = local_cluster.run(local_cluster.container_command(inputs, outputs, properties, executor), workers, tmp / "tmp",
                           env=env)
    return outputs, results


def _served(outputs):
    """The exported model's variables (by name) and its serving signature's logits on raw eval examples."""
    return shipped.served(outputs["model"][0].uri, penguin.raw_eval_examples())


@pytest.fixture(scope="module")
def legacy():
    """Keras 2, as TFX gives it: TF_USE_LEGACY_KERAS=1 in the replicas' environment, which is
    what TensorFlow Transform sets when it is imported before `tf.keras` is first used. (In a
    fresh `run_executor` process of TFX 1.16 with the variable unset, `tf.keras` is resolved
    before Transform is imported, and the module gets Keras 3.)"""
    return "1"


@pytest.fixture(scope="module")
def stock(transformed, legacy, tmp_path_factory):
    """TFX's stock Trainer, one process (the module's MirroredStrategy: one CPU replica), batch 20."""
    outputs, results = _run(transformed, tmp_path_factory.mktemp("stock"), 1, executor=STOCK, legacy=legacy)
    assert results[0][0] == 0, results[0][2][-3000:]
    return _served(outputs)


@pytest.mark.apart      # 191 s; the penguin module on one process and test_cluster's two processes run in make test
def test_tfx_penguin_module_trains_on_two_processes_like_the_stock_trainer(transformed, legacy, stock, tmp_path):
    outputs, results = _run(transformed, tmp_path, 2, legacy=legacy, accum_steps=ACCUM, effective_batch_size=EFFECTIVE)
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    variables, logits = _served(outputs)
    stock_variables, stock_logits = stock
    assert all("run_fn constructed tf.distribute.MirroredStrategy" in err for _, _, err in results)
    print(f"[measured] TFX's penguin module, 2 processes vs the stock Trainer in one: max |dw| = "
          f"{max_abs_diff(variables, stock_variables):.1e}, served logits {np.abs(logits - stock_logits).max():.1e}")
    assert len(variables) == len(stock_variables) > 0
    assert max_abs_diff(variables, stock_variables) <= 1e-5
    assert np.abs(logits - stock_logits).max() <= 1e-5
    # Exported once, recorded once.
    assert sorted(os.listdir(outputs["model"][0].uri)) == ["Format-Serving"]
    chief, worker = (local_cluster.published(out) for _, out, _ in results)
    recorded = local_cluster.custom_properties(chief["model"][0])
    assert {k: recorded[k] for k in ("workers", "replicas", "accum_steps", "effective_batch_size",
                                     "optimizer_updates")} == {
        "workers": 2, "replicas": 2, "accum_steps": ACCUM, "effective_batch_size": EFFECTIVE,
        "optimizer_updates": STEPS}
    assert local_cluster.custom_properties(worker["model"][0]) == {}
    assert len(glob.glob(os.path.join(outputs["model_run"][0].uri, "train", "events.out.tfevents.*"))) == 1
    assert len(glob.glob(os.path.join(outputs["model_run"][0].uri, "accumulation", "events.out.tfevents.*"))) == 1


# Apart (make test-apart, about 2.5 minutes each): make test kills and resumes the Keras 3
# Trainer on 1 and 2 processes (test_cluster.py) and the Keras 2 backup in the library
# (tests/keras2); this module's two-process training runs there too (above).
@pytest.mark.apart
@pytest.mark.parametrize("killed", ["worker", "chief"])
def test_tfx_penguin_module_killed_mid_window_resumes_exactly(killed, transformed, legacy, stock, tmp_path):
    """With backup_dir (a backup every update, 2 micro-steps), one replica is SIGKILLed after
    micro-step 5, mid-window; its peer fails; both are restarted, as Vertex restarts a job."""
    index = {"chief": 0, "worker": 1}[killed]
    arguments = dict(accum_steps=ACCUM, effective_batch_size=EFFECTIVE, backup_dir=str(tmp_path / "backups"),
                     backup_every=1)
    outputs, results = _run(transformed, tmp_path, 2, legacy=legacy, env={index: {"DIE_AFTER_STEPS": 5}},
                            **arguments)
    assert results[index][0] == -signal.SIGKILL and results[1 - index][0] != 0, results[1 - index][2][-3000:]
    assert not os.path.exists(os.path.join(outputs["model"][0].uri, "Format-Serving"))
    outputs, results = _run(transformed, tmp_path, 2, legacy=legacy, **arguments)
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    variables, logits = _served(outputs)
    print(f"[measured] TFX's penguin module, the {killed} killed mid-window and resumed, vs the stock Trainer: "
          f"max |dw| = {max_abs_diff(variables, stock[0]):.1e}, served logits {np.abs(logits - stock[1]).max():.1e}")
    assert max_abs_diff(variables, stock[0]) <= 1e-5
    assert np.abs(logits - stock[1]).max() <= 1e-5
    recorded = local_cluster.custom_properties(local_cluster.published(results[0][1])["model"][0])
    assert {k: recorded[k] for k in ("backup_resumes", "resumed_at_step", "resumed_at_update",
                                     "optimizer_updates")} == {
        "backup_resumes": 1, "resumed_at_step": 4, "resumed_at_update": 2, "optimizer_updates": STEPS}
    assert sorted(os.listdir(outputs["model"][0].uri)) == ["Format-Serving"]
