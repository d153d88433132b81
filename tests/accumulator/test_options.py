"""`WindowOptions` and `CacheOptions`: every option checked once, frozen, round-tripped."""

import dataclasses

import keras
import pytest

from tfx_gradient_accumulator.accumulator import GradientAccumulator, WindowOptions
from tfx_gradient_accumulator.accumulator.core.options import CacheOptions, validate_lr_ramp_updates

# option: (an accepted value, a refused one, the error, what its message must say)
CASES = {
    "accum_steps": (3, 0, ValueError, r"`accum_steps` must be a positive integer \(1, 2, 3, \.\.\.\); received 0"),
    "partial_window": ("carry", "flush", ValueError,
                       r"`partial_window` must be one of \('apply', 'carry', 'drop'\); received 'flush'"),
    "measure_noise_scale": (True, 1, ValueError, r"`measure_noise_scale` must be True or False; received 1"),
    "noise_scale_smoothing": (0.5, 1.0, ValueError, r"`noise_scale_smoothing` must be a float in \[0, 1\)"),
    "merge_duplicate_rows": (True, "yes", ValueError,
                             r"`merge_duplicate_rows` must be True or False; received 'yes'"),
    "loss_reduction": ("sum", "total", ValueError,
                       r"`loss_reduction` must be one of \('auto', 'mean', 'sum'\); received 'total'"),
}
# Options that go with accum_steps="auto" alone.
AUTO_CASES = {
    "max_effective_batch_size": (64, 1, ValueError,
                                 r"`max_effective_batch_size` must be an integer >= 2; received 1"),
    "lr_scaling": ("sqrt", "cubic", ValueError,
                   r"`lr_scaling` must be one of \('none', 'linear', 'sqrt'\); received 'cubic'"),
}


def _base(name):
    # measure_noise_scale needs windows; the rest go with the defaults.
    return {"accum_steps": 2} if name == "measure_noise_scale" else {}


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_option_takes_its_values_and_refuses_others_naming_them(name):
    accepted, refused, error, message = CASES[name]
    assert getattr(WindowOptions(**_base(name), **{name: accepted}), name) == accepted
    with pytest.raises(error, match=message):
        WindowOptions(**_base(name), **{name: refused})


@pytest.mark.parametrize("name", sorted(AUTO_CASES))
def test_auto_options_take_their_values_and_refuse_others_naming_them(name):
    accepted, refused, error, message = AUTO_CASES[name]
    given = {"accum_steps": "auto", "max_effective_batch_size": 64, name: accepted}
    assert getattr(WindowOptions(**given), name) == accepted
    with pytest.raises(error, match=message):
        WindowOptions(**{**given, name: refused})


@pytest.mark.parametrize("name, value", [("max_effective_batch_size", 64), ("lr_scaling", "linear")])
def test_auto_options_are_refused_without_auto(name, value):
    with pytest.raises(ValueError, match="`max_effective_batch_size` and `lr_scaling` go with accum_steps='auto'"):
        WindowOptions(accum_steps=4, **{name: value})


def test_schedulable_is_a_bool_and_accum_steps_takes_only_auto_as_a_string():
    assert WindowOptions(schedulable=True).schedulable is True
    assert WindowOptions(schedulable=0).schedulable is False
    with pytest.raises(TypeError, match="`accum_steps` must be an integer >= 1 or 'auto'; received 'four'"):
        WindowOptions(accum_steps="four")


def test_consistency_checks():
    with pytest.raises(ValueError, match="needs windows of several micro-batches"):
        WindowOptions(accum_steps=1, measure_noise_scale=True)
    assert WindowOptions(accum_steps=1, schedulable=True, measure_noise_scale=True).measure_noise_scale
    with pytest.raises(ValueError, match="needs a loss that is a mean"):
        WindowOptions(accum_steps=2, measure_noise_scale=True, loss_reduction="sum")
    with pytest.raises(ValueError, match="accum_steps='auto' needs `max_effective_batch_size`"):
        WindowOptions(accum_steps="auto")


