"""The window open when `fit` ends: applied by default, carried or dropped on request."""

import numpy as np
import keras
import pytest

from accumulator import GradientAccumulator
from tests.accumulator import reference as ref

MICRO, ACCUM = 8, 4


def _adam():
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5), clipnorm=0.3)


def _fit(partial_window, x, y, epochs=1):
    model = ref.mlp()
    optimizer = GradientAccumulator(_adam(), ACCUM, partial_window=partial_window)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=MICRO, epochs=epochs, shuffle=False, verbose=0)
    return model, optimizer


def test_final_partial_window_is_applied_like_the_last_short_batch():
    # 10 micro-batches: windows of 4, 4 and a final 2 (16 samples).
    x, y = ref.regression_data(MICRO * 10)
    expected = ref.fit_large_batch(ref.mlp(), _adam(), x, y, MICRO * ACCUM)
    model, optimizer = _fit("apply", x, y)
    assert int(optimizer.iterations.numpy()) == 3
    assert int(optimizer.micro_step.numpy()) == 0
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_carry_keeps_the_window_open_for_the_next_fit():
    x, y = ref.regression_data(MICRO * 10)
    model, optimizer = _fit("carry", x, y)
    assert int(optimizer.iterations.numpy()) == 2
    assert int(optimizer.micro_step.numpy()) == 2
    assert any(np.any(a.numpy()) for a in optimizer.accumulators)
    # The next fit's first 2 micro-batches complete the carried window.
    model.fit(x[:MICRO * 2], y[:MICRO * 2], batch_size=MICRO, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 3
    assert int(optimizer.micro_step.numpy()) == 0


def test_drop_discards_the_window_only_when_asked():
    x, y = ref.regression_data(MICRO * 10)
    dropped, optimizer = _fit("drop", x, y)
    assert int(optimizer.iterations.numpy()) == 2
    assert int(optimizer.micro_step.numpy()) == 0
    assert not any(np.any(a.numpy()) for a in optimizer.accumulators)
    # Dropping equals training on the 8 micro-batches of the full windows.
    expected = ref.fit_large_batch(ref.mlp(), _adam(), x[:MICRO * 8], y[:MICRO * 8], MICRO * ACCUM)
    assert ref.max_abs_diff(dropped.get_weights(), expected.get_weights()) <= 1e-6


def test_close_partial_window_on_demand_reports_what_it_held():
    x, y = ref.regression_data(MICRO * 6)
    model, optimizer = _fit("carry", x, y)
    assert optimizer.close_partial_window("carry") == 2
    assert optimizer.close_partial_window("apply") == 2
    assert int(optimizer.iterations.numpy()) == 2
    assert optimizer.close_partial_window() == 0


def test_bad_partial_window_is_refused():
    with pytest.raises(ValueError, match="partial_window"):
        GradientAccumulator(keras.optimizers.SGD(), 2, partial_window="flush")


def test_dataset_of_unknown_length_counts_only_real_micro_batches():
    """fit calls the step once more when the data runs out; that call counts nothing."""
    import tensorflow as tf
    x, y = ref.regression_data(MICRO * 10)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(50).unbatch().batch(MICRO)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    model = ref.mlp()
    optimizer = GradientAccumulator(_adam(), ACCUM, partial_window="carry")
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(dataset, verbose=0)
    assert int(optimizer.micro_step.numpy()) == 2
    assert float(optimizer._weight_sum.numpy()) == 2 * MICRO
    assert optimizer.close_partial_window("apply") == 2
    expected = ref.fit_large_batch(ref.mlp(), _adam(), x, y, MICRO * ACCUM)
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6
