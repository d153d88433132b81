"""Accumulation that changes during training, exact at each change."""

import functools

import keras
import pytest

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.schedules.callbacks import AccumulationSchedule, EpochWindows, accum_steps_at, validate_schedule
from tfx_gradient_accumulator.accumulator.schedules.lr_scaling import ScaledSchedule
from tests.accumulator import reference as ref

MICRO = 8


def _adam():
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 3, 0.7), clipnorm=0.4)


@pytest.mark.parametrize("schedule", [{0: 2, 1: 4}, {0: 4, 1: 1}, {0: 1, 1: 4}])
def test_schedule_equals_changing_the_large_batch_at_each_epoch(schedule):
    x, y = ref.regression_data(MICRO * 10)      # 10 micro-batches an epoch
    expected = ref.mlp()
    expected.compile(_adam(), "mse")
    for epoch in range(2):
        expected.fit(x, y, batch_size=MICRO * accum_steps_at(schedule, epoch), shuffle=False, verbose=0)

    model = ref.mlp()
    optimizer = GradientAccumulator(_adam(), schedule[0], schedulable=True)
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
              callbacks=[AccumulationSchedule(schedule)])
    assert optimizer.accum_steps == schedule[1]
    assert int(optimizer.iterations.numpy()) == int(expected.optimizer.iterations.numpy())
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_epoch_end_apply_closes_every_epochs_window():
    x, y = ref.regression_data(MICRO * 10)
    expected = ref.mlp()
    expected.compile(_adam(), "mse")
    for _ in range(2):
        expected.fit(x, y, batch_size=MICRO * 4, shuffle=False, verbose=0)   # 32, 32, 16 per epoch
    model = ref.mlp()
    model.compile(GradientAccumulator(_adam(), 4), "mse")
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0,
              callbacks=[EpochWindows("apply")])
    assert int(model.optimizer.iterations.numpy()) == 6
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


@pytest.mark.parametrize("bad", [{}, [1, 2], {"a": 2}, {-1: 2}, {0: 0}, {0: 2.5}])
def test_bad_schedules_are_refused(bad):
    with pytest.raises((ValueError, TypeError), match="schedule"):
        validate_schedule(bad)


def test_changing_mid_window_or_on_a_pass_through_is_refused():
    optimizer = GradientAccumulator(keras.optimizers.SGD(), 1)
    with pytest.raises(ValueError, match="schedulable"):
        optimizer.set_accum_steps(2)
    x, y = ref.regression_data(MICRO * 3)
    model = ref.mlp()
    optimizer = GradientAccumulator(keras.optimizers.SGD(), 2, partial_window="carry")
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=MICRO, verbose=0)
    with pytest.raises(ValueError, match="between windows"):
        optimizer.set_accum_steps(4)


# ------------------------------------------------------------- by update, with the LR rule
def _chained_keras_fits(x, y, pieces, optimizer, lr_of=None):
    """Keras' own fits of consecutive slices at the given batch sizes: [(updates, batch)]."""
    model = ref.mlp()
    model.compile(optimizer, "mse")
    start = 0
    for updates, batch in pieces:
        if lr_of is not None:
            model.optimizer.learning_rate = lr_of(batch)
        end = start + updates * batch
        model.fit(x[start:end], y[start:end], batch_size=batch, shuffle=False, verbose=0)
        start = end
    return model


