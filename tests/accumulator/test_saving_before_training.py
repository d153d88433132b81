"""Saving before training: `model.save` and `pickle` of a compiled, not yet trained model.

For every optimizer Keras ships as the inner one, unbuilt (compiled only) and built
(`optimizer.build`, no step), on one device and under a `MirroredStrategy`. A loaded
model then trains as the saved one does.
"""

import inspect
import pickle

import numpy as np
import pytest
import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests import sweeps
from tests.accumulator import reference as ref

# Keras' optimizers that take no arguments beyond their defaults (the wrappers apart).
WRAPPERS = {"Optimizer", "LossScaleOptimizer", "MultiOptimizer"}
INNER = sorted(name for name, cls in vars(keras.optimizers).items()
               if inspect.isclass(cls) and issubclass(cls, keras.optimizers.Optimizer)
               and name not in WRAPPERS)
MICRO, ACCUM = 8, 2


def _inner(name):
    if name == "LossScaleOptimizer(SGD)":
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    return getattr(keras.optimizers, name)()


def _mirrored():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())


def _scope(strategy):
    return strategy.scope() if strategy is not None else tf.distribute.get_strategy().scope()


def _compiled(name, built):
    model = ref.mlp(0)
    model.compile(optimizer=GradientAccumulator(_inner(name), accum_steps=ACCUM), loss="mse")
    if built:
        model.optimizer.build(model.trainable_variables)
    return model


def test_the_list_covers_keras_optimizers():
    assert {"SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Nadam", "Ftrl", "Lion"} <= set(INNER)


# Keras' own warning where a saved optimizer's variable count differs from the
# loading one's: a model saved unbuilt loads built; an optimizer pickled alone
# unpickles unbuilt (its state is dropped, as Keras does for its own optimizers).
SKIPPED = "ignore:Skipping variable loading for optimizer"


def _cases():
    """(name, strategy) for every inner optimizer; the every-optimizer sweep's marks. Under
    the strategy, apart (3 s each) but Adam: Adam's mirrored cases run, and SGD's and AdamW's
    on one device (what the strategy changes is the window's variables, not the inner
    optimizer's)."""
    for name in INNER + ["LossScaleOptimizer(SGD)"]:
        yield pytest.param(name, None, marks=sweeps.marks(name))
        apart = [] if name == "Adam" or sweeps.marks(name) else [pytest.mark.apart]
        yield pytest.param(name, "mirrored", marks=sweeps.marks(name) + apart)


@pytest.mark.filterwarnings(SKIPPED)
@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
@pytest.mark.parametrize("name, strategy", list(_cases()))
def test_save_and_pickle_before_training(name, built, strategy, tmp_path):
    strategy = _mirrored() if strategy else None
    with _scope(strategy):
        model = _compiled(name, built)
        optimizer = model.optimizer
        assert optimizer.built == built
        model.save(tmp_path / "m.keras")
        restored = pickle.loads(pickle.dumps(optimizer))
        stock = pickle.loads(pickle.dumps(optimizer.inner_optimizer))
        loaded = keras.models.load_model(tmp_path / "m.keras")
    for copy in (restored, loaded.optimizer):
        assert type(copy) is GradientAccumulator
        assert type(copy.inner_optimizer) is type(optimizer.inner_optimizer)
        assert copy.accum_steps == ACCUM
    assert restored.built == stock.built   # as Keras pickles the inner optimizer alone
    assert loaded.optimizer.built           # Keras builds a compiled model's optimizer
    if built:
        # The built window's state round-trips value for value.
        saved = optimizer.get_weights()
        assert len(loaded.optimizer.get_weights()) == len(saved) > 10
        for a, b in zip(loaded.optimizer.get_weights(), saved):
            np.testing.assert_array_equal(a, b)


@pytest.mark.filterwarnings(SKIPPED)
@pytest.mark.parametrize("built", [False, True], ids=["unbuilt", "built"])
def test_a_model_saved_before_training_trains_as_the_original(built, tmp_path):
    x, y = ref.regression_data(MICRO * 8)
    model = _compiled("Adam", built)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    initial = model.get_weights()
    np.testing.assert_array_equal(loaded.get_weights()[0], initial[0])
    for m in (model, loaded):
        m.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 4
    # Control: training moved the weights, so the comparison below means something.
    assert ref.max_abs_diff(model.get_weights(), initial) > 1e-3
    assert ref.max_abs_diff(loaded.get_weights(), model.get_weights()) <= 1e-6


def test_pickle_of_an_unbuilt_accumulator_trains_as_the_original():
    x, y = ref.regression_data(MICRO * 8)
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), accum_steps=ACCUM)
    copy = pickle.loads(pickle.dumps(optimizer))
    runs = []
    for opt in (optimizer, copy):
        model = ref.mlp(0)
        model.compile(optimizer=opt, loss="mse")
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
        runs.append(model.get_weights())
    assert ref.max_abs_diff(runs[0], ref.mlp(0).get_weights()) > 1e-3
    assert ref.max_abs_diff(runs[0], runs[1]) <= 1e-6
