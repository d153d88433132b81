"""AccumulatingTrainer's declaration: a drop-in for tfx.components.Trainer."""

import pytest
from tfx import v1 as tfx
from tfx.types import channel_utils, standard_artifacts

from tfx_gradient_accumulator.components import AccumulatingTrainer
from tfx_gradient_accumulator.components.component import AccumulatingTrainerSpec


def _examples():
    return channel_utils.as_channel([standard_artifacts.Examples()])


def _kwargs(**extra):
    return dict(module_file="/m.py", examples=_examples(),
                train_args=tfx.proto.TrainArgs(num_steps=10), **extra)


def test_same_inputs_and_outputs_as_the_stock_trainer():
    stock = tfx.components.Trainer(**_kwargs())
    ours = AccumulatingTrainer(**_kwargs(accum_steps=4, effective_batch_size=64))
    assert isinstance(ours, tfx.components.Trainer)
    assert set(ours.outputs) == set(stock.outputs) == {"model", "model_run"}
    for key in stock.outputs:
        assert ours.outputs[key].type == stock.outputs[key].type
    assert set(AccumulatingTrainerSpec.INPUTS) == set(type(stock.spec).INPUTS)
    assert set(type(stock.spec).PARAMETERS) < set(AccumulatingTrainerSpec.PARAMETERS)
    assert ours.exec_properties["accum_steps"] == 4
    assert ours.exec_properties["effective_batch_size"] == 64
    assert ours.exec_properties["strategy"] == "auto"
    assert ours.exec_properties["train_args"] == stock.exec_properties["train_args"]


def test_hyperparameters_channel_is_accepted():
    hp = channel_utils.as_channel([standard_artifacts.HyperParameters()])
    trainer = AccumulatingTrainer(**_kwargs(hyperparameters=hp))
    assert "hyperparameters" in trainer.inputs


@pytest.mark.parametrize(
    "extra, error, message",
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": 2.0}, TypeError, "accum_steps"),
        ({"effective_batch_size": 0}, ValueError, "effective_batch_size"),
        ({"accum_steps": 3, "effective_batch_size": 64}, ValueError, "divide evenly"),
        ({"strategy": "gpu"}, ValueError, "strategy"),
        ({"partial_window": "keep"}, ValueError, "partial_window"),
        ({"measure_noise_scale": True}, ValueError, r"measure_noise_scale=True.*`accum_steps` is 1"),
        ({"measure_noise_scale": True, "accum_schedule": {0: 1}}, ValueError, "`accum_schedule` never goes above 1"),
        ({"measure_noise_scale": "yes", "accum_steps": 2}, ValueError, "`measure_noise_scale` must be True or False"),
        ({"merge_duplicate_rows": "yes"}, ValueError, "`merge_duplicate_rows` must be True or False"),
        ({"measure_noise_scale": True, "accum_steps": 2, "noise_scale_smoothing": 1.5}, ValueError,
         "noise_scale_smoothing"),
        ({"gradient_cache": "yes"}, ValueError, "`gradient_cache` must be True or False; received 'yes'"),
        ({"gradient_cache": True, "measure_noise_scale": True, "accum_steps": 2}, ValueError,
         "`measure_noise_scale=True`.* is not supported with `gradient_cache=True`"),
        ({"gradient_cache": True, "accum_schedule": {0: 2, 3: 4}}, ValueError,
         "`accum_schedule` is not supported with `gradient_cache=True`"),
        ({"gradient_cache": True, "partial_window": "drop"}, ValueError, "`partial_window='drop'` is not supported"),
        ({"gradient_cache": True, "merge_duplicate_rows": True}, ValueError, "`merge_duplicate_rows=True` is not"),
        ({"gradient_cache": True, "accum_steps": 3, "effective_batch_size": 64}, ValueError, "divide evenly"),
        ({"gather_across_replicas": True}, ValueError, "`gather_across_replicas=True` needs `gradient_cache=True`"),
        ({"gather_across_replicas": "yes", "gradient_cache": True}, ValueError,
         "`gather_across_replicas` must be True or False"),
        ({"backup_dir": ""}, ValueError, "`backup_dir` must be a non-empty path"),
        ({"backup_dir": 3}, ValueError, "`backup_dir` must be a non-empty path"),
        ({"backup_dir": "/b", "backup_every": 0}, ValueError, "`backup_every` must be a positive integer"),
        ({"accum_steps": 4, "lr_ramp_updates": 10}, ValueError, "`lr_ramp_updates` ramps the learning rate.*"
         "`accum_steps='auto'` or an `accum_schedule` by update"),
        ({"accum_schedule": {0: 2, 3: 4}, "lr_ramp_updates": 10}, ValueError,
         "`lr_ramp_updates` counts updates.*received by='epoch'. Set `accum_schedule_by='update'`"),
        ({"accum_steps": "auto", "effective_batch_size": 8, "max_effective_batch_size": 32, "lr_ramp_updates": -1},
         ValueError, "`lr_ramp_updates` must be an int >= 0; received -1"),
    ],
)
def test_bad_parameters_fail_when_the_pipeline_is_defined(extra, error, message):
    with pytest.raises(error, match=message):
        AccumulatingTrainer(**_kwargs(**extra))


