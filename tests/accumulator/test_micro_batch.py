"""`find_micro_batch`: the largest micro-batch that trains, found with real out-of-memory
errors (`memory_cliff`), the training left as it was, and the split of E exact."""

import random

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, find_micro_batch, seam
from tfx_gradient_accumulator.accumulator.micro_batch import split
from tests import fork_server
from tests.accumulator import memory_cliff
from tests.accumulator import reference as ref

CLIFF = 40


def _compiled(cliff=CLIFF, accum_steps=2, global_noise=False, **kwargs):
    model = memory_cliff.mlp(cliff, global_noise=global_noise)
    model.compile(GradientAccumulator(keras.optimizers.Adam(1e-2), accum_steps, **kwargs), "mse")
    return model


def _values(variables):
    return [np.array(v.numpy()) for v in variables]


def test_the_cliff_is_real_and_the_process_trains_on_after_it():
    model = _compiled(accum_steps=1, schedulable=True)
    x, y = ref.regression_data(64)
    with pytest.raises(tf.errors.ResourceExhaustedError):
        model.train_on_batch(x[:CLIFF], y[:CLIFF])
    model.train_on_batch(x[:CLIFF - 1], y[:CLIFF - 1])


def test_the_probe_finds_the_largest_micro_batch_below_the_cliff(monkeypatch):
    from tensorflow.python.eager import context
    model = _compiled()       # its TensorFlow seed set (`mlp`): putting it back clears the kernel cache
    x, y = ref.regression_data(16)
    clears = []
    clear = context.pywrap_tfe.TFE_ContextClearCaches
    monkeypatch.setattr(context.pywrap_tfe, "TFE_ContextClearCaches", lambda *a: clears.append(1) or clear(*a))
    found = find_micro_batch(model, x, y, effective_batch_size=256)
    # Once, at the end: not after each of the 12 probes (each clear instantiates the step's
    # function again, as costly as its graph's optimization).
    assert len(clears) == 1
    assert found.largest_fitting == CLIFF - 1
    assert found.probes == ((1, True), (2, True), (4, True), (8, True), (16, True), (32, True), (64, False),
                            (48, False), (40, False), (36, True), (38, True), (39, True))
    # 10% headroom: at most 35; N = ceil(256 / 35) = 8, and 256 / 8 = 32 even micro-batches.
    assert (found.micro_batch, found.accum_steps) == (32, 8)
    assert model.optimizer.accum_steps == 8
    assert "micro-batch 32 x 8 steps" in str(found)


def test_the_probe_stops_at_the_effective_batch_and_at_max_micro_batch():
    model = _compiled(cliff=None)
    x, y = ref.regression_data(8)
    found = find_micro_batch(model, x, y, effective_batch_size=12, headroom=0.0)
    assert [b for b, _ in found.probes] == [1, 2, 4, 8, 12]
    assert (found.micro_batch, found.accum_steps, found.largest_fitting) == (12, 1, 12)
    found = find_micro_batch(model, x, y, effective_batch_size=100, max_micro_batch=20, headroom=0.0)
    assert (found.micro_batch, found.accum_steps) == (20, 5)


def _draws():
    return random.random(), np.random.rand(), float(tf.random.uniform([])), float(keras.random.uniform([]))


def test_the_probe_changes_nothing_of_the_training():
    x, y = ref.regression_data(16)
    model = _compiled(global_noise=True)   # each step draws from Keras' global generator
    model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False)   # Adam's slots, the window's state
    weights, slots = _values(model.variables), _values(model.optimizer.variables)
    random_state = seam.random_state()
    found = find_micro_batch(model, x, y, effective_batch_size=256)
    after = _draws()
    assert any(not fitted for _, fitted in found.probes)
    for before_value, now in zip(weights, _values(model.variables)):
        np.testing.assert_array_equal(before_value, now)
    now = _values(model.optimizer.variables)
    assert len(now) == len(slots)
    changed = [b for a, b in zip(slots, now) if not np.array_equal(a, b)]
    assert changed == [found.accum_steps] == [8]   # only the window's length, set to the N found
    seam.restore_random_state(random_state)
    assert after == _draws()      # the draws the training would have made without the probe


