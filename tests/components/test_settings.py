"""Resolving accumulation settings: hyperparameters, then parameters, then defaults."""

import pytest

from tfx_gradient_accumulator.components import TrainerOptions
from tfx_gradient_accumulator.components.settings import resolve


def test_defaults():
    s = resolve(None, None, None, replicas=1)
    assert (s.accum_steps, s.effective_batch_size, s.micro_batch, s.partial_window) == (1, None, None, "apply")
    assert (s.measure_noise_scale, s.noise_scale_smoothing) == (False, 0.99)
    assert s.sources == {"accum_steps": "default", "effective_batch_size": "default",
                         "measure_noise_scale": "default", "noise_scale_smoothing": "default"}


def test_precedence():
    hp = {"space": [], "values": {"accum_steps": 8, "learning_rate": 0.1}}
    s = resolve(hp, 2, 64, replicas=2)
    assert (s.accum_steps, s.effective_batch_size, s.micro_batch, s.micro_batch_per_replica) == (8, 64, 8, 4)
    assert s.sources == {"accum_steps": "hyperparameters", "effective_batch_size": "component parameter",
                         "measure_noise_scale": "default", "noise_scale_smoothing": "default"}
    assert s.as_properties() == {"accum_steps": 8, "micro_batch_size": 8, "replicas": 2, "effective_batch_size": 64,
                                 "measure_noise_scale": 0, "merge_duplicate_rows": 0, "gradient_cache": 0,
                                 "accum_steps_auto": 0, "max_effective_batch_size": 0,
                                 "gather_across_replicas": 0, "lr_ramp_updates": 0, "accum_steps_fit": 0}


@pytest.mark.parametrize(
    "hp, accum, effective, replicas, message",
    [
        (None, 0, None, 1, "accum_steps"),
        ({"values": {"accum_steps": "4"}}, None, None, 1, "accum_steps"),
        (None, 4, 0, 1, "effective_batch_size"),
        (None, 4, 32, 3, r"4\) x replicas \(3\) = 12"),
        ({"values": {"effective_batch_size": 30}}, 4, 64, 1, "from hyperparameters"),
    ],
)
def test_errors_name_the_value_and_its_source(hp, accum, effective, replicas, message):
    with pytest.raises((ValueError, TypeError), match=message):
        resolve(hp, accum, effective, replicas)


def test_partial_window_is_one_of_the_modes():
    assert resolve(None, 2, None, replicas=1, options=TrainerOptions(partial_window="drop")).partial_window == "drop"
    with pytest.raises(ValueError, match=r"`partial_window` must be one of \('apply', 'carry', 'drop'\)"):
        resolve(None, 2, None, replicas=1, options=TrainerOptions(partial_window="flush"))


def test_measure_noise_scale_follows_the_same_precedence():
    hp = {"values": {"measure_noise_scale": True, "noise_scale_smoothing": 0.9}}
    s = resolve(hp, 4, None, replicas=1, options=TrainerOptions(measure_noise_scale=False, noise_scale_smoothing=0.5))
    assert (s.measure_noise_scale, s.noise_scale_smoothing) == (True, 0.9)
    assert s.sources["measure_noise_scale"] == s.sources["noise_scale_smoothing"] == "hyperparameters"
    assert s.as_properties()["measure_noise_scale"] == 1
    s = resolve(None, 2, None, replicas=1,
                options=TrainerOptions(measure_noise_scale=True, noise_scale_smoothing=0.5))
    assert (s.measure_noise_scale, s.noise_scale_smoothing) == (True, 0.5)
    assert s.sources["measure_noise_scale"] == "component parameter"


def test_measuring_needs_windows_of_two():
    # A schedule that reaches 2 later is enough (the first windows give no estimate).
    assert resolve(None, None, None, replicas=1,
                   options=TrainerOptions(accum_schedule={0: 1, 3: 2}, measure_noise_scale=True)).measure_noise_scale
    with pytest.raises(ValueError, match=r"`measure_noise_scale=True` \(from component parameter\).*"
                                         r"`accum_steps` is 1 \(from hyperparameters\)"):
        resolve({"values": {"accum_steps": 1}}, 4, None, replicas=1, options=TrainerOptions(measure_noise_scale=True))
    with pytest.raises(ValueError, match=r"\(from hyperparameters\).*`accum_steps` is 1 \(from default\)"):
        resolve({"values": {"measure_noise_scale": True}}, None, None, replicas=1)
    with pytest.raises(ValueError, match="`accum_schedule` never goes above 1"):
        resolve(None, None, None, replicas=1,
                options=TrainerOptions(accum_schedule={0: 1, 5: 1}, measure_noise_scale=True))
    # Not measuring: accum_steps 1 is fine.
    assert resolve(None, 1, None, replicas=1, options=TrainerOptions(measure_noise_scale=False)).accum_steps == 1


