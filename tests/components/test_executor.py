"""AccumulatingTrainer's executor against the stock TFX Trainer executor."""

import glob
import os

import keras
import pytest
import tensorflow as tf

from tests.accumulator.reference import max_abs_diff
from tests.components import fixtures


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return fixtures.write_examples(str(tmp_path_factory.mktemp("examples")))


def test_unchanged_stock_module_trains_like_the_stock_trainer_with_the_big_batch(examples, tmp_path):
    """Stock Trainer: batch 32, 6 steps. Ours: effective 32 in micro-batches of 8, 6 updates."""
    _, stock_seen, stock_weights = fixtures.run_executor(tmp_path / "stock", examples, num_steps=6, stock=True)
    outputs, seen, weights = fixtures.run_executor(
        tmp_path / "ours", examples, num_steps=6, accum_steps=4, effective_batch_size=32
    )
    assert stock_seen["train_batch"] == 32 and stock_seen["iterations"] == 6
    assert seen == {
        "train_steps": 24, "train_batch": 8, "eval_batch": 16, "optimizer": "GradientAccumulator",
        "accum_steps": 4, "iterations": 6, "strategy": stock_seen["strategy"], "partial_window": "apply",
    }
    assert max_abs_diff(weights, stock_weights) <= 1e-5
    assert os.path.exists(os.path.join(outputs["model"][0].uri, "Format-Serving", "saved_model.pb"))


def test_hyperparameters_win_over_parameters_and_are_recorded(examples, tmp_path):
    hp = fixtures.hyperparameters_artifact(str(tmp_path / "hp"), {"accum_steps": 2, "effective_batch_size": 16})
    outputs, seen, _ = fixtures.run_executor(
        tmp_path / "run", examples, num_steps=3, hyperparameters=hp, accum_steps=4, effective_batch_size=32
    )
    assert (seen["accum_steps"], seen["train_batch"], seen["train_steps"], seen["iterations"]) == (2, 8, 6, 3)
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        assert artifact.get_int_custom_property("accum_steps") == 2
        assert artifact.get_int_custom_property("effective_batch_size") == 16
        assert artifact.get_int_custom_property("micro_batch_size") == 8
        assert artifact.get_int_custom_property("replicas") == 1
        assert artifact.get_int_custom_property("optimizer_updates") == 3
        assert artifact.get_string_custom_property("partial_window") == "apply"
    events = glob.glob(os.path.join(outputs["model_run"][0].uri, "accumulation", "events.out.tfevents.*"))
    assert events


def test_without_effective_batch_the_run_fns_batch_is_the_micro_batch(examples, tmp_path):
    _, seen, _ = fixtures.run_executor(tmp_path, examples, num_steps=2, accum_steps=3)
    assert (seen["train_batch"], seen["train_steps"], seen["iterations"]) == (32, 6, 2)


def test_compile_and_strategy_scope_are_restored_after_the_run(examples, tmp_path):
    before = (keras.Model.compile, tf.distribute.Strategy.scope, dict(vars(tf.distribute.Strategy)))
    fixtures.run_executor(tmp_path, examples, num_steps=1, accum_steps=2, strategy="mirrored")
    assert (keras.Model.compile, tf.distribute.Strategy.scope, dict(vars(tf.distribute.Strategy))) == before


def test_a_run_that_wrapped_no_optimizer_fails_instead_of_recording_accumulation(examples, tmp_path):
    with pytest.raises(RuntimeError, match="wrapped no optimizer"):
        fixtures.run_executor(tmp_path, examples, num_steps=2, accum_steps=4,
                              module=os.path.join(fixtures.TESTDATA, "custom_loop_module.py"))
    assert not os.path.exists(tmp_path / "model_run" / "accumulation")


def test_run_fn_with_its_own_strategy_scope_keeps_working(examples, tmp_path):
    _, seen, _ = fixtures.run_executor(
        tmp_path, examples, num_steps=2, accum_steps=2, strategy="mirrored",
        custom_config={"own_strategy": True},
    )
    assert seen["strategy"] == "MirroredStrategy"
    assert seen["iterations"] == 2


