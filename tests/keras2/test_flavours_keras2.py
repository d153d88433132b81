"""One public name per class for both Keras (`accumulator.core.flavours`): the Keras 2 classes
are instances and subclasses of the public names, beside Keras 3 or on TF 2.15 alone."""

import keras
import pytest

from tfx_gradient_accumulator.accumulator import AccumulationSchedule, AutoAccumulation, EpochWindows, GradientAccumulator, GradientCache
from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.schedules.auto_batch import auto_accumulation_class
from tfx_gradient_accumulator.accumulator.schedules.callbacks import window_callback_classes
from tfx_gradient_accumulator.accumulator.gradient_cache import is_gradient_cache

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 installed")


def _model():
    return k2.Sequential([k2.Input((2,)), k2.layers.Dense(1)])


def test_keras2_accumulators_are_instances_of_the_public_name():
    from tfx_gradient_accumulator.accumulator import keras2

    plain = GradientAccumulator(k2.optimizers.SGD(), 2)
    scaling = GradientAccumulator(k2.mixed_precision.LossScaleOptimizer(k2.optimizers.SGD()), 2)
    assert type(plain) is keras2.GradientAccumulator
    assert type(scaling) is keras2.LossScalingGradientAccumulator
    for optimizer in (plain, scaling):
        assert isinstance(optimizer, GradientAccumulator) and isinstance(optimizer, k2.optimizers.Optimizer)
        assert issubclass(type(optimizer), GradientAccumulator)
        assert not isinstance(optimizer, GradientCache)
    assert not isinstance(k2.optimizers.SGD(), GradientAccumulator)


def test_a_keras2_gradient_cache_is_an_instance_of_the_public_name():
    cache = GradientCache(_model(), 2)
    assert isinstance(cache, GradientCache) and isinstance(cache, k2.Model) and is_gradient_cache(cache)
    assert not isinstance(cache, GradientAccumulator)
    assert not isinstance(_model(), GradientCache) and not is_gradient_cache(_model())


def test_keras2_callbacks_are_instances_of_the_public_names():
    epoch_windows, schedule = EpochWindows.for_keras(k2), AccumulationSchedule.for_keras(k2)
    auto = AutoAccumulation.for_keras(k2)
    assert (epoch_windows, schedule) == window_callback_classes(k2) and auto is auto_accumulation_class(k2)
    assert EpochWindows.for_keras(k2) is epoch_windows       # made once
    for made in (epoch_windows, schedule, auto):
        assert issubclass(made, k2.callbacks.Callback) and issubclass(made, EpochWindows)
    assert isinstance(schedule({0: 2}), EpochWindows) and isinstance(schedule({0: 2}), AccumulationSchedule)
    assert not isinstance(epoch_windows(), AccumulationSchedule)
    assert (schedule.__name__, auto.__name__) == ("AccumulationSchedule", "AutoAccumulation")
    if keras.__version__.startswith("3."):
        assert epoch_windows is not EpochWindows and not isinstance(EpochWindows(), epoch_windows)
        assert issubclass(auto, schedule)
    else:   # TF 2.15: `keras` is Keras 2, whose classes the public ones are
        assert (epoch_windows, schedule, auto) == (EpochWindows, AccumulationSchedule, AutoAccumulation)
