"""`AccumulatingTrainer(accum_steps="auto")`: the window grows with the measured noise
scale, the decisions are recorded, and the recorded schedule replays the run exactly.

The test module is a stock regression module (Keras 3, and its Keras 2 twin), unchanged.
Its effective batch starts at 2 (2 micro-batches of 1 sample): its noise scale, about 5
samples, is above twice that, so "auto" doubles the window once within 60 updates.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.components import TrainerOptions, settings as settings_lib
from tfx_gradient_accumulator.components.component import AccumulatingTrainer
from tests.components import fixtures

AUTO = dict(accum_steps_auto=1, effective_batch_size=2, max_effective_batch_size=16, lr_scaling="sqrt")
RAMP = 4
KERAS2_MODULE = os.path.join(fixtures.TESTDATA, "keras2_regression_module.py")


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def _decisions_in_tensorboard(model_run_dir):
    """{step: value} of `accumulation/effective_batch_size_taken` in the run's event files."""
    found = {}
    folder = os.path.join(model_run_dir, "accumulation")
    for name in os.listdir(folder):
        if name.startswith("events"):
            for event in tf.compat.v1.train.summary_iterator(os.path.join(folder, name)):
                for value in event.summary.value:
                    if value.tag == "accumulation/effective_batch_size_taken":
                        found[event.step] = float(tf.make_ndarray(value.tensor))
    return found


@pytest.mark.parametrize("module", [   # Keras 2's apart (130 s, a fresh process under Transform):
    fixtures.MODULE, pytest.param(KERAS2_MODULE, marks=pytest.mark.apart)],   # tests/keras2 grows auto windows
    ids=["keras3", "keras2"])
def test_auto_grows_records_its_decisions_and_the_record_replays_the_run(examples, tmp_path, module, easy_auto):
    outputs, seen, weights = fixtures.run_executor(tmp_path / "auto", examples, num_steps=60, module=module, **AUTO)
    model = outputs["model"][0]
    taken = {int(k): v for k, v in json.loads(model.get_string_custom_property("accum_schedule_taken")).items()}
    assert taken[0] == 2 and len(taken) >= 2 and sorted(taken.values()) == list(taken.values())
    final = max(taken.items())[1]
    assert model.get_int_custom_property("final_accum_steps") == final == seen["accum_steps"]
    assert model.get_int_custom_property("final_effective_batch_size") == final * 1
    assert model.get_int_custom_property("accum_steps_auto") == 1
    assert model.get_int_custom_property("max_effective_batch_size") == 16
    assert model.get_string_custom_property("lr_scaling") == "sqrt"
    assert model.get_int_custom_property("lr_ramp_updates") == 0          # easy_auto's default: no ramp
    # The samples stay (120 micro-steps), the updates are fewer than at a fixed window of 2.
    updates = model.get_int_custom_property("optimizer_updates")
    assert seen["train_steps"] == 120 and seen["iterations"] == updates < 60
    assert _decisions_in_tensorboard(outputs["model_run"][0].uri) == {k: float(v) for k, v in taken.items()}

    # A later run replays the record as a fixed schedule by update: the same weights.
    replay_outputs, replay_seen, replay_weights = fixtures.run_executor(
        tmp_path / "replay", examples, num_steps=60, module=module, effective_batch_size=2,
        accum_schedule=model.get_string_custom_property("accum_schedule_taken"),
        accum_schedule_by="update", lr_scaling="sqrt", lr_ramp_updates=model.get_int_custom_property("lr_ramp_updates"))
    assert replay_seen["iterations"] == updates and replay_seen["accum_steps"] == final
    replay_diff = _max_diff(weights, replay_weights)
    print(f"replay: max |dw| {replay_diff:.1e}")
    assert replay_diff <= 1e-7
    assert not replay_outputs["model"][0].has_custom_property("accum_schedule_taken")

    # Control: the starting window kept for the whole run trains otherwise. The module's
    # learning rate decays by 0.7 every 2 updates, so a change after 40 updates moves the
    # weights little (about 7e-6 here), but far more than the replay's difference.
    _, fixed_seen, fixed_weights = fixtures.run_executor(
        tmp_path / "fixed", examples, num_steps=60, module=module, accum_steps=2, effective_batch_size=2)
    control_diff = _max_diff(weights, fixed_weights)
    print(f"fixed window of 2: max |dw| {control_diff:.1e}")
    assert fixed_seen["iterations"] == 60 and control_diff > 1e-6 and control_diff > 100 * replay_diff