@pytest.mark.parametrize(
    "properties, message",
    [
        ({"accum_steps": 0}, "accum_steps"),
        ({"accum_steps": 3, "effective_batch_size": 32}, "divide evenly"),
        ({"effective_batch_size": -4}, "effective_batch_size"),
        ({"strategy": "tpu"}, "kind"),
        ({"partial_window": "flush"}, "partial_window"),
    ],
)
def test_bad_settings_fail_before_training(examples, tmp_path, properties, message):
    with pytest.raises(ValueError, match=message):
        fixtures.run_executor(tmp_path, examples, num_steps=1, **properties)
    assert not os.path.exists(tmp_path / "model_run" / "seen.json")


def test_module_without_run_fn_is_refused(examples, tmp_path):
    with pytest.raises(ValueError, match="run_fn"):
        fixtures.run_executor(tmp_path, examples, module=os.path.join(fixtures.TESTDATA, "no_run_fn_module.py"))


def test_partial_window_parameter_reaches_the_optimizer_and_is_recorded(examples, tmp_path):
    outputs, seen, _ = fixtures.run_executor(tmp_path, examples, num_steps=2, accum_steps=2,
                                             partial_window="carry")
    assert (seen["partial_window"], seen["iterations"]) == ("carry", 2)
    assert outputs["model"][0].get_string_custom_property("partial_window") == "carry"
    assert outputs["model"][0].get_int_custom_property("unapplied_micro_batches") == 0


def test_a_carried_remainder_is_recorded_not_hidden(examples, tmp_path):
    # A run_fn that trains 3 x 2 + 1 = 7 micro-steps in windows of 2: 3 updates, 1 held.
    outputs, seen, _ = fixtures.run_executor(tmp_path, examples, num_steps=3, accum_steps=2,
                                             partial_window="carry", custom_config={"extra_micro_steps": 1})
    assert seen["iterations"] == 3
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        assert artifact.get_int_custom_property("unapplied_micro_batches") == 1
        assert artifact.get_int_custom_property("optimizer_updates") == 3


def test_accumulation_schedule_parameter_reaches_the_optimizer(examples, tmp_path):
    _, seen, _ = fixtures.run_executor(
        tmp_path, examples, num_steps=2, accum_steps=8, accum_schedule='{"0": 3, "5": 6}'
    )
    # Epoch 0 of the schedule: accum 3 (the schedule replaces accum_steps).
    assert (seen["accum_steps"], seen["train_steps"], seen["iterations"]) == (3, 6, 2)


KERAS2_MODULE = os.path.join(fixtures.TESTDATA, "keras2_regression_module.py")


def test_keras_2_module_trains_like_the_stock_trainer_with_the_big_batch(examples, tmp_path):
    """A tf_keras (TF_USE_LEGACY_KERAS=1) penguin-style module, unchanged: stock Trainer at
    batch 32 against AccumulatingTrainer(accum_steps=4) in micro-batches of 8."""
    pytest.importorskip("tf_keras")
    outputs_stock, stock_seen, stock_weights = fixtures.run_executor(
        tmp_path / "stock", examples, num_steps=6, stock=True, module=KERAS2_MODULE)
    outputs, seen, weights = fixtures.run_executor(
        tmp_path / "ours", examples, num_steps=6, accum_steps=4, effective_batch_size=32, module=KERAS2_MODULE)
    assert stock_seen["keras"].startswith("2.") and stock_seen["iterations"] == 6
    assert (seen["optimizer_module"], seen["accum_steps"], seen["train_batch"]) == ("accumulator.keras2", 4, 8)
    # A quarter of the stock Trainer's updates at the micro-batch (24 micro-steps, 6 updates)...
    assert (seen["train_steps"], seen["iterations"]) == (24, 6)
    # ...with the stock Trainer's weights at the 4x batch.
    assert max_abs_diff(weights, stock_weights) <= 1e-5
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        assert artifact.get_int_custom_property("optimizer_updates") == 6
        assert artifact.get_int_custom_property("accum_steps") == 4
    assert os.path.exists(os.path.join(outputs["model"][0].uri, "Format-Serving", "saved_model.pb"))
