"""One public name per class for both Keras (`accumulator.core.flavours`): Keras 3's side.

The Keras 2 side, where `tf_keras` or TF 2.15 is installed, is `tests/keras2/test_flavours_keras2.py`.
"""

import keras
import pytest

from tfx_gradient_accumulator import accumulator
from tfx_gradient_accumulator.accumulator import AccumulationSchedule, AutoAccumulation, EpochWindows, GradientAccumulator, GradientCache
from tfx_gradient_accumulator.accumulator.core import flavours, seam
from tfx_gradient_accumulator.accumulator.schedules.auto_batch import auto_accumulation_class
from tfx_gradient_accumulator.accumulator.schedules.callbacks import window_callback_classes
from tfx_gradient_accumulator.accumulator.gradient_cache import is_gradient_cache

PUBLIC = (GradientAccumulator, GradientCache, EpochWindows, AccumulationSchedule, AutoAccumulation)


def _model():
    return keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])


def test_keras3_objects_are_instances_of_the_public_names():
    optimizer = GradientAccumulator(keras.optimizers.SGD(), 2)
    assert type(optimizer) is GradientAccumulator and isinstance(optimizer, GradientAccumulator)
    cache = GradientCache(_model(), 2)
    assert type(cache) is GradientCache and isinstance(cache, GradientCache) and is_gradient_cache(cache)
    assert not isinstance(optimizer, GradientCache) and not isinstance(cache, GradientAccumulator)
    assert not isinstance(_model(), GradientCache) and not is_gradient_cache(_model())
    schedule = AccumulationSchedule({0: 2})
    assert isinstance(schedule, EpochWindows) and not isinstance(EpochWindows(), AccumulationSchedule)
    assert issubclass(AutoAccumulation, EpochWindows) and not issubclass(EpochWindows, AutoAccumulation)


@pytest.mark.parametrize("package", [keras, None], ids=["keras", "none"])
def test_each_public_class_is_its_own_keras3_class(package):
    for public in PUBLIC:
        assert public.for_keras(package) is public
    assert window_callback_classes(keras) == (EpochWindows, AccumulationSchedule)
    assert auto_accumulation_class(keras) is AutoAccumulation


def test_a_users_subclass_is_a_plain_class():
    class Mine(GradientAccumulator):
        pass

    mine = Mine(keras.optimizers.SGD(), 2)
    assert type(mine) is Mine and isinstance(mine, GradientAccumulator)
    assert not isinstance(GradientAccumulator(keras.optimizers.SGD(), 2), Mine)


def test_names_and_serialization_are_unchanged():
    assert GradientAccumulator.__module__ == "tfx_gradient_accumulator.accumulator.optimizer"
    assert keras.saving.get_registered_name(GradientAccumulator) == "accumulator>GradientAccumulator"
    assert keras.saving.get_registered_name(GradientCache) == "accumulator>GradientCache"
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), 4)
    again = GradientAccumulator.from_config(optimizer.get_config())
    assert type(again) is GradientAccumulator and again.get_config() == optimizer.get_config()


def test_the_detection_is_public_and_out_of_the_private_names_module():
    assert flavours.version_tuple("3.15.1") == (3, 15)
    assert flavours.keras_is_3() is (keras.__version__[0] == "3")
    assert flavours.keras_package_of(_model()) is keras and not flavours.is_keras2_object(_model())
    assert flavours.keras_package_of(object()) is None
    for name in ("version_tuple", "keras_is_3", "keras2_module", "keras_package_of", "is_keras2_object",
                 "tf_keras_is_keras2"):
        assert not hasattr(seam, name), name
    assert accumulator.GradientAccumulator is GradientAccumulator