def test_the_probe_draws_random_numbers_that_it_puts_back():
    # What the test above relies on: a step of this model moves the global random state.
    x, y = ref.regression_data(16)
    model = _compiled(global_noise=True)
    random_state = seam.random_state()
    model.train_on_batch(x, y)
    moved = _draws()
    seam.restore_random_state(random_state)
    assert moved != _draws()


def test_an_open_window_is_refused():
    x, y = ref.regression_data(16)
    model = _compiled()
    model.train_on_batch(x[:4], y[:4])
    with pytest.raises(ValueError, match="window is open"):
        find_micro_batch(model, x, y, effective_batch_size=64)
    model.optimizer.close_partial_window()
    assert find_micro_batch(model, x, y, effective_batch_size=8).largest_fitting == 8


@pytest.mark.parametrize("effective_batch_size", [   # 256 apart (52 s): 250 splits unevenly, the harder case
    pytest.param(256, marks=pytest.mark.apart), 250])
def test_training_at_the_found_split_is_keras_large_batch(effective_batch_size):
    x, y = ref.regression_data(512)
    model = _compiled()
    found = find_micro_batch(model, x[:16], y[:16], effective_batch_size=effective_batch_size)
    assert found.largest_fitting == CLIFF - 1 and found.accum_steps == 8
    data = found.micro_batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(effective_batch_size))
    model.fit(data, epochs=2, verbose=0)

    reference = memory_cliff.mlp(cliff=None)
    reference.compile(keras.optimizers.Adam(1e-2), "mse")
    reference.fit(x, y, batch_size=effective_batch_size, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == 2 * -(-512 // effective_batch_size)   # short last too


def test_split_keeps_headroom_and_evens_the_micro_batches():
    assert split(1024, 300) == (256, 4)       # 270 safe -> 4 steps -> 256 each
    assert split(1000, 300) == (250, 4)
    assert split(1000, 1, 0.5) == (1, 1000)
    assert split(10, 64) == (10, 1)
    for e in range(1, 60):
        for largest in range(1, 70):
            b, n = split(e, largest)
            assert b <= max(1, int(largest * 0.9)) and -(-e // b) == n and b * (n - 1) < e <= b * n


def test_a_uniform_split_divides_the_effective_batch():
    assert split(1000, 100, uniform=True) == (50, 20)     # not (84, 12): 84 does not divide 1000
    assert split(1024, 300, uniform=True) == (256, 4)
    assert split(97, 50, uniform=True) == (1, 97)          # a prime E: one sample a step
    assert split(1000, 100, uniform=True, replicas=8) == (40, 25)
    with pytest.raises(ValueError, match="effective_batch_size.*8 replicas"):
        split(1001, 100, uniform=True, replicas=8)
    for e in range(1, 60):
        for largest in range(1, 70):
            b, n = split(e, largest, uniform=True)
            assert b * n == e and b <= max(1, int(largest * 0.9))


# Apart (30 s): the Trainer's probe is uniform (tests/components/test_micro_batch_trainer.py's first test:
# 16 x 4 of 64 found below the cliff, trained by batch size as Keras' large batch); the split's rule
# is test_a_uniform_split_divides_the_effective_batch's, the probe's search the tests above.
@pytest.mark.apart
def test_with_a_uniform_split_fit_at_the_micro_batch_is_keras_large_batch():
    x, y = ref.regression_data(500)
    model = _compiled()
    found = find_micro_batch(model, x[:16], y[:16], effective_batch_size=250, uniform=True)
    assert (found.largest_fitting, found.micro_batch, found.accum_steps) == (CLIFF - 1, 25, 10)
    model.fit(x, y, batch_size=found.micro_batch, epochs=2, shuffle=False, verbose=0)

    reference = memory_cliff.mlp(cliff=None)
    reference.compile(keras.optimizers.Adam(1e-2), "mse")
    reference.fit(x, y, batch_size=250, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == 4


def test_not_even_one_sample_fits():
    model = _compiled(cliff=1)
    x, y = ref.regression_data(4)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="not even a micro-batch of 1"):
        find_micro_batch(model, x, y, effective_batch_size=64)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"effective_batch_size": 0}, ValueError, "effective_batch_size"),
    ({"effective_batch_size": 2.5}, TypeError, "effective_batch_size"),
    ({"effective_batch_size": 8, "headroom": 1.0}, ValueError, "headroom"),
    ({"effective_batch_size": 8, "headroom": -0.1}, ValueError, "headroom"),
    ({"effective_batch_size": 8, "max_micro_batch": 0}, ValueError, "max_micro_batch"),
    ({"effective_batch_size": 8, "uniform": "yes"}, (TypeError, ValueError), "uniform"),
])
def test_bad_options_are_refused_before_any_step(kwargs, error, match):
    model = _compiled()
    x, y = ref.regression_data(4)
    with pytest.raises(error, match=match):
        find_micro_batch(model, x, y, **kwargs)
    assert int(model.optimizer.iterations.numpy()) == 0 and not model.optimizer.built


