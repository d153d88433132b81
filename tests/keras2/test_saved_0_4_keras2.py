"""A Keras 2 model saved as a `.keras` file by version 0.4.0 (before the library's rooms became
sub-packages and the window's state was split) loads, with its optimizer's open window and its
noise-scale estimates, and trains on exactly as 0.4.0 did. The file and the expected values:
`data/make_saved_0_4_keras2.py`, run with 0.4.0's code once per Keras 2: tf_keras 2.21 and TF 2.15's
own Keras (a file written by one names modules the other cannot import)."""

import pathlib

import numpy as np
import pytest

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import flavours

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")

FLAVOUR = "keras_2_15" if k2 is not None and k2.__name__ == "keras" else "tf_keras"
DATA = pathlib.Path(__file__).parent / "data" / "saved_0_4_keras2" / FLAVOUR


def _arrays(name):
    with np.load(DATA / name) as saved:
        return [saved[f"arr_{i}"] for i in range(len(saved.files))]


def _data():
    x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
    return x, np.random.default_rng(1).integers(0, 20, size=(32, 2)), x.sum(1, keepdims=True)


def test_a_keras2_model_saved_by_0_4_loads_with_its_open_window_and_trains_on_as_0_4_did():
    model = k2.models.load_model(DATA / "model.keras")
    optimizer = model.optimizer
    assert isinstance(optimizer, GradientAccumulator)
    assert optimizer.accum_steps == 4 and optimizer.held_micro_batches == 2
    saved = _arrays("loaded.npz")
    assert len(optimizer.variables) == len(saved)
    for variable, value in zip(optimizer.variables, saved):
        np.testing.assert_array_equal(np.asarray(variable), value, err_msg=variable.name)

    x, ids, y = _data()
    model.fit([x[24:], ids[24:]], y[24:], batch_size=4, shuffle=False, verbose=0)   # closes the held window
    assert optimizer.held_micro_batches == 0
    for variable, value in zip(optimizer.variables, _arrays("continued.npz")):
        np.testing.assert_allclose(np.asarray(variable), value, rtol=1e-6, atol=1e-7, err_msg=variable.name)
    for mine, theirs in zip(model.get_weights(), _arrays("continued_weights.npz")):
        np.testing.assert_allclose(mine, theirs, rtol=1e-6, atol=1e-7)
