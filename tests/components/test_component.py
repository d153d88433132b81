"""AccumulatingTrainer's declaration: a drop-in for tfx.components.Trainer."""

import dataclasses
import inspect

import pytest
from tfx import v1 as tfx
from tfx.orchestration import data_types
from tfx.types import channel_utils, standard_artifacts

from tfx_gradient_accumulator.components import AccumulatingTrainer, TrainerOptions
from tfx_gradient_accumulator.components import settings as settings_lib, trainer_options
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
        ({"options": TrainerOptions(partial_window="keep")}, ValueError, "partial_window"),
        ({"options": TrainerOptions(measure_noise_scale=True)}, ValueError,
         r"measure_noise_scale=True.*`accum_steps` is 1"),
        ({"options": TrainerOptions(measure_noise_scale=True, accum_schedule={0: 1})}, ValueError,
         "`accum_schedule` never goes above 1"),
        ({"accum_steps": 2, "options": TrainerOptions(measure_noise_scale="yes")}, ValueError,
         "`measure_noise_scale` must be True or False"),
        ({"options": TrainerOptions(merge_duplicate_rows="yes")}, ValueError,
         "`merge_duplicate_rows` must be True or False"),
        ({"accum_steps": 2, "options": TrainerOptions(measure_noise_scale=True, noise_scale_smoothing=1.5)}, ValueError,
         "noise_scale_smoothing"),
        ({"options": TrainerOptions(gradient_cache="yes")}, ValueError,
         "`gradient_cache` must be True or False; received 'yes'"),
        ({"accum_steps": 2, "options": TrainerOptions(gradient_cache=True, measure_noise_scale=True)}, ValueError,
         "`measure_noise_scale=True`.* is not supported with `gradient_cache=True`"),
        ({"options": TrainerOptions(gradient_cache=True, accum_schedule={0: 2, 3: 4})}, ValueError,
         "`accum_schedule` is not supported with `gradient_cache=True`"),
        ({"options": TrainerOptions(gradient_cache=True, partial_window="drop")}, ValueError,
         "`partial_window='drop'` is not supported"),
        ({"options": TrainerOptions(gradient_cache=True, merge_duplicate_rows=True)}, ValueError,
         "`merge_duplicate_rows=True` is not"),
        ({"accum_steps": 3, "effective_batch_size": 64, "options": TrainerOptions(gradient_cache=True)}, ValueError,
         "divide evenly"),
        ({"options": TrainerOptions(gather_across_replicas=True)}, ValueError,
         "`gather_across_replicas=True` needs `gradient_cache=True`"),
        ({"options": TrainerOptions(gather_across_replicas="yes", gradient_cache=True)}, ValueError,
         "`gather_across_replicas` must be True or False"),
        ({"options": TrainerOptions(backup_dir="")}, ValueError, "`backup_dir` must be a non-empty path"),
        ({"options": TrainerOptions(backup_dir=3)}, ValueError, "`backup_dir` must be a non-empty path"),
        ({"options": TrainerOptions(backup_dir="/b", backup_every=0)}, ValueError,
         "`backup_every` must be a positive integer"),
        ({"accum_steps": 4, "options": TrainerOptions(lr_ramp_updates=10)}, ValueError,
         "`lr_ramp_updates` ramps the learning rate.*"
         "`accum_steps='auto'` or an `accum_schedule` by update"),
        ({"options": TrainerOptions(accum_schedule={0: 2, 3: 4}, lr_ramp_updates=10)}, ValueError,
         "`lr_ramp_updates` counts updates.*received by='epoch'. Set `accum_schedule_by='update'`"),
        ({"accum_steps": "auto", "effective_batch_size": 8,
          "options": TrainerOptions(max_effective_batch_size=32, lr_ramp_updates=-1)},
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
    trainer = AccumulatingTrainer(**_kwargs(options=TrainerOptions(accum_schedule={0: 2, 3: 8})))
    assert trainer.exec_properties["accum_schedule"] == '{"0": 2, "3": 8}'
    with pytest.raises(ValueError, match="schedule"):
        AccumulatingTrainer(**_kwargs(options=TrainerOptions(accum_schedule={0: 0})))


def test_measure_noise_scale_is_stored_as_an_int_and_checked_against_tuned_values_at_run_time():
    trainer = AccumulatingTrainer(**_kwargs(accum_steps=2, options=TrainerOptions(measure_noise_scale=True,
                                                                                 noise_scale_smoothing=0.9)))
    assert (trainer.exec_properties["measure_noise_scale"], trainer.exec_properties["noise_scale_smoothing"]) == (1, 0.9)
    assert AccumulatingTrainer(**_kwargs()).exec_properties["measure_noise_scale"] == 0
    # With tuned values to come, accum_steps is not known yet: the executor checks it.
    hp = channel_utils.as_channel([standard_artifacts.HyperParameters()])
    assert AccumulatingTrainer(**_kwargs(hyperparameters=hp, options=TrainerOptions(measure_noise_scale=True))) \
        .exec_properties["measure_noise_scale"] == 1
    # A schedule that reaches 2 is enough.
    AccumulatingTrainer(**_kwargs(options=TrainerOptions(accum_schedule={0: 1, 2: 4}, measure_noise_scale=True)))


def test_merge_duplicate_rows_is_stored_as_an_int():
    merged = AccumulatingTrainer(**_kwargs(options=TrainerOptions(merge_duplicate_rows=True)))
    assert merged.exec_properties["merge_duplicate_rows"] == 1
    assert AccumulatingTrainer(**_kwargs()).exec_properties["merge_duplicate_rows"] == 0


def test_gradient_cache_is_stored_as_an_int_and_unset_means_false():
    trainer = AccumulatingTrainer(**_kwargs(accum_steps=4, effective_batch_size=64,
                                            options=TrainerOptions(gradient_cache=True)))
    assert trainer.exec_properties["gradient_cache"] == 1
    assert AccumulatingTrainer(**_kwargs()).exec_properties["gradient_cache"] == 0


def test_gather_across_replicas_is_stored_as_an_int_and_unset_means_false():
    trainer = AccumulatingTrainer(**_kwargs(accum_steps=4, effective_batch_size=64, options=TrainerOptions(
        gradient_cache=True, gather_across_replicas=True)))
    assert trainer.exec_properties["gather_across_replicas"] == 1
    cached = AccumulatingTrainer(**_kwargs(options=TrainerOptions(gradient_cache=True)))
    assert cached.exec_properties["gather_across_replicas"] == 0


def test_lr_ramp_updates_is_stored_unset_means_the_runs_default_and_tuned_values_are_awaited():
    auto = dict(accum_steps="auto", effective_batch_size=8)
    limit = TrainerOptions(max_effective_batch_size=32, lr_scaling="sqrt")
    ramped = AccumulatingTrainer(**_kwargs(**auto, options=dataclasses.replace(limit, lr_ramp_updates=20)))
    assert ramped.exec_properties["lr_ramp_updates"] == 20
    # Unset: the executor takes the library's default for "auto" (0 for a schedule) when it runs.
    assert AccumulatingTrainer(**_kwargs(**auto, options=limit)).exec_properties["lr_ramp_updates"] is None
    scheduled = AccumulatingTrainer(**_kwargs(options=TrainerOptions(
        accum_schedule={0: 2, 40: 4}, accum_schedule_by="update", lr_scaling="sqrt", lr_ramp_updates=10)))
    assert scheduled.exec_properties["lr_ramp_updates"] == 10
    # Tuned values may make the run "auto" (AccumulatingHyperModel(accum_steps="auto")): the executor checks.
    hp = channel_utils.as_channel([standard_artifacts.HyperParameters()])
    tuned = AccumulatingTrainer(**_kwargs(hyperparameters=hp, options=TrainerOptions(lr_ramp_updates=10)))
    assert tuned.exec_properties["lr_ramp_updates"] == 10


# The same Trainers, given the old way (every option a keyword) and the new (`options`).
_THE_OLD_WAY = [
    dict(accum_steps=4, effective_batch_size=64, partial_window="drop", merge_duplicate_rows=True),
    dict(accum_steps="auto", effective_batch_size=8, max_effective_batch_size=32, lr_scaling="sqrt",
         lr_ramp_updates=20),
    dict(accum_schedule={0: 2, 40: 4}, accum_schedule_by="update", lr_ramp_updates=10, measure_noise_scale=True,
         noise_scale_smoothing=0.9),
    dict(accum_steps=4, effective_batch_size=64, strategy="mirrored", gradient_cache=True,
         gather_across_replicas=True),
    dict(micro_batch_size="auto", effective_batch_size=64, verify_exactness="refuse"),
    dict(accum_steps=2, backup_dir="/b", backup_every=7, verify_exactness=True),
    dict(accum_steps=data_types.RuntimeParameter(name="accum", ptype=int, default=2),
         measure_noise_scale=data_types.RuntimeParameter(name="measure", ptype=int, default=1),
         backup_dir=data_types.RuntimeParameter(name="backup", ptype=str, default="/b")),
]
_COMMON = {"accum_steps", "effective_batch_size", "micro_batch_size", "strategy"}


def _the_new_way(old):
    return {**{k: v for k, v in old.items() if k in _COMMON},
            "options": TrainerOptions(**{k: v for k, v in old.items() if k not in _COMMON})}


@pytest.mark.parametrize("old", _THE_OLD_WAY)
def test_options_given_the_old_way_still_work_say_where_they_went_and_store_the_same_properties(old):
    moved = sorted(set(old) - _COMMON)
    with pytest.warns(FutureWarning) as warned:
        before = AccumulatingTrainer(**_kwargs(**old))
    assert sorted(str(w.message).split("(")[1].split("=")[0] for w in warned) == moved
    assert all("moved into the Trainer's `options`: pass options=TrainerOptions(" in str(w.message) for w in warned)
    now = AccumulatingTrainer(**_kwargs(**_the_new_way(old)))
    # The same execution properties, in the same order: the same IR, cache keys, RuntimeParameters.
    assert list(now.exec_properties) == list(before.exec_properties)
    assert {k: repr(v) for k, v in now.exec_properties.items()} == \
        {k: repr(v) for k, v in before.exec_properties.items()}


@pytest.mark.parametrize("old", _THE_OLD_WAY[:6])
def test_the_executor_reads_back_what_the_component_stored(old):
    new = _the_new_way(old)
    stored = AccumulatingTrainer(**_kwargs(**new)).exec_properties
    read = trainer_options.from_exec_properties(stored)
    options = new["options"]
    assert read[:3] == (new.get("accum_steps"), new.get("effective_batch_size"), new.get("micro_batch_size"))
    for field in ("partial_window", "accum_schedule_by", "max_effective_batch_size", "lr_scaling",
                  "lr_ramp_updates", "noise_scale_smoothing", "backup_dir", "backup_every"):
        assert getattr(read[3], field) == getattr(options, field), field
    for flag in ("measure_noise_scale", "merge_duplicate_rows", "gradient_cache", "gather_across_replicas"):
        assert getattr(read[3], flag) is bool(getattr(options, flag)), flag
    assert read[3].accum_schedule == (None if options.accum_schedule is None else
                                      {str(k): v for k, v in options.accum_schedule.items()})
    hp = {"values": {"learning_rate": 0.1}}
    accum_steps, effective_batch_size, micro_batch_size, read_options = read
    assert settings_lib.resolve(hp, accum_steps, effective_batch_size, 2, read_options, micro_batch_size) == \
        settings_lib.resolve(hp, new.get("accum_steps"), new.get("effective_batch_size"), 2, options,
                             new.get("micro_batch_size"))


def test_an_unknown_keyword_a_twice_given_option_and_options_of_another_type_are_refused():
    with pytest.raises(TypeError, match=r"AccumulatingTrainer\(\) got an unexpected keyword argument 'acum_steps'"):
        AccumulatingTrainer(**_kwargs(acum_steps=4))
    with pytest.raises(ValueError, match=r"`gradient_cache` was given twice.*options=TrainerOptions\(gradient_cache"):
        AccumulatingTrainer(**_kwargs(gradient_cache=True, options=TrainerOptions(gradient_cache=True)))
    with pytest.raises(TypeError, match=r"options=\.\.\.\) takes a TrainerOptions.*received dict"):
        AccumulatingTrainer(**_kwargs(options={"gradient_cache": True}))


def test_the_signature_is_the_stock_trainers_plus_the_common_accumulation_parameters_and_options():
    stock = set(inspect.signature(tfx.components.Trainer.__init__).parameters) - {"self", "trainer_fn",
                                                                                  "custom_executor_spec"}
    ours = inspect.signature(AccumulatingTrainer.__init__).parameters
    named = [name for name, p in ours.items() if p.kind is not inspect.Parameter.VAR_KEYWORD and name != "self"]
    assert stock < set(named)
    assert set(named) - stock == {"accum_steps", "effective_batch_size", "micro_batch_size", "strategy", "options"}
    # Every option has a default that trains as without it, and none is also a parameter.
    assert not set(named) & {f.name for f in dataclasses.fields(TrainerOptions)}
    default = AccumulatingTrainer(**_kwargs(options=TrainerOptions())).exec_properties
    assert default == AccumulatingTrainer(**_kwargs()).exec_properties