def test_auto_resolves_to_a_schedulable_measuring_window_of_two():
    options = WindowOptions(accum_steps="auto", max_effective_batch_size=64, lr_scaling="linear")
    assert (options.accum_steps, options.schedulable, options.measure_noise_scale, options.auto) == (2, True, True, True)
    assert options.auto_settings == {"max_effective_batch_size": 64, "lr_scaling": "linear"}
    assert not options.is_passthrough and WindowOptions().is_passthrough
    assert WindowOptions(accum_steps=4).auto_settings is None
    # A copy keeps "auto" (and the auto config).
    copy = dataclasses.replace(options, partial_window="carry")
    assert copy.auto and copy.get_config()["accum_steps"] == "auto"
    with pytest.raises(ValueError, match="`auto` is set by accum_steps='auto'"):
        WindowOptions(accum_steps=4, auto=True, max_effective_batch_size=64)


def test_frozen():
    options = WindowOptions(accum_steps=4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.accum_steps = 8
    assert options == WindowOptions(accum_steps=4) and hash(options) == hash(WindowOptions(accum_steps=4))


@pytest.mark.parametrize("given", [
    {"accum_steps": 4, "partial_window": "drop", "merge_duplicate_rows": True},
    {"accum_steps": 1, "schedulable": True, "measure_noise_scale": True, "noise_scale_smoothing": 0.5},
    {"accum_steps": "auto", "max_effective_batch_size": 128, "lr_scaling": "sqrt", "loss_reduction": "mean"},
])
def test_config_round_trip_and_the_accumulator_writes_the_same(given):
    options = WindowOptions(**given)
    assert WindowOptions.from_config(options.get_config()) == options
    config = GradientAccumulator(keras.optimizers.SGD(), **given).get_config()
    assert {k: v for k, v in config.items() if k not in ("name", "optimizer")} == options.get_config()


def test_accumulator_takes_options_or_keywords_not_both():
    options = WindowOptions(accum_steps=4, partial_window="carry")
    optimizer = GradientAccumulator(keras.optimizers.SGD(), options=options)
    assert optimizer.options is options
    assert (optimizer.accum_steps, optimizer.partial_window, optimizer.schedulable) == (4, "carry", False)
    assert GradientAccumulator(keras.optimizers.SGD(), accum_steps=4, partial_window="carry").options == options
    with pytest.raises(ValueError, match=r"not both; received `options` and \['accum_steps'\]"):
        GradientAccumulator(keras.optimizers.SGD(), 2, options=options)
    with pytest.raises(TypeError, match="`options` must be a WindowOptions"):
        GradientAccumulator(keras.optimizers.SGD(), options={"accum_steps": 2})


def test_cache_options():
    assert CacheOptions(4, True) == CacheOptions(accum_steps=4, gather_across_replicas=True)
    with pytest.raises(ValueError, match="`accum_steps` must be a positive integer"):
        CacheOptions(0)
    with pytest.raises(TypeError, match="`gather_across_replicas` must be True or False; received 1"):
        CacheOptions(2, 1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        CacheOptions(2).accum_steps = 3


def test_public_names_stay_importable():
    from tfx_gradient_accumulator import WindowOptions as package_name
    from tfx_gradient_accumulator.accumulator import validate_accum_steps
    from tfx_gradient_accumulator.accumulator.schedules.callbacks import validate_schedule
    from tfx_gradient_accumulator.accumulator.schedules.lr_scaling import validate_lr_scaling
    from tfx_gradient_accumulator.accumulator.optimizer import validate_measure_noise_scale, validate_partial_window
    from tfx_gradient_accumulator.accumulator.window.window import validate_merge_duplicate_rows

    assert package_name is WindowOptions
    assert validate_accum_steps(3) == 3 and validate_schedule({"2": 4}) == {2: 4}
    assert validate_lr_scaling("sqrt") == "sqrt" and validate_partial_window("drop") == "drop"
    assert validate_measure_noise_scale(True) and not validate_merge_duplicate_rows(False)


def test_a_ramp_needs_a_change_of_the_batch_one_rule_in_the_callers_words():
    assert validate_lr_ramp_updates(4, changes=True) == 4
    assert validate_lr_ramp_updates(0, by="epoch", changes=False) == 0      # no ramp: nothing to refuse
    with pytest.raises(ValueError, match=r"`lr_ramp_updates` ramps the learning rate after a change of the "
                                         r"batch: it goes with a schedule by update"):
        validate_lr_ramp_updates(4, changes=False)
    with pytest.raises(ValueError, match=r"after a change of the batch: use a schedule\.$"):
        validate_lr_ramp_updates(4, changes=False, advice="use a schedule.")
    with pytest.raises(ValueError, match="`lr_ramp_updates` counts updates"):
        validate_lr_ramp_updates(4, by="epoch", changes=True)