def test_models_and_data_it_cannot_probe_are_refused():
    x, y = ref.regression_data(4)
    plain = memory_cliff.mlp(CLIFF)
    with pytest.raises(ValueError, match="compiled"):
        find_micro_batch(plain, x, y, effective_batch_size=8)
    plain.compile(keras.optimizers.Adam(), "mse")
    with pytest.raises(TypeError, match="GradientAccumulator"):
        find_micro_batch(plain, x, y, effective_batch_size=8)
    passthrough = _compiled(accum_steps=1)
    with pytest.raises(ValueError, match="schedulable=True"):
        find_micro_batch(passthrough, x, y, effective_batch_size=8)
    with pytest.raises(TypeError, match="not a dataset|not .*Dataset"):
        find_micro_batch(_compiled(), tf.data.Dataset.from_tensor_slices((x, y)).batch(2), effective_batch_size=8)
    with pytest.raises(ValueError, match="same number of rows"):
        find_micro_batch(_compiled(), x, y[:2], effective_batch_size=8)


_UNDER_MIRRORED = """
import os
os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
import numpy as np
from tfx_gradient_accumulator.accumulator import GradientAccumulator, find_micro_batch
from tests.accumulator import memory_cliff, reference as ref
x, y = ref.regression_data(512)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = memory_cliff.mlp(10)     # 10 samples a replica: 10 probes (40: 15), each a step on both
    model.compile(GradientAccumulator(keras.optimizers.Adam(1e-2), schedulable=True), "mse")
model.fit(x[:64], y[:64], batch_size=16, verbose=0, shuffle=False)      # every replica's window state filled
before = [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]
found = find_micro_batch(model, x[:16], y[:16], effective_batch_size=64)
after = [np.array(v.numpy()) for v in model.variables + model.optimizer.variables]
changed = [b for a, b in zip(before, after) if not np.array_equal(a, b)]
print("FOUND", found.largest_fitting, found.micro_batch, found.accum_steps, "CHANGED", changed)
model.fit(found.micro_batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(64)), epochs=1, verbose=0)
reference = memory_cliff.mlp(None)
reference.compile(keras.optimizers.Adam(1e-2), "mse")
# One fit (one trace): the 4 batches of 16 the model was fit on, then the 8 batches of 64.
before_probe = tf.data.Dataset.from_tensor_slices((x[:64], y[:64])).batch(16)
reference.fit(before_probe.concatenate(tf.data.Dataset.from_tensor_slices((x, y)).batch(64)), verbose=0)
print("DELTA", ref.max_abs_diff(model.get_weights(), reference.get_weights()))
"""


def test_under_a_mirrored_strategy_the_cliff_is_per_replica_and_each_replica_is_put_back():
    """2 replicas on CPU: a global micro-batch of b gives each b / 2, so the largest that fits
    is 18 (9 each; 64 = 4 x 16); every replica's window state is put back; training at the
    split found then matches a single device's Keras large batch. In its own process: TensorFlow gives
    every MirroredStrategy the same collective keys, which would clash with other tests'."""
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = fork_server.run([sys.executable, "-c", _UNDER_MIRRORED], capture_output=True, timeout=600, cwd=root,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-3000:]
    found = out.stdout.split("FOUND ")[1].split()
    assert found[:3] == ["18", "16", "4"], out.stdout[-2000:]
    assert "CHANGED [array(4)]" in out.stdout or "CHANGED [4]" in out.stdout, out.stdout[-2000:]
    assert float(out.stdout.split("DELTA ")[1].split()[0]) <= 1e-5, out.stdout[-2000:]
