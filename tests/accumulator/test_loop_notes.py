"""Custom loops that drift from the large batch are told so, once; `fit` and the documented loop are not (issue 47,
item 3); `micro_batches` weighs each micro-batch (issue 58, item 2: the fresh-process patterns are `test_custom_loops.py`)."""

import numpy as np
import pytest
import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.window import loop_notes

LOGGER = "tfx_gradient_accumulator.accumulator.window.window"
UNEVEN = "is given no `micro_batch_weight`"
OPEN = "while its window holds"


def _data(n=100):
    x = np.random.default_rng(0).normal(size=(n, 8)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])


def _custom_loop(weighted, close, n=100, batch=8, accum_steps=4):
    """The README's loop over `n` samples in micro-batches of `batch` (the last shorter)."""
    x, y = _data(n)
    model = _model()
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.1), accum_steps=accum_steps)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def micro_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        weight = tf.cast(tf.shape(xb)[0], tf.float32) if weighted else None
        optimizer.apply_gradients(zip(grads, model.trainable_variables), micro_batch_weight=weight)

    for start in range(0, n, batch):
        micro_step(x[start:start + batch], y[start:start + batch])
    if close:
        optimizer.close_partial_window()
    return model, optimizer


def _large_batch(n=100, batch=32):
    x, y = _data(n)
    model = _model()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


def test_uneven_micro_batches_without_a_weight_are_reported_once(caplog):
    with caplog.at_level("WARNING", logger=LOGGER):
        model, optimizer = _custom_loop(weighted=False, close=True, n=104)   # 13 micro-batches of 8
    assert UNEVEN not in caplog.text                     # even micro-batches: nothing to say
    caplog.clear()
    with caplog.at_level("WARNING", logger=LOGGER):
        model, optimizer = _custom_loop(weighted=False, close=True, n=92)   # 11 × 8 and one of 4
    assert caplog.text.count(UNEVEN) == 1
    assert "of 4 sample(s), and before for 8" in caplog.text
    # ... and it is right: the last window (8, 8, 8, 4) is not the large batch's 28.
    drift = max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), _large_batch(92).get_weights()))
    assert drift > 1e-4


def test_the_documented_loop_says_nothing_and_is_the_large_batch(caplog):
    with caplog.at_level("WARNING", logger=LOGGER):
        model, optimizer = _custom_loop(weighted=True, close=True)
        optimizer.get_weights()
    assert UNEVEN not in caplog.text and OPEN not in caplog.text
    for ours, theirs in zip(model.get_weights(), _large_batch().get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)


def test_a_custom_loops_open_window_is_reported_when_its_state_is_saved(caplog, tmp_path):
    with caplog.at_level("WARNING", logger=LOGGER):
        model, optimizer = _custom_loop(weighted=True, close=False, n=48)   # 6 micro-batches: 2 held
    assert OPEN not in caplog.text
    with caplog.at_level("WARNING", logger=LOGGER):
        model.compile(optimizer, "mse")
        model.save(tmp_path / "m.keras")
        optimizer.get_weights()
    assert caplog.text.count(OPEN) == 1                          # once per optimizer
    assert "holds 2 micro-batch(es)" in caplog.text


@pytest.mark.parametrize("partial_window", ["apply", "carry"])
def test_fit_on_uneven_batches_and_its_mid_window_saves_say_nothing_of_the_kind(partial_window, caplog, tmp_path):
    x, y = _data()
    model = _model()
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.1), accum_steps=4, partial_window=partial_window)
    model.compile(optimizer, "mse")

    class SaveMidWindow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 5:
                self.model.save_weights(str(tmp_path / "mid.weights.h5"))

    with caplog.at_level("WARNING", logger=LOGGER):
        model.fit(x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, callbacks=[SaveMidWindow()])
        optimizer.get_weights()
    assert UNEVEN not in caplog.text and OPEN not in caplog.text


def test_a_step_traced_for_any_size_shows_no_size_and_is_told_so_once(caplog):
    notes = loop_notes.LoopNotes()

    @tf.function(input_signature=[tf.TensorSpec((None, 8))])
    def step(x):
        notes.note_step(None, None, summed=False)
        return x

    with caplog.at_level("WARNING", logger=LOGGER), pytest.warns(loop_notes.CustomLoopWarning, match="of any size"):
        step(tf.zeros((8, 8)))
        step(tf.zeros((4, 8)))
    assert notes.unweighted_sizes == set() and notes.warned == {"any size"}
    assert caplog.text.count("of any size") == 1                    # traced once, said once


def test_a_step_traced_for_any_size_with_a_weight_says_nothing():
    notes = loop_notes.LoopNotes()

    @tf.function(input_signature=[tf.TensorSpec((None, 8))])
    def step(x):
        notes.note_step(tf.cast(tf.shape(x)[0], tf.float32), None, summed=False)
        return x

    step(tf.zeros((8, 8)))
    assert not notes.warned


def test_micro_batches_refuses_what_it_cannot_weigh_before_any_step():
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.1), accum_steps=4)
    with pytest.raises(TypeError, match="`data` must be iterable"):
        optimizer.micro_batches(3)

    @tf.function
    def inside():
        optimizer.micro_batches([np.zeros((2, 8))])

    with pytest.raises(RuntimeError, match="call it outside tf.function"):
        inside()
    with pytest.raises(TypeError, match="leading \\(batch\\) dimension"):
        next(optimizer.micro_batches([(1.0, 2.0)]))


def test_micro_batches_weighs_each_by_its_samples_unless_the_step_says_otherwise():
    """An explicit `micro_batch_weight` wins over the helper's; outside the helper a step weighs 1."""
    x, y = _data(92)
    model = _model()
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.1), accum_steps=4)
    loss_fn = keras.losses.MeanSquaredError()
    seen = []

    def micro_step(xb, yb, weight=None):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables), micro_batch_weight=weight)
        seen.append(float(optimizer._state.notes.loop_notes.weight.numpy()))

    batches = [(x[s:s + 8], y[s:s + 8]) for s in range(0, 92, 8)]
    for xb, yb in optimizer.micro_batches(batches):
        micro_step(xb, yb)
    assert seen == [8.0] * 11 + [4.0] and optimizer.held_micro_batches == 0
    assert float(optimizer._state.notes.loop_notes.weight.numpy()) == -1.0   # outside: no weight
    for ours, theirs in zip(model.get_weights(), _large_batch(92).get_weights()):
        np.testing.assert_allclose(ours, theirs, atol=1e-5)
    # A weight of 1 each given explicitly: the helper's is not used, and the last window drifts.
    model, optimizer = _model(), GradientAccumulator(keras.optimizers.SGD(0.1), accum_steps=4)
    for xb, yb in optimizer.micro_batches(batches):
        micro_step(xb, yb, weight=1.0)
    assert max(float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), _large_batch(92).get_weights())) > 1e-4
