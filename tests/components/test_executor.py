"""AccumulatingTrainer's executor against the stock TFX Trainer executor."""

import glob
import importlib.util
import math
import os

import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator.reference import max_abs_diff
from tests.components import fixtures


def test_unchanged_stock_module_trains_like_the_stock_trainer_with_the_big_batch(examples, stock_regression, tmp_path):
    """Stock Trainer: batch 32, 6 steps. Ours: effective 32 in micro-batches of 8, 6 updates."""
    _, stock_seen, stock_weights = stock_regression
    outputs, seen, weights = fixtures.run_executor(
        tmp_path / "ours", examples, num_steps=6, accum_steps=4, effective_batch_size=32
    )
    assert stock_seen["train_batch"] == 32 and stock_seen["iterations"] == 6
    assert seen == {
        "train_steps": 24, "train_batch": 8, "eval_batch": 16, "optimizer": "GradientAccumulator",
        "accum_steps": 4, "iterations": 6, "strategy": stock_seen["strategy"], "partial_window": "apply",
        "merge_duplicate_rows": False, "own_strategy": None, "own_strategy_replicas": None,
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
        ({"measure_noise_scale": 1}, r"`measure_noise_scale=True` \(from component parameter\) needs windows"
                                     r".*`accum_steps` is 1 \(from default\)"),
        ({"measure_noise_scale": 1, "accum_schedule": '{"0": 1, "2": 1}'}, "`accum_schedule` never goes above 1"),
        ({"measure_noise_scale": 2, "accum_steps": 2}, "`measure_noise_scale` must be True or False"),
        ({"measure_noise_scale": 1, "accum_steps": 2, "noise_scale_smoothing": 1.0}, "`noise_scale_smoothing`"),
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
    assert (seen["optimizer_module"], seen["accum_steps"], seen["train_batch"]) == ("tfx_gradient_accumulator.accumulator.keras2", 4, 8)
    # A quarter of the stock Trainer's updates at the micro-batch (24 micro-steps, 6 updates)...
    assert (seen["train_steps"], seen["iterations"]) == (24, 6)
    # ...with the stock Trainer's weights at the 4x batch.
    assert max_abs_diff(weights, stock_weights) <= 1e-5
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        assert artifact.get_int_custom_property("optimizer_updates") == 6
        assert artifact.get_int_custom_property("accum_steps") == 4
    assert os.path.exists(os.path.join(outputs["model"][0].uri, "Format-Serving", "saved_model.pb"))

# ------------------------------------------------------------ the noise scale

def _tensorboard_scalars(model_run_uri, tag):
    """{step: value} of scalar `tag` in the executor's TensorBoard logs."""
    values = {}
    for path in glob.glob(os.path.join(model_run_uri, "accumulation", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag and value.metadata.plugin_data.plugin_name == "scalars":
                    values[event.step] = float(tf.make_ndarray(value.tensor))
    return values


def _hand_built_noise_scale(examples, updates, accum_steps, micro_batch, smoothing):
    """The module's model trained by hand, outside TFX, with a GradientAccumulator built
    here: the same micro-batches in the same order (the module reads unshuffled)."""
    spec = importlib.util.spec_from_file_location("regression_module_reference", fixtures.MODULE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    feature_spec = {k: tf.io.FixedLenFeature([1], tf.float32) for k in module.FEATURES + [module.LABEL]}

    def parse(record):
        features = tf.io.parse_single_example(record, feature_spec)
        label = features.pop(module.LABEL)
        return features, label

    files = sorted(glob.glob(os.path.join(examples.uri, "Split-train", "*")))
    data = tf.data.TFRecordDataset(files, compression_type="GZIP").map(parse).batch(micro_batch).repeat()
    model = module._make_keras_model()
    optimizer = GradientAccumulator(model.optimizer, accum_steps, measure_noise_scale=True,
                                    noise_scale_smoothing=smoothing)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(data, steps_per_epoch=updates * accum_steps, verbose=0)
    return optimizer.noise_scale, int(optimizer.noise_scale_estimate.window_count)


def test_noise_scale_is_measured_and_recorded_as_the_optimizer_had_it(examples, tmp_path):
    """24 updates of 4 micro-batches of 8: the estimate the run's optimizer ended with is
    on both artifacts and in TensorBoard, and equals a hand-built accumulator's on the
    same micro-batches."""
    outputs, seen, _ = fixtures.run_executor(
        tmp_path, examples, num_steps=24, accum_steps=4, effective_batch_size=32,
        measure_noise_scale=1, noise_scale_smoothing=0.9,   # the int the pipeline stores
    )
    value = seen["noise_scale"]
    assert math.isfinite(value) and value > 0
    assert seen["logged_noise_scale"] == pytest.approx(value, rel=1e-12)   # fit's History agrees
    assert (seen["noise_scale_windows"], seen["noise_scale_smoothing"]) == (24, 0.9)
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        assert artifact.get_float_custom_property("noise_scale") == value
        assert artifact.get_int_custom_property("noise_scale_windows") == 24
        assert artifact.get_float_custom_property("noise_scale_smoothing") == 0.9
        assert artifact.get_string_custom_property("noise_scale_status") == "measured"
        assert artifact.get_int_custom_property("measure_noise_scale") == 1
    run_uri = outputs["model_run"][0].uri
    assert _tensorboard_scalars(run_uri, "accumulation/noise_scale") == {24: pytest.approx(value, rel=1e-6)}
    assert _tensorboard_scalars(run_uri, "accumulation/noise_scale_windows") == {24: 24.0}

    reference, windows = _hand_built_noise_scale(examples, 24, 4, 8, 0.9)
    print("executor", value, "hand-built", reference)
    assert windows == 24
    assert value == pytest.approx(reference, rel=1e-6)


def test_measure_noise_scale_and_smoothing_can_come_from_the_hyperparameters(examples, tmp_path):
    hp = fixtures.hyperparameters_artifact(
        str(tmp_path / "hp"), {"accum_steps": 2, "measure_noise_scale": True, "noise_scale_smoothing": 0.5})
    outputs, seen, _ = fixtures.run_executor(tmp_path / "run", examples, num_steps=3, hyperparameters=hp)
    assert (seen["noise_scale_windows"], seen["noise_scale_smoothing"]) == (3, 0.5)
    model = outputs["model"][0]
    assert model.get_int_custom_property("noise_scale_windows") == 3
    assert model.get_string_custom_property("noise_scale_status") == "measured"
    # No effective batch: the run_fn's batch of 32 is the micro-batch.
    reference, _ = _hand_built_noise_scale(examples, 3, 2, 32, 0.5)
    assert model.get_float_custom_property("noise_scale") == pytest.approx(reference, rel=1e-6)


def test_no_window_of_two_micro_batches_records_no_noise_scale(examples, tmp_path):
    """A schedule at accum_steps 1 until epoch 3, and one epoch of training: every window
    holds 1 micro-batch, so there is no estimate, and none is recorded."""
    outputs, seen, _ = fixtures.run_executor(
        tmp_path, examples, num_steps=4, accum_schedule='{"0": 1, "3": 4}', measure_noise_scale=1)
    assert math.isnan(seen["noise_scale"]) and seen["noise_scale_windows"] == 0
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        assert not artifact.has_custom_property("noise_scale")
        assert artifact.get_int_custom_property("noise_scale_windows") == 0
        assert artifact.get_string_custom_property("noise_scale_status").startswith("no estimate")
    assert _tensorboard_scalars(outputs["model_run"][0].uri, "accumulation/noise_scale") == {}


def test_not_measuring_is_the_default_and_records_no_noise_scale(examples, tmp_path):
    outputs, seen, _ = fixtures.run_executor(tmp_path, examples, num_steps=2, accum_steps=2)
    assert "noise_scale" not in seen
    model = outputs["model"][0]
    assert model.get_int_custom_property("measure_noise_scale") == 0
    assert not any(model.has_custom_property(k) for k in ("noise_scale", "noise_scale_status",
                                                          "noise_scale_windows"))


def test_merge_duplicate_rows_reaches_the_wrapper_and_the_artifacts(examples, tmp_path):
    outputs, seen, _ = fixtures.run_executor(tmp_path, examples, num_steps=2, accum_steps=2,
                                             merge_duplicate_rows=1)    # the int the pipeline stores
    assert seen["merge_duplicate_rows"] is True
    for artifact in outputs["model"] + outputs["model_run"]:
        assert artifact.get_int_custom_property("merge_duplicate_rows") == 1
    _, seen, _ = fixtures.run_executor(tmp_path / "default", examples, num_steps=2, accum_steps=2)
    assert seen["merge_duplicate_rows"] is False