# sqrt's apart (6 s): test_lr_scaling_multiplies_a_learning_rate_schedule checks it against Keras' fits.
@pytest.mark.parametrize("lr_scaling", ["none", "linear", pytest.param("sqrt", marks=pytest.mark.apart)])
def test_schedule_by_update_equals_keras_fits_chained_at_each_batch(lr_scaling):
    # 3 updates of 2 micro-batches, then 2 of 4 (one epoch of 14 micro-batches).
    x, y = ref.regression_data(MICRO * 14)
    scale = {"none": lambda r: 1.0, "linear": lambda r: r, "sqrt": lambda r: r ** 0.5}[lr_scaling]
    pieces = [(3, MICRO * 2), (2, MICRO * 4)]
    expected = _chained_keras_fits(x, y, pieces, keras.optimizers.Adam(1e-2),
                                   lr_of=lambda batch: 1e-2 * scale(batch / (MICRO * 2)))
    model = ref.mlp()
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), 2, schedulable=True)
    model.compile(optimizer, "mse")
    history = model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0, callbacks=[
        AccumulationSchedule({0: 2, 3: 4}, by="update", lr_scaling=lr_scaling)])
    assert int(optimizer.iterations.numpy()) == 5
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6
    assert history.history["accum_steps"] == [4]
    assert history.history["lr_multiplier"] == [pytest.approx(scale(2.0))]
    assert float(optimizer.inner_optimizer.learning_rate) == pytest.approx(1e-2 * scale(2.0))
    # Control: the effective batch kept at 2 micro-batches is not that run.
    assert ref.max_abs_diff(_kept_at_two_micro_batches(), expected.get_weights()) > 1e-3


@functools.lru_cache(maxsize=None)
def _kept_at_two_micro_batches():
    """The control's weights, the same for the three cases above: Adam(1e-2) in windows of 2, 14 micro-batches."""
    x, y = ref.regression_data(MICRO * 14)
    control = ref.mlp()
    control.compile(GradientAccumulator(keras.optimizers.Adam(1e-2), 2), "mse")
    control.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    return control.get_weights()


def test_lr_scaling_multiplies_a_learning_rate_schedule():
    decay = keras.optimizers.schedules.ExponentialDecay(1e-2, 3, 0.7)
    x, y = ref.regression_data(MICRO * 14)
    # Keras' own fits, chained, with the schedule's multiplier set by hand between them.
    scaled = ScaledSchedule(decay)
    expected = _chained_keras_fits(x, y, [(3, MICRO * 2)], keras.optimizers.Adam(scaled))
    scaled.multiplier.assign(2.0 ** 0.5)
    expected.fit(x[MICRO * 6:], y[MICRO * 6:], batch_size=MICRO * 4, shuffle=False, verbose=0)
    model = ref.mlp()
    optimizer = GradientAccumulator(keras.optimizers.Adam(decay), 2, schedulable=True)
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0, callbacks=[
        AccumulationSchedule({0: 2, 3: 4}, by="update", lr_scaling="sqrt")])
    step = int(optimizer.iterations.numpy())
    assert step == 5
    assert float(optimizer.inner_optimizer.learning_rate) == pytest.approx(float(decay(step)) * 2.0 ** 0.5)
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6
    # Control: the same schedule unscaled is another run.
    unscaled = _chained_keras_fits(x, y, [(3, MICRO * 2), (2, MICRO * 4)], keras.optimizers.Adam(decay))
    assert ref.max_abs_diff(unscaled.get_weights(), expected.get_weights()) > 1e-4


@pytest.mark.parametrize("decay", [False, True], ids=["constant", "schedule"])
def test_a_second_fit_with_a_new_schedule_callback_does_not_scale_twice(decay):
    lr = keras.optimizers.schedules.ExponentialDecay(1e-2, 3, 0.7) if decay else 1e-2
    x, y = ref.regression_data(MICRO * 14)
    model = ref.mlp()
    optimizer = GradientAccumulator(keras.optimizers.Adam(lr), 2, schedulable=True)
    model.compile(optimizer, "mse")
    for _ in range(2):          # as a resumed run does: the optimizer is at 4 already
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0, callbacks=[
            AccumulationSchedule({0: 2, 3: 4}, by="update", lr_scaling="linear")])
        step = int(optimizer.iterations.numpy())
        unscaled = float(lr(step)) if decay else lr
        assert float(optimizer.inner_optimizer.learning_rate) == pytest.approx(2 * unscaled)


def test_bad_schedule_arguments_are_refused():
    with pytest.raises(ValueError, match="lr_scaling"):
        AccumulationSchedule({0: 2}, lr_scaling="cubic")
    with pytest.raises(ValueError, match="`by`"):
        AccumulationSchedule({0: 2}, by="sample")