@pytest.mark.parametrize(
    "measure, smoothing, message",
    [
        ("yes", None, "`measure_noise_scale` must be True or False; received 'yes'"),
        (1, None, "`measure_noise_scale` must be True or False; received 1"),
        (True, 1.0, r"`noise_scale_smoothing` must be a float in \[0, 1\)"),
        (True, -0.1, "`noise_scale_smoothing`"),
    ],
)
def test_bad_noise_scale_settings_name_the_parameter(measure, smoothing, message):
    with pytest.raises(ValueError, match=message):
        resolve(None, 4, None, replicas=1,
                options=TrainerOptions(measure_noise_scale=measure, noise_scale_smoothing=smoothing))


def test_gradient_cache_batches_at_the_effective_batch_and_counts_one_step_per_update():
    plain = resolve(None, 4, 64, replicas=2)
    assert (plain.train_batch, plain.steps_per_update, plain.gradient_cache) == (16, 4, False)
    cached = resolve({"values": {"accum_steps": 8}}, 4, 64, replicas=2,
                     options=TrainerOptions(gradient_cache=1))   # the stored int
    assert (cached.train_batch, cached.steps_per_update, cached.gradient_cache) == (64, 1, True)
    assert (cached.accum_steps, cached.micro_batch, cached.micro_batch_per_replica) == (8, 8, 4)
    assert cached.as_properties()["gradient_cache"] == 1
    assert cached.compile_arguments()["gradient_cache"] is True
    # Without an effective batch the run_fn's batch is the effective batch.
    assert resolve(None, 4, None, replicas=1, options=TrainerOptions(gradient_cache=True)).train_batch is None
    assert resolve(None, 4, 64, replicas=1, options=TrainerOptions(gradient_cache=None)).gradient_cache is False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gradient_cache="yes"), "`gradient_cache` must be True or False; received 'yes'"),
        (dict(gradient_cache=2), "`gradient_cache` must be True or False; received 2"),
        (dict(gradient_cache=True, measure_noise_scale=True),
         r"`measure_noise_scale=True` \(from component parameter\) is not supported with `gradient_cache=True`"),
        (dict(gradient_cache=True, accum_schedule={0: 2, 3: 4}), "`accum_schedule` is not supported with `gradient_cache"),
        (dict(gradient_cache=True, partial_window="carry"),
         "`partial_window='carry'` is not supported with `gradient_cache=True`"),
        (dict(gradient_cache=True, merge_duplicate_rows=True),
         "`merge_duplicate_rows=True` is not supported with `gradient_cache=True`"),
    ],
)
def test_gradient_cache_refuses_what_it_cannot_honour(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve(None, 4, 64, replicas=1, options=TrainerOptions(**kwargs))


def test_gather_across_replicas_comes_with_gradient_cache_and_is_recorded():
    gathered = resolve(None, 4, 64, replicas=2,
                       options=TrainerOptions(gradient_cache=1, gather_across_replicas=1))   # the stored ints
    assert gathered.gather_across_replicas is True
    assert gathered.as_properties()["gather_across_replicas"] == 1
    assert gathered.compile_arguments()["gather_across_replicas"] is True
    assert gathered.train_batch == 64          # still the effective batch: each replica reads its share
    for unset in (None, 0, False):
        options = TrainerOptions(gradient_cache=True, gather_across_replicas=unset)
        assert resolve(None, 4, 64, replicas=2, options=options).compile_arguments()["gather_across_replicas"] is False


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(gather_across_replicas=True), "`gather_across_replicas=True` needs `gradient_cache=True`"),
        (dict(gather_across_replicas=1, gradient_cache=0), "`gather_across_replicas=True` needs `gradient_cache"),
        (dict(gather_across_replicas="yes", gradient_cache=True),
         "`gather_across_replicas` must be True or False; received 'yes'"),
        (dict(gather_across_replicas=2, gradient_cache=True), "`gather_across_replicas` must be True or False"),
    ],
)
def test_bad_gather_across_replicas_is_refused_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        resolve(None, 4, 64, replicas=2, options=TrainerOptions(**kwargs))


