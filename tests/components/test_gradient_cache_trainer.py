"""AccumulatingTrainer(gradient_cache=True) against the stock TFX Trainer's large batch.

A two-tower retrieval module (in-batch softmax: the batch is the negatives) wraps
its model in `GradientCache(two_tower, accum_steps=1)`; the Trainer sets
accum_steps and batches the data at the effective batch. Reference: the stock
Trainer running the same model unwrapped (`plain`) at that batch. Control:
plain accumulation (`GradientAccumulator`, micro-batches with their own
negatives) lands elsewhere, so the comparison can fail.
"""

import glob
import importlib.util
import json
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from tests.accumulator.reference import max_abs_diff
from tests.components import fixtures

MODULE = os.path.join(fixtures.TESTDATA, "two_tower_module.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOLERANCE = 1e-5
PLAIN = {"plain": True}


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return fixtures.write_interactions(str(tmp_path_factory.mktemp("interactions")))


def _run(tmp, examples, **kwargs):
    return fixtures.run_executor(tmp, examples, module=MODULE, **kwargs)


@pytest.fixture(scope="module")
def stock(examples, tmp_path_factory):
    """The stock Trainer: the plain two-tower at batch 32, 6 steps, once for the tests of this
    module that compare with it (they only read its outputs and weights)."""
    return _run(tmp_path_factory.mktemp("stock"), examples, num_steps=6, stock=True, custom_config=PLAIN)


def _initial_weights():
    module = fixtures.load_module(MODULE, "two_tower_module_reference")
    return module._two_tower().get_weights()


def test_gradient_cache_trains_like_the_stock_trainer_at_the_effective_batch(examples, stock, tmp_path):
    """Stock Trainer: the plain two-tower at batch 32, 6 steps. Ours: GradientCache in 4
    micro-batches of 8, batches of 32, 6 updates."""
    _, stock_seen, stock_weights = stock
    outputs, seen, weights = _run(tmp_path / "ours", examples, num_steps=6, gradient_cache=1,
                                  accum_steps=4, effective_batch_size=32)
    assert (stock_seen["model"], stock_seen["train_batch"], stock_seen["iterations"]) == ("TwoTower", 32, 6)
    assert seen == {
        "train_steps": 6, "train_batch": 32, "model": "GradientCache", "accum_steps": 4,
        "optimizer": "Adam", "iterations": 6,
        "accumulation": {"accum_steps": 4, "micro_batch_size": 8, "replicas": 1, "effective_batch_size": 32,
                         "measure_noise_scale": 0, "merge_duplicate_rows": 0, "gradient_cache": 1,
                         "accum_steps_auto": 0, "max_effective_batch_size": 0, "gather_across_replicas": 0,
                         "lr_ramp_updates": 0, "accum_steps_fit": 0,
                         "optimizer_updates": 6},
    }
    print("max |dw| against the stock Trainer:", max_abs_diff(weights, stock_weights),
          "moved from the initial weights:", max_abs_diff(weights, _initial_weights()))
    assert max_abs_diff(weights, stock_weights) <= TOLERANCE
    assert max_abs_diff(weights, _initial_weights()) > 1e-2          # it trained
    for artifact in outputs["model"] + outputs["model_run"]:
        recorded = {name: artifact.get_int_custom_property(name) for name in (
            "gradient_cache", "accum_steps", "effective_batch_size", "micro_batch_size", "replicas",
            "optimizer_updates", "unapplied_micro_batches", "measure_noise_scale")}
        assert recorded == {"gradient_cache": 1, "accum_steps": 4, "effective_batch_size": 32,
                            "micro_batch_size": 8, "replicas": 1, "optimizer_updates": 6,
                            "unapplied_micro_batches": 0, "measure_noise_scale": 0}
        assert not artifact.has_custom_property("noise_scale_status")
    assert _tensorboard_scalar(outputs["model_run"][0].uri, "accumulation/gradient_cache") == 1.0
    assert os.path.exists(os.path.join(outputs["model"][0].uri, "Format-Serving", "saved_model.pb"))


def test_plain_accumulation_of_the_same_loss_lands_elsewhere(examples, stock, tmp_path):
    """The control: AccumulatingTrainer without gradient_cache on the unwrapped model
    (GradientAccumulator, micro-batches of 8 with 7 negatives each)."""
    _, _, stock_weights = stock
    _, seen, weights = _run(tmp_path / "plain", examples, num_steps=6, accum_steps=4, effective_batch_size=32,
                            custom_config=PLAIN)
    assert (seen["optimizer"], seen["train_batch"], seen["train_steps"]) == ("GradientAccumulator", 8, 24)
    print("plain accumulation, max |dw| against the stock Trainer:", max_abs_diff(weights, stock_weights))
    assert max_abs_diff(weights, stock_weights) > 100 * TOLERANCE


def test_tuned_accumulation_and_batch_win_with_gradient_cache(examples, tmp_path):
    """The Tuner's best (accum_steps 2, effective batch 16) over the parameters (4, 32):
    trains like the stock Trainer at batch 16."""
    hp = fixtures.hyperparameters_artifact(str(tmp_path / "hp"), {"accum_steps": 2, "effective_batch_size": 16})
    outputs, seen, weights = _run(tmp_path / "ours", examples, num_steps=5, hyperparameters=hp, gradient_cache=1,
                                  accum_steps=4, effective_batch_size=32)
    _, _, stock_weights = _run(tmp_path / "stock", examples, num_steps=5, stock=True,
                               custom_config={"plain": True, "batch_size": 16})
    assert (seen["accum_steps"], seen["train_batch"], seen["train_steps"], seen["iterations"]) == (2, 16, 5, 5)
    assert max_abs_diff(weights, stock_weights) <= TOLERANCE
    for artifact in outputs["model"] + outputs["model_run"]:
        assert artifact.get_int_custom_property("accum_steps") == 2
        assert artifact.get_int_custom_property("effective_batch_size") == 16
        assert artifact.get_int_custom_property("micro_batch_size") == 8
        assert artifact.get_int_custom_property("gradient_cache") == 1


def test_without_effective_batch_the_run_fns_batch_is_the_effective_batch(examples, tmp_path):
    outputs, seen, _ = _run(tmp_path, examples, num_steps=2, gradient_cache=1, accum_steps=4)
    assert (seen["train_batch"], seen["accum_steps"], seen["train_steps"], seen["iterations"]) == (32, 4, 2, 2)
    assert outputs["model"][0].get_int_custom_property("micro_batch_size") == 0      # not set: the run_fn's


def test_compile_is_restored_after_a_gradient_cache_run(examples, tmp_path):
    before = keras.Model.compile
    _run(tmp_path, examples, num_steps=1, gradient_cache=1, accum_steps=2)
    assert keras.Model.compile is before


@pytest.mark.parametrize(
    "properties, custom_config, message",
    [
        ({"gradient_cache": 1, "accum_steps": 4}, PLAIN,
         r"must wrap its model in accumulator\.GradientCache.*it compiled a TwoTower"),
        ({"accum_steps": 4}, None, "GradientCache .*without gradient_cache=True.*accumulated twice.*"
                                   "Set gradient_cache=True on the component"),
        ({"gradient_cache": 2}, None, "`gradient_cache` must be True or False; received 2"),
        ({"gradient_cache": 1, "accum_steps": 2, "measure_noise_scale": 1}, None,
         r"`measure_noise_scale=True` \(from component parameter\) is not supported with `gradient_cache=True`"),
        ({"gradient_cache": 1, "accum_schedule": '{"0": 2, "3": 4}'}, None, "`accum_schedule` is not supported"),
        ({"gradient_cache": 1, "partial_window": "carry"}, None, "`partial_window='carry'` is not supported"),
        ({"gradient_cache": 1, "merge_duplicate_rows": 1}, None, "`merge_duplicate_rows=True` is not supported"),
        ({"gather_across_replicas": 1, "accum_steps": 4}, None,
         "`gather_across_replicas=True` needs `gradient_cache=True`"),
    ],
)
def test_refusals_come_before_training(examples, tmp_path, properties, custom_config, message):
    with pytest.raises(ValueError, match=message):
        _run(tmp_path, examples, num_steps=1, custom_config=custom_config, **properties)
    assert not os.path.exists(tmp_path / "model_run" / "seen.json")
    assert not os.path.exists(tmp_path / "model_run" / "accumulation")


def test_a_tuned_measure_noise_scale_is_refused_with_gradient_cache(examples, tmp_path):
    hp = fixtures.hyperparameters_artifact(str(tmp_path / "hp"), {"accum_steps": 2, "measure_noise_scale": True})
    with pytest.raises(ValueError, match=r"`measure_noise_scale=True` \(from hyperparameters\) is not supported"):
        _run(tmp_path / "run", examples, num_steps=1, hyperparameters=hp, gradient_cache=1)


def _tensorboard_scalar(model_run_uri, tag):
    for path in glob.glob(os.path.join(model_run_uri, "accumulation", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    return float(tf.make_ndarray(value.tensor))
    return None


def test_a_run_that_compiled_no_gradient_cache_fails_instead_of_recording_one(tmp_path):
    examples = fixtures.write_examples(str(tmp_path / "examples"))
    with pytest.raises(RuntimeError, match=r"TrainerOptions\(gradient_cache=True\)\) saw no GradientCache compiled"):
        fixtures.run_executor(tmp_path / "run", examples, num_steps=2, gradient_cache=1, accum_steps=4,
                              module=os.path.join(fixtures.TESTDATA, "custom_loop_module.py"))
    assert not os.path.exists(tmp_path / "run" / "model_run" / "accumulation")


KERAS2_MODULE = os.path.join(fixtures.TESTDATA, "keras2_two_tower_module.py")


def _keras2_initial_weights():
    module = fixtures.load_module(KERAS2_MODULE, "keras2_two_tower_module_reference")
    return module._two_tower().get_weights()


def test_a_keras_2_module_trains_like_the_stock_trainer_at_the_effective_batch(examples, tmp_path):
    """The same two-tower written with Keras 2 (`tf_keras`, as under TF_USE_LEGACY_KERAS=1):
    its GradientCache is the Keras 2 one; stock Trainer at batch 32 against ours in 4
    micro-batches of 8; control: plain accumulation of the same Keras 2 model."""
    _, _, stock_weights = fixtures.run_executor(tmp_path / "stock", examples, module=KERAS2_MODULE,
                                                num_steps=6, stock=True, custom_config=PLAIN)
    outputs, seen, weights = fixtures.run_executor(tmp_path / "ours", examples, module=KERAS2_MODULE,
                                                   num_steps=6, gradient_cache=1, accum_steps=4,
                                                   effective_batch_size=32)
    assert (seen["model"], seen["keras2"], seen["train_batch"], seen["iterations"]) == ("GradientCache", True, 32, 6)
    print("Keras 2 module, max |dw| against the stock Trainer:", max_abs_diff(weights, stock_weights))
    assert max_abs_diff(weights, stock_weights) <= TOLERANCE
    assert outputs["model"][0].get_int_custom_property("gradient_cache") == 1
    assert os.path.exists(os.path.join(outputs["model"][0].uri, "Format-Serving", "saved_model.pb"))
    _, seen, plain = fixtures.run_executor(tmp_path / "plain", examples, module=KERAS2_MODULE, num_steps=6,
                                           accum_steps=4, effective_batch_size=32, custom_config=PLAIN)
    assert seen["optimizer"] == "GradientAccumulator"
    assert max_abs_diff(plain, stock_weights) > 100 * TOLERANCE


def test_gathered_across_two_replicas_it_trains_like_the_stock_trainer_on_one_device(examples, stock, tmp_path):
    """`gather_across_replicas=1` under MirroredStrategy on 2 replicas (logical CPUs):
    every replica scores the whole batch of 32, so the run lands on the stock Trainer's
    one-device batch of 32. Control: the same run without gathering (each replica's
    16 samples their own negatives, as Keras' large batch under the strategy)."""
    _, _, stock_weights = stock
    runs = {}
    for gather in (1, 0):
        outputs, seen, weights = _run(tmp_path / f"gather{gather}", examples, num_steps=6, gradient_cache=1,
                                      accum_steps=4, effective_batch_size=32, strategy="mirrored",
                                      gather_across_replicas=gather)
        runs[gather] = max_abs_diff(weights, stock_weights)
        assert (seen["train_batch"], seen["iterations"]) == (32, 6)
        assert seen["accumulation"]["gather_across_replicas"] == gather
        for artifact in outputs["model"] + outputs["model_run"]:
            recorded = {name: artifact.get_int_custom_property(name)
                        for name in ("gather_across_replicas", "replicas", "gradient_cache", "accum_steps")}
            assert recorded == {"gather_across_replicas": gather, "replicas": 2, "gradient_cache": 1,
                                "accum_steps": 4}
            assert artifact.get_string_custom_property("distribution_strategy") == "MirroredStrategy"
        assert _tensorboard_scalar(outputs["model_run"][0].uri, "accumulation/gather_across_replicas") == gather
    print("2 replicas, max |dw| against the stock Trainer on one device: gathered", runs[1],
          "each share alone", runs[0])
    assert runs[1] <= TOLERANCE
    assert runs[0] > 100 * TOLERANCE


# Apart (48 s, a fresh Keras 2 process): the Keras 3 module gathers through the Trainer in make
# test, and tests/keras2 gathers Keras 2's negatives on 2 replicas.
@pytest.mark.apart
def test_a_keras_2_module_gathered_across_two_replicas_trains_like_the_stock_trainer_on_one_device(
        examples, tmp_path):
    """The tf_keras two-tower with `gather_across_replicas=1` under MirroredStrategy on 2
    replicas: its Keras 2 GradientCache scores the whole batch of 32 on each replica, as
    the stock Trainer's one device does. (The control, tf_keras' own large batch under
    the strategy landing elsewhere, is tests/keras2's: a third Trainer run costs 25 s.)"""
    _, _, stock_weights = fixtures.run_executor(tmp_path / "stock", examples, module=KERAS2_MODULE,
                                                num_steps=6, stock=True, custom_config=PLAIN)
    outputs, seen, weights = fixtures.run_executor(
        tmp_path / "gathered", examples, module=KERAS2_MODULE, num_steps=6, gradient_cache=1,
        accum_steps=4, effective_batch_size=32, strategy="mirrored", gather_across_replicas=1)
    assert (seen["model"], seen["keras2"], seen["train_batch"], seen["iterations"]) == ("GradientCache", True, 32, 6)
    recorded = {name: outputs["model"][0].get_int_custom_property(name) for name in ("gather_across_replicas", "replicas")}
    assert recorded == {"gather_across_replicas": 1, "replicas": 2}
    print("[measured] Keras 2 module, 2 replicas gathered, max |dw| against the stock Trainer on one device:",
          max_abs_diff(weights, stock_weights))
    assert max_abs_diff(weights, stock_weights) <= TOLERANCE
    assert max_abs_diff(weights, _keras2_initial_weights()) > 1e-2          # it trained


@pytest.mark.apart      # about 90 s: four Trainer runs in a fresh process
@pytest.mark.skipif(importlib.util.find_spec("tensorflow_recommenders") is None,
                    reason="TensorFlow Recommenders is not installed (make setup installs it)")
def test_the_retrieval_demos_tfrs_module_gathered_on_two_replicas_trains_like_tfrs_large_batch(tmp_path):
    """The demo's TFRS module file, unchanged, through the Trainer with
    `gather_across_replicas=1` on 2 replicas (tests/components/tfrs_gathered_process.py,
    in a process of its own: TFRS needs Keras 2). Reference: TFRS's own step on the
    batch of 64 on one device (accum_steps=1); the exported towers' embeddings of every
    user and item are compared. Control: the same 2 replicas without gathering, which
    tf_keras refuses (the module's loss is the batch's mean)."""
    env = {k: v for k, v in os.environ.items() if k != "TF_USE_LEGACY_KERAS"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    done = subprocess.run([sys.executable, "-m", "tests.components.tfrs_gathered_process", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print("[measured] the demo's TFRS module, max |d embedding| from TFRS's large batch of 64: 2 replicas gathered",
          result["gathered"], "one device", result["one"], "(moved", result["moved"], ")")
    assert result["gathered"] <= TOLERANCE and result["one"] <= TOLERANCE
    assert result["moved"] > 1e-2                                            # it trained
    assert result["gathered_recorded"] == {"gather_across_replicas": 1, "replicas": 2, "gradient_cache": 1,
                                           "accum_steps": 4}
    assert (result["trained"]["tfrs_model"], result["trained"]["optimizer_updates"]) == (True, 4)
    assert result["control"].startswith("ValueError") and "Reduction.SUM" in result["control"], result["control"]