def test_stock_argument_rules_hold():
    with pytest.raises(ValueError, match="module_file"):
        AccumulatingTrainer(examples=_examples())
    with pytest.raises(ValueError, match="example"):
        AccumulatingTrainer(module_file="/m.py")


def test_accum_schedule_is_validated_and_stored_as_json():
    trainer = AccumulatingTrainer(**_kwargs(accum_schedule={0: 2, 3: 8}))
    assert trainer.exec_properties["accum_schedule"] == '{"0": 2, "3": 8}'
    with pytest.raises(ValueError, match="schedule"):
        AccumulatingTrainer(**_kwargs(accum_schedule={0: 0}))


def test_measure_noise_scale_is_stored_as_an_int_and_checked_against_tuned_values_at_run_time():
    trainer = AccumulatingTrainer(**_kwargs(accum_steps=2, measure_noise_scale=True, noise_scale_smoothing=0.9))
    assert (trainer.exec_properties["measure_noise_scale"], trainer.exec_properties["noise_scale_smoothing"]) == (1, 0.9)
    assert AccumulatingTrainer(**_kwargs()).exec_properties["measure_noise_scale"] == 0
    # With tuned values to come, accum_steps is not known yet: the executor checks it.
    hp = channel_utils.as_channel([standard_artifacts.HyperParameters()])
    assert AccumulatingTrainer(**_kwargs(hyperparameters=hp, measure_noise_scale=True)) \
        .exec_properties["measure_noise_scale"] == 1
    # A schedule that reaches 2 is enough.
    AccumulatingTrainer(**_kwargs(accum_schedule={0: 1, 2: 4}, measure_noise_scale=True))


def test_merge_duplicate_rows_is_stored_as_an_int():
    assert AccumulatingTrainer(**_kwargs(merge_duplicate_rows=True)).exec_properties["merge_duplicate_rows"] == 1
    assert AccumulatingTrainer(**_kwargs()).exec_properties["merge_duplicate_rows"] == 0


def test_gradient_cache_is_stored_as_an_int_and_unset_means_false():
    trainer = AccumulatingTrainer(**_kwargs(gradient_cache=True, accum_steps=4, effective_batch_size=64))
    assert trainer.exec_properties["gradient_cache"] == 1
    assert AccumulatingTrainer(**_kwargs()).exec_properties["gradient_cache"] == 0


def test_gather_across_replicas_is_stored_as_an_int_and_unset_means_false():
    trainer = AccumulatingTrainer(**_kwargs(gradient_cache=True, gather_across_replicas=True, accum_steps=4,
                                            effective_batch_size=64))
    assert trainer.exec_properties["gather_across_replicas"] == 1
    assert AccumulatingTrainer(**_kwargs(gradient_cache=True)).exec_properties["gather_across_replicas"] == 0


def test_lr_ramp_updates_is_stored_unset_means_the_runs_default_and_tuned_values_are_awaited():
    auto = dict(accum_steps="auto", effective_batch_size=8, max_effective_batch_size=32, lr_scaling="sqrt")
    assert AccumulatingTrainer(**_kwargs(**auto, lr_ramp_updates=20)).exec_properties["lr_ramp_updates"] == 20
    # Unset: the executor takes the library's default for "auto" (0 for a schedule) when it runs.
    assert AccumulatingTrainer(**_kwargs(**auto)).exec_properties["lr_ramp_updates"] is None
    scheduled = AccumulatingTrainer(**_kwargs(accum_schedule={0: 2, 40: 4}, accum_schedule_by="update",
                                              lr_scaling="sqrt", lr_ramp_updates=10))
    assert scheduled.exec_properties["lr_ramp_updates"] == 10
    # Tuned values may make the run "auto" (AccumulatingHyperModel(accum_steps="auto")): the executor checks.
    hp = channel_utils.as_channel([standard_artifacts.HyperParameters()])
    assert AccumulatingTrainer(**_kwargs(hyperparameters=hp, lr_ramp_updates=10)).exec_properties[
        "lr_ramp_updates"] == 10