def test_a_ramped_auto_run_moves_the_learning_rate_gradually_and_its_record_replays_it(examples, tmp_path,
                                                                                       easy_auto):
    logging = {"log_lr_multipliers": True}
    outputs, seen, weights = fixtures.run_executor(tmp_path / "auto", examples, num_steps=60, module=fixtures.MODULE,
                                                   custom_config=logging, lr_ramp_updates=RAMP, **AUTO)
    model = outputs["model"][0]
    assert model.get_int_custom_property("lr_ramp_updates") == RAMP
    taken = {int(k): v for k, v in json.loads(model.get_string_custom_property("accum_schedule_taken")).items()}
    grown = min(k for k in taken if k > 0)
    # Between two batches the multiplier passes through values between sqrt(1) and sqrt(2):
    # 1/4, 2/4 and 3/4 of the way, one per update.
    multipliers = seen["lr_multipliers"]
    after = np.sqrt(taken[grown] / taken[0])
    between = sorted({round(m, 6) for m in multipliers if 1.0 < m < after - 1e-6})
    print(f"grew at update {grown}; multipliers on the way: {between}")
    assert between == [round(1.0 + (after - 1.0) * i / RAMP, 6) for i in range(1, RAMP)]

    # The replay of the record (the schedule and the ramp): the same multipliers, the same weights.
    replay_outputs, replay_seen, replay_weights = fixtures.run_executor(
        tmp_path / "replay", examples, num_steps=60, module=fixtures.MODULE, custom_config=logging,
        effective_batch_size=2, accum_schedule=model.get_string_custom_property("accum_schedule_taken"),
        accum_schedule_by="update", lr_scaling="sqrt", lr_ramp_updates=model.get_int_custom_property("lr_ramp_updates"))
    assert replay_seen["lr_multipliers"] == multipliers
    replay_diff = _max_diff(weights, replay_weights)
    print(f"ramped replay: max |dw| {replay_diff:.1e}")
    assert replay_diff <= 1e-7
    assert replay_outputs["model"][0].get_int_custom_property("lr_ramp_updates") == RAMP

    # Control: the same schedule without the ramp jumps, and trains otherwise.
    _, jump_seen, jump_weights = fixtures.run_executor(
        tmp_path / "jump", examples, num_steps=60, module=fixtures.MODULE, custom_config=logging,
        effective_batch_size=2, accum_schedule=model.get_string_custom_property("accum_schedule_taken"),
        accum_schedule_by="update", lr_scaling="sqrt")
    assert not [m for m in jump_seen["lr_multipliers"] if 1.0 < m < after - 1e-6]
    control_diff = _max_diff(weights, jump_weights)
    print(f"no ramp: max |dw| {control_diff:.1e}")
    assert control_diff > 1e-7 and control_diff > 100 * replay_diff


@pytest.mark.parametrize("arguments, error, message", [
    (dict(accum_steps="auto", effective_batch_size=None, options=TrainerOptions(max_effective_batch_size=8)),
     ValueError, "needs `effective_batch_size`"),
    (dict(accum_steps="auto", effective_batch_size=4), ValueError, "needs `max_effective_batch_size`"),
    (dict(accum_steps="auto", effective_batch_size=8, options=TrainerOptions(max_effective_batch_size=4)), ValueError,
     "`max_effective_batch_size` must be an integer >= 8"),
    (dict(accum_steps=2, effective_batch_size=8, options=TrainerOptions(max_effective_batch_size=16)), ValueError,
     "is the limit of `accum_steps='auto'`"),
    (dict(accum_steps="auto", effective_batch_size=8,
          options=TrainerOptions(max_effective_batch_size=16, gradient_cache=True)),
     ValueError, "not supported with `gradient_cache=True`"),
    (dict(accum_steps="some", effective_batch_size=8), ValueError, "must be an int >= 1, 'auto' or 'fit'"),
    (dict(accum_steps=2, options=TrainerOptions(lr_scaling="cubic")), ValueError, "`lr_scaling` must be one of"),
    (dict(accum_steps=2, options=TrainerOptions(accum_schedule_by="batch")), ValueError,
     "`accum_schedule_by` must be 'epoch' or 'update'"),
])
def test_bad_auto_settings_fail_when_the_pipeline_is_defined(arguments, error, message):
    examples = fixtures._examples_artifact("/nonexistent")
    from tfx.types import channel_utils
    from tfx.types import standard_artifacts
    channel = channel_utils.as_channel([examples])
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        AccumulatingTrainer(examples=channel, module_file=fixtures.MODULE, **arguments)


def test_auto_and_a_schedule_exclude_each_other():
    with pytest.raises(ValueError, match="makes its own schedule"):
        settings_lib.resolve(None, "auto", 8, 1,
                             options=TrainerOptions(accum_schedule={0: 2}, max_effective_batch_size=16))


def test_auto_ignores_a_tuned_accum_steps_and_measures_the_noise_scale():
    settings = settings_lib.resolve({"accum_steps": 8}, "auto", 8, 1,
                                    options=TrainerOptions(max_effective_batch_size=32))
    assert (settings.accum_steps, settings.micro_batch, settings.measure_noise_scale) == (2, 4, True)
    # AutoAccumulation's own learning-rate ramp; recorded, so the replay ramps alike.
    assert settings.compile_arguments()["auto"] == {"micro_batch_size": 4, "max_effective_batch_size": 32,
                                                   "lr_ramp_updates": settings_lib.default_lr_ramp_updates()}
    assert settings.sources["accum_steps"] == "auto"


def test_tuned_auto_hyperparameters_make_the_trainers_run_auto():
    # What KerasTuner's best trial hands the Trainer (the search itself: tests/accumulator/test_tuning.py).
    import keras
    import keras_tuner
    from tfx_gradient_accumulator.accumulator.tuning import AccumulatingHyperModel

    def build(hp):
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    best = keras_tuner.HyperParameters()
    AccumulatingHyperModel(build, accum_steps="auto", effective_batch_sizes=(4, 8), max_effective_batch_size=32).build(best)
    assert (best.get("accum_steps"), best.get("max_effective_batch_size")) == ("auto", 32)
    settings = settings_lib.resolve(best.get_config(), None, None, 1)
    assert settings.auto and settings.max_effective_batch_size == 32
    assert settings.micro_batch == best.get("effective_batch_size") // 2
