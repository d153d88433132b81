"""Accumulation that changes during training, exact at each change."""

import keras
import pytest

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.callbacks import AccumulationSchedule, EpochWindows, accum_steps_at, validate_schedule
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
