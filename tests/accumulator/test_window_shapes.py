"""The window's buffers state the shape they hold (issue 47, item 2).

The dense buffers start as one-row stand-ins and the rows of sparse gradients grow;
TensorFlow keeps their open declared shape (`seam.declared_shape`), and `v.shape`
says what each holds (`seam.reports_held_shape`): `model.summary()`'s optimizer count
is the elements held, and a checkpoint written before this change restores.
"""

import pathlib

import numpy as np
import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import seam

DATA = pathlib.Path(__file__).parent / "data"


def _embedding_model(vocabulary=20, dim=3, ids=2, features=5, hidden=4):
    """Dense features and a lookup (the table gets only sparse gradients: its buffer stays a stand-in)."""
    keras.utils.set_random_seed(0)
    inp, tok = keras.Input((features,)), keras.Input((ids,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(vocabulary, dim)(tok))
    hidden = keras.layers.Dense(hidden)(keras.layers.Concatenate()([inp, pooled]))
    return keras.Model([inp, tok], keras.layers.Dense(1)(hidden))


def _data(n=24, vocabulary=20, ids=2, features=5):
    x = np.random.default_rng(0).normal(size=(n, features)).astype("float32")
    return [x, np.random.default_rng(1).integers(0, vocabulary, size=(n, ids))], x.sum(1, keepdims=True)


def _held(variable):
    return tuple(int(d) for d in tf.shape(variable))


def _assert_true_shapes(optimizer):
    for v in optimizer.variables:
        assert tuple(v.shape) == _held(v), (v.path, tuple(v.shape), _held(v))


def test_after_fit_every_optimizer_variable_states_what_it_holds_and_summary_counts_it():
    x, y = _data(64)
    model = _embedding_model()
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), accum_steps=4)
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=8, verbose=0)
    _assert_true_shapes(optimizer)
    by_name = {v.path.split("/")[-1]: v for v in optimizer.variables}
    assert tuple(by_name["accumulator_1"].shape) == (8, 4)       # filled: the kernel's shape
    assert tuple(by_name["accumulator_0"].shape) == (1, 3)       # the table's stand-in, never filled
    assert tuple(by_name["rows_0_values"].shape) == (4 * 8 * 2, 3)   # grown inside the traced step
    assert by_name["accumulator_0"].value.shape.as_list() == [None, 3]      # TensorFlow keeps it open
    assert seam.declared_shape(by_name["rows_0_indices"]).as_list() == [None]
    lines = []
    model.summary(print_fn=lambda line, *args, **kwargs: lines.append(line))
    counted = next(line for line in "\n".join(lines).splitlines() if "Optimizer params" in line)
    held = sum(int(np.prod(_held(v))) for v in optimizer.variables)
    assert int(counted.split(":")[1].split("(")[0].replace(",", "")) == held


def test_a_step_traced_after_the_shapes_were_read_still_grows_its_rows():
    x, y = _data(48)
    model = _embedding_model()
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.1), accum_steps=2)
    model.compile(optimizer, "mse")
    model.fit([a[:8] for a in x], y[:8], batch_size=4, verbose=0)
    _assert_true_shapes(optimizer)
    optimizer.set_accum_steps(6)             # longer windows: the rows grow again
    model.compile(optimizer, "mse")          # a new train step, traced now
    model.fit(x, y, batch_size=4, verbose=0)
    _assert_true_shapes(optimizer)
    rows = {v.path.split("/")[-1]: v for v in optimizer.variables}["rows_0_values"]
    assert tuple(rows.shape) == (6 * 4 * 2, 3)


def test_a_checkpoint_written_before_buffers_stated_their_shape_restores():
    # Written by tests/accumulator/data/make_window_checkpoint_v1.py with the code of
    # f49b76b: 6 micro-batches of 4 (one window applied, 2 held), the table's buffer a
    # one-row stand-in, its rows grown to 32.
    x, y = _data()
    model = _embedding_model()
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), accum_steps=4, partial_window="carry")
    model.compile(optimizer, "mse")
    optimizer.build(model.trainable_variables)
    status = tf.train.Checkpoint(optimizer=optimizer, model=model).read(
        str(DATA / "window_checkpoint_v1_keras3" / "ckpt"))
    status.assert_consumed()
    expected = np.load(DATA / "window_checkpoint_v1_keras3" / "expected.npz")
    assert len(expected.files) == len(optimizer.variables)
    for v, want in zip(optimizer.variables, [expected[f"arr_{i}"] for i in range(len(expected.files))]):
        np.testing.assert_array_equal(v.numpy(), want)
    _assert_true_shapes(optimizer)
    assert optimizer.held_micro_batches == 2 and int(optimizer.iterations) == 1
    model.fit(x, y, batch_size=4, verbose=0)          # 2 held + 6: two more windows
    assert optimizer.held_micro_batches == 0 and int(optimizer.iterations) == 3
    _assert_true_shapes(optimizer)


def test_keras_file_round_trip_keeps_true_shapes(tmp_path):
    x, y = _data()
    model = _embedding_model()
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), accum_steps=4, partial_window="carry")
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=4, verbose=0)
    model.save(tmp_path / "m.keras")
    restored = keras.models.load_model(tmp_path / "m.keras")
    _assert_true_shapes(restored.optimizer)
    # (A row buffer is saved as the rows it holds, not its capacity: it may come back smaller.)
    for a, b in zip(optimizer.get_weights(), restored.optimizer.get_weights()):
        np.testing.assert_array_equal(a, b)
