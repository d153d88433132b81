"""Sparse gradients' rows under XLA (`jit_compile=True`, Keras' "auto" on one GPU).

Keras 3 applies a sparse gradient's repeated rows one by one, also under XLA (its
large batch compiled and uncompiled: 2e-8 apart here). The window keeps each
micro-batch's rows in a room made outside the compiled step (`window_rows.has_room`,
`accumulator.rows.row_room`): rows of one micro-batch x the window's length. Each case
compares `fit` (or a custom step) compiled with XLA to Keras' own large batch
compiled with XLA, from the same initial weights.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import AccumulationSchedule, GradientAccumulator
from tests.accumulator import reference as ref

MICRO, ACCUM = 8, 4
OPTIMIZERS = {
    "adam": lambda: keras.optimizers.Adam(1e-2),
    "sgd-global_clipnorm": lambda: keras.optimizers.SGD(0.1, momentum=0.9, global_clipnorm=0.5),
}


def _fit(optimizer, x, y, batch_size, epochs=2, jit_compile=True, model=None, **fit_kwargs):
    model = model or ref.embedding_model()
    model.compile(optimizer=optimizer, loss="mse", jit_compile=jit_compile)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return model


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_per_token_rows_under_xla_follow_keras_xla_large_batch(name):
    x, y = ref.token_data()
    expected = _fit(OPTIMIZERS[name](), x, y, MICRO * ACCUM)
    optimizer = GradientAccumulator(OPTIMIZERS[name](), ACCUM)
    model = _fit(optimizer, x, y, MICRO)

    assert model.jit_compile is True
    assert list(optimizer.gradient_kinds.values()).count("rows") == 1
    # The room: the rows of one micro-batch (8 samples x 10 ids) x the window.
    values = optimizer.window_rows[0].values
    assert tuple(tf.shape(values).numpy()) == (MICRO * ref.TOKENS * ACCUM, 8)
    diff = ref.max_abs_diff(model.get_weights(), expected.get_weights())
    assert diff <= 1e-6
    if name == "adam":      # summing each index's rows first is another update with Adam
        summed = _fit(GradientAccumulator(OPTIMIZERS[name](), ACCUM, merge_duplicate_rows=True), x, y, MICRO)
        assert ref.max_abs_diff(summed.get_weights(), expected.get_weights()) > 1e3 * max(diff, 1e-7)


def test_uneven_batches_and_partial_windows_under_xla():
    # 83 samples in micro-batches of 8: the last micro-batch of 3 samples has fewer
    # rows than the room's share (zero rows pad it); windows of 4, 4 and 3 micro-batches.
    x, y = ref.token_data(83)
    expected = _fit(OPTIMIZERS["adam"](), x, y, MICRO * ACCUM)
    model = _fit(GradientAccumulator(OPTIMIZERS["adam"](), ACCUM), x, y, MICRO)
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-5


def test_a_custom_step_with_static_shapes_makes_its_room_when_traced():
    x, y = ref.token_data(MICRO * ACCUM * 4)
    expected = _fit(OPTIMIZERS["adam"](), x, y, MICRO * ACCUM, epochs=1)
    model = ref.embedding_model()
    optimizer = GradientAccumulator(OPTIMIZERS["adam"](), ACCUM)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(jit_compile=True)
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    for start in range(0, len(x), MICRO):
        step(tf.constant(x[start:start + MICRO]), tf.constant(y[start:start + MICRO]))
    assert int(optimizer.iterations.numpy()) == 4
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_a_longer_window_grows_the_room_between_windows():
    # A schedule doubles the window after the first epoch: the room follows the
    # longest window, and the run equals the same schedule without XLA.
    x, y = ref.token_data(128)

    def run(jit_compile):
        optimizer = GradientAccumulator(OPTIMIZERS["adam"](), 2, schedulable=True)
        model = _fit(optimizer, x, y, MICRO, epochs=2, jit_compile=jit_compile,
                     callbacks=[AccumulationSchedule({0: 2, 1: 4})])
        return model, optimizer

    compiled, optimizer = run(True)
    uncompiled, _ = run(False)
    assert tuple(tf.shape(optimizer.window_rows[0].values).numpy())[0] == MICRO * ref.TOKENS * 4
    assert ref.max_abs_diff(compiled.get_weights(), uncompiled.get_weights()) <= 1e-6


def test_a_micro_batch_larger_than_the_room_is_reported_not_applied_silently():
    # Sequences that grow: the room is read from the first batch (5 ids a sample);
    # later micro-batches have 20, and a window of them no longer fits.
    rng = np.random.RandomState(0)
    short = tf.data.Dataset.from_tensor_slices((rng.randint(0, 40, (32, 5)).astype("int32"),
                                                rng.randn(32, 1).astype("float32"))).batch(MICRO)
    long = tf.data.Dataset.from_tensor_slices((rng.randint(0, 40, (32, 20)).astype("int32"),
                                               rng.randn(32, 1).astype("float32"))).batch(MICRO)
    model = keras.Sequential([keras.Input((None,), dtype="int32"), keras.layers.Embedding(40, 8),
                              keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])
    model.compile(GradientAccumulator(OPTIMIZERS["adam"](), ACCUM), "mse", jit_compile=True)
    with pytest.raises(RuntimeError, match="more sparse-gradient rows for .*embeddings.*40 rows per micro-batch"):
        model.fit(short.concatenate(long), epochs=1, verbose=0)
