"""Windows open when an epoch or `fit` ends: applied by default, carried or dropped on request."""

import functools

import numpy as np
import keras
import pytest

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.schedules.callbacks import AccumulationSchedule, EpochWindows
from tfx_gradient_accumulator.accumulator.fit_hook import with_epoch_windows
from tests.accumulator import reference as ref

MICRO, ACCUM = 8, 4


def _adam():
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5), clipnorm=0.3)


def _fit(partial_window, x, y, epochs=1, **fit_kwargs):
    model = ref.mlp()
    optimizer = GradientAccumulator(_adam(), ACCUM, partial_window=partial_window)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=MICRO, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return model, optimizer


@functools.lru_cache(maxsize=None)
def _large_batch_of_ten_micro_batches():
    """Keras' fit of `regression_data(80)` at batches of 32 (32, 32, 16), one epoch: the
    reference of two tests below (read only)."""
    x, y = ref.regression_data(MICRO * 10)
    return ref.fit_large_batch(ref.mlp(), _adam(), x, y, MICRO * ACCUM)


class WindowRecorder(keras.callbacks.Callback):
    """What a user's callback sees at each epoch end."""

    def __init__(self):
        super().__init__()
        self.micro_steps, self.updates = [], []

    def on_epoch_end(self, epoch, logs=None):
        self.micro_steps.append(int(self.model.optimizer.micro_step.numpy()))
        self.updates.append(int(self.model.optimizer.iterations.numpy()))


def test_final_partial_window_is_applied_like_the_last_short_batch():
    # 10 micro-batches: windows of 4, 4 and a final 2 (16 samples).
    x, y = ref.regression_data(MICRO * 10)
    expected = _large_batch_of_ten_micro_batches()
    model, optimizer = _fit("apply", x, y)
    assert int(optimizer.iterations.numpy()) == 3
    assert int(optimizer.micro_step.numpy()) == 0
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_each_epochs_last_window_is_applied_by_default_like_its_short_batch():
    # 10 micro-batches an epoch: windows of 4, 4 and 2 in every epoch, as the
    # large batch's 32, 32 and 16 samples; validation sees the applied window.
    x, y = ref.regression_data(MICRO * 10)
    xv, yv = ref.regression_data(40, seed=1)
    expected = ref.mlp()
    expected.compile(_adam(), "mse")
    reference = expected.fit(x, y, batch_size=MICRO * ACCUM, epochs=3, shuffle=False, verbose=0,
                             validation_data=(xv, yv))
    recorder = WindowRecorder()
    model = ref.mlp()
    model.compile(GradientAccumulator(_adam(), ACCUM), "mse")
    history = model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0,
                        validation_data=(xv, yv), callbacks=[recorder])
    assert recorder.micro_steps == [0, 0, 0]
    assert recorder.updates == [3, 6, 9]
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6
    np.testing.assert_allclose(history.history["val_loss"], reference.history["val_loss"], rtol=1e-5)


def test_carry_runs_windows_across_epochs():
    # 3 epochs of 10 micro-batches in windows of 4: 7 full windows and 2
    # micro-batches still open when fit ends; as one pass over the data 3 times.
    x, y = ref.regression_data(MICRO * 10)
    recorder = WindowRecorder()
    model, optimizer = _fit("carry", x, y, epochs=3, callbacks=[recorder])
    assert recorder.micro_steps == [2, 0, 2]
    assert int(optimizer.iterations.numpy()) == 7
    assert optimizer.close_partial_window("apply") == 2
    expected = ref.fit_large_batch(ref.mlp(), _adam(), np.concatenate([x] * 3), np.concatenate([y] * 3),
                                   MICRO * ACCUM)
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_drop_discards_each_epochs_last_window():
    x, y = ref.regression_data(MICRO * 10)
    model, optimizer = _fit("drop", x, y, epochs=3)
    assert int(optimizer.iterations.numpy()) == 6
    expected = ref.fit_large_batch(ref.mlp(), _adam(), x[:MICRO * 8], y[:MICRO * 8], MICRO * ACCUM, epochs=3)
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_an_explicit_epoch_end_overrides_the_optimizer_and_goes_first():
    x, y = ref.regression_data(MICRO * 10)
    recorder = WindowRecorder()
    model, optimizer = _fit("apply", x, y, epochs=3, callbacks=[recorder, EpochWindows("carry")])
    assert recorder.micro_steps == [2, 0, 2]      # carried at epoch ends ...
    assert int(optimizer.iterations.numpy()) == 8  # ... applied when fit ends
    callbacks = with_epoch_windows(model, [recorder, AccumulationSchedule({0: 4})])
    assert [type(c) for c in callbacks] == [AccumulationSchedule, WindowRecorder]


def test_a_callback_list_gets_the_epoch_windows_too():
    x, y = ref.regression_data(MICRO * 10)
    model = ref.mlp()
    model.compile(GradientAccumulator(_adam(), ACCUM), "mse")
    recorder = WindowRecorder()
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
              callbacks=keras.callbacks.CallbackList([recorder], add_history=True, model=model))
    assert recorder.micro_steps == [0, 0]
    assert recorder.updates == [3, 6]


def test_fit_without_an_accumulator_is_left_alone():
    model = ref.mlp()
    model.compile(keras.optimizers.SGD(), "mse")
    callbacks = [WindowRecorder()]
    assert with_epoch_windows(model, callbacks) is callbacks
    model.compile(GradientAccumulator(keras.optimizers.SGD(), 1), "mse")   # a pass-through
    assert with_epoch_windows(model, callbacks) is callbacks


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
    with pytest.raises(ValueError, match="epoch_end"):
        EpochWindows("flush")


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
    assert float(optimizer._state.saved.weight_sum.numpy()) == 2 * MICRO
    assert optimizer.close_partial_window("apply") == 2
    expected = _large_batch_of_ten_micro_batches()
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6