def test_a_tuned_measure_noise_scale_is_refused_with_gradient_cache_naming_its_source():
    with pytest.raises(ValueError, match=r"`measure_noise_scale=True` \(from hyperparameters\) is not supported"):
        resolve({"values": {"measure_noise_scale": True}}, 4, 64, replicas=1,
                options=TrainerOptions(gradient_cache=True))


def test_lr_ramp_updates_defaults_to_the_librarys_with_auto_and_to_none_with_a_schedule():
    import inspect

    from tfx_gradient_accumulator.accumulator import AutoAccumulation
    library = inspect.signature(AutoAccumulation.__init__).parameters["lr_ramp_updates"].default
    auto = resolve(None, "auto", 8, replicas=1,
                   options=TrainerOptions(max_effective_batch_size=32, lr_scaling="sqrt"))
    assert library > 0 and auto.lr_ramp_updates == library == auto.as_properties()["lr_ramp_updates"]
    assert auto.compile_arguments()["auto"]["lr_ramp_updates"] == library
    assert auto.compile_arguments()["lr_ramp_updates"] == 0          # the ramp goes in `auto`
    scheduled = resolve(None, None, 8, replicas=1,
                        options=TrainerOptions(accum_schedule={0: 2, 10: 4}, accum_schedule_by="update"))
    assert scheduled.lr_ramp_updates == scheduled.compile_arguments()["lr_ramp_updates"] == 0
    assert resolve(None, 2, 8, replicas=1).as_properties()["lr_ramp_updates"] == 0


def test_lr_ramp_updates_set_goes_to_the_schedule_or_to_auto():
    scheduled = resolve(None, None, 8, replicas=1,
                        options=TrainerOptions(accum_schedule={0: 2, 10: 4}, accum_schedule_by="update",
                                               lr_scaling="sqrt", lr_ramp_updates=5))
    assert scheduled.compile_arguments()["lr_ramp_updates"] == scheduled.as_properties()["lr_ramp_updates"] == 5
    auto = resolve(None, "auto", 8, replicas=1,
                   options=TrainerOptions(max_effective_batch_size=32, lr_ramp_updates=0))
    assert auto.compile_arguments()["auto"]["lr_ramp_updates"] == auto.lr_ramp_updates == 0
    # 0 says "no ramp", which a fixed window has anyway.
    assert resolve(None, 2, 8, replicas=1, options=TrainerOptions(lr_ramp_updates=0)).lr_ramp_updates == 0


@pytest.mark.parametrize("arguments, message", [
    (dict(accum_steps=2, lr_ramp_updates=5), r"`lr_ramp_updates` ramps the learning rate after a change of the "
     r"batch: it goes with `accum_steps='auto'` or an `accum_schedule` by update; `accum_steps` is 2"),
    (dict(accum_steps=None, accum_schedule={0: 2, 3: 4}, lr_ramp_updates=5),
     r"`lr_ramp_updates` counts updates: it goes with by='update'; received by='epoch'. Set "
     r"`accum_schedule_by='update'`"),
    (dict(accum_steps="auto", max_effective_batch_size=32, lr_ramp_updates=-1),
     r"`lr_ramp_updates` must be an int >= 0; received -1"),
    (dict(accum_steps=None, accum_schedule={0: 2, 3: 4}, accum_schedule_by="update", lr_ramp_updates=2.5),
     r"`lr_ramp_updates` must be an int >= 0; received 2.5"),
    (dict(accum_steps=2, lr_ramp_updates=True), r"`lr_ramp_updates` must be an int >= 0; received True"),
])
def test_lr_ramp_updates_is_refused_where_nothing_changes_or_not_by_update(arguments, message):
    accum_steps = arguments.pop("accum_steps")
    with pytest.raises(ValueError, match=message):
        resolve(None, accum_steps, 8, replicas=1, options=TrainerOptions(**arguments))
