"""The window's state in two parts: the variables it saves (`WindowVariables`, the noise
scale's only where it is measured) and what Python notes (`WindowNotes`, never saved).
An optimizer saved before the split (`data/window_variables_v2_keras3.npz`, written by
`data/make_window_variables_v2.py` with the code before it) loads by name, order and value,
and trains on as the optimizer that was never saved."""

import importlib.util
import pathlib

import keras
import numpy as np
import pytest

from tfx_gradient_accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.window.state import WindowVariables

DATA = pathlib.Path(__file__).parent / "data"
_spec = importlib.util.spec_from_file_location("make_window_variables_v2", DATA / "make_window_variables_v2.py")
v2 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(v2)


def _window_variables_in_saved_order(saved: WindowVariables):
    """The saved part's variables in the order its docstring gives: the counters, each
    model variable's buffer and rows, the noise scale's sums and estimates."""
    listed = [saved.micro_step, saved.accum_steps, saved.weight_sum]
    for accumulator, rows in zip(saved.accumulators, saved.rows):
        listed += [accumulator] + ([] if rows is None else rows.variables)
    noise = saved.noise
    if noise is not None:
        listed += [v for v in (noise.squares, noise.sums) if v is not None]
        listed += [e.state for e in (noise.estimate, noise.preconditioned_estimate) if e is not None]
    return listed


def test_an_optimizer_saved_before_the_split_loads_by_name_order_and_value_and_trains_on():
    saved = np.load(DATA / "window_variables_v2_keras3.npz")
    keras.backend.clear_session()      # the layers' names, which the variables' names hold, as in a fresh process
    x, ids, y = v2.data()
    model, optimizer = v2.model_and_optimizer()
    model.set_weights([saved[f"weight_{i}"] for i in range(len(model.get_weights()))])
    optimizer.build(model.trainable_variables)
    assert [v.name for v in optimizer.variables] == list(saved["names"])
    store = {name[len("value_"):]: saved[name] for name in saved.files if name.startswith("value_")}
    optimizer.load_own_variables(store)
    reread = {}
    optimizer.save_own_variables(reread)
    assert sorted(reread) == sorted(store)
    for key, value in store.items():
        np.testing.assert_array_equal(reread[key], value, err_msg=key)
    assert optimizer.held_micro_batches == 2

    # The 2 held micro-batches and 6 more: two windows, as without the save.
    model.fit([x, ids], y, batch_size=4, shuffle=False, verbose=0)
    never_saved, never_saved_optimizer = v2.model_and_optimizer()
    for _ in range(2):
        never_saved.fit([x, ids], y, batch_size=4, shuffle=False, verbose=0)
    assert optimizer.held_micro_batches == 0 and int(optimizer.iterations) == int(never_saved_optimizer.iterations) == 3
    for loaded, kept in zip(model.get_weights(), never_saved.get_weights()):
        np.testing.assert_allclose(loaded, kept, rtol=1e-5, atol=1e-7)
    assert int(optimizer.noise_scale_estimate.window_count) == 3
    assert optimizer.noise_scale == pytest.approx(never_saved_optimizer.noise_scale, rel=1e-4)


def test_the_saved_part_holds_every_window_variable_in_the_order_the_optimizer_saves_them():
    model, optimizer = v2.model_and_optimizer()
    optimizer.build(model.trainable_variables)
    state = optimizer._state
    window = _window_variables_in_saved_order(state.saved)
    inner = {id(v) for v in optimizer.inner_optimizer.variables}
    own = [v for v in optimizer.variables if id(v) not in inner and v.name not in ("iteration", "learning_rate")]
    assert [id(v) for v in own] == [id(v) for v in window]
    # Scalars get a buffer and no rows; the table, the kernels and the biases get rows.
    scalar = [i for i, v in enumerate(state.variables) if not v.shape.rank]
    assert scalar and all(state.saved.rows[i] is None for i in scalar)
    # Nothing Python notes is a variable, so nothing of it is saved.
    for name, value in vars(state.notes).items():
        items = value.values() if isinstance(value, dict) else value if isinstance(value, (set, list)) else [value]
        assert not any(isinstance(v, keras.Variable) for v in items), name


@pytest.mark.parametrize("inner, measure, parts", [
    ("adam", False, None),
    ("sgd", True, ("sums", "estimate")),
    ("adam", True, ("sums", "estimate", "squares", "preconditioned_estimate", "preconditioner")),
])
def test_the_noise_scale_part_exists_only_where_it_is_measured(inner, measure, parts):
    inner_optimizer = keras.optimizers.Adam() if inner == "adam" else keras.optimizers.SGD()
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    optimizer = GradientAccumulator(inner_optimizer, 2, measure_noise_scale=measure)
    model.compile(optimizer, "mse")
    model.fit(np.ones((8, 3), "float32"), np.ones((8, 2), "float32"), batch_size=2, verbose=0)
    noise = optimizer._state.saved.noise
    if parts is None:
        assert noise is None
        assert not any("noise_scale" in v.name or "preconditioned" in v.name for v in optimizer.variables)
        return
    present = {name for name in ("sums", "estimate", "squares", "preconditioned_estimate", "preconditioner")
               if getattr(noise, name) is not None}
    assert present == set(parts)
    assert int(optimizer.noise_scale_estimate.window_count) == 2
