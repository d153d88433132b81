"""`find_micro_batch`: the largest micro-batch that trains, found with real out-of-memory
errors (`memory_cliff`), the training left as it was, and the split of E exact."""

import logging
import random
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, find_micro_batch
from tfx_gradient_accumulator.accumulator.core import seam
from tfx_gradient_accumulator.accumulator.batch.micro_batch import MicroBatchFit, smallest_taken_whole, split
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
    found = find_micro_batch(model, x, y, effective_batch_size=8)   # probed up to 8 / 0.9: E whole
    assert (found.largest_fitting, found.micro_batch, found.accum_steps) == (9, 8, 1)


@pytest.mark.parametrize("effective_batch_size", [   # 256 apart (52 s): 250 splits unevenly, the harder case
    pytest.param(256, marks=pytest.mark.apart), 250])
def test_training_at_the_found_split_is_keras_large_batch(effective_batch_size):
    x, y = ref.regression_data(512)
    model = _compiled()
    found = find_micro_batch(model, x[:16], y[:16], effective_batch_size=effective_batch_size)
    assert found.largest_fitting == CLIFF - 1 and found.accum_steps == 8
    data = found.micro_batches(tf.data.Dataset.from_tensor_slices((x, y)).batch(effective_batch_size))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data, epochs=2, verbose=0)
    # Its count known (8 + 8 + 1 micro-batches an epoch for 250): `fit` knows its steps, and
    # says nothing of input that ran out (test_the_micro_batches_count_is_known_... shows it would).
    assert not [w for w in caught if "ran out of data" in str(w.message)]

    reference = memory_cliff.mlp(cliff=None)
    reference.compile(keras.optimizers.Adam(1e-2), "mse")
    reference.fit(x, y, batch_size=effective_batch_size, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == 2 * -(-512 // effective_batch_size)   # short last too


def test_the_effective_batch_is_taken_whole_where_it_fits_with_the_margin():
    x, y = ref.regression_data(512)
    # The cliff far above E = 64: the search goes on to 64 / 0.9 = 72, which fits: N = 1, b = E.
    model = _compiled(cliff=100)
    found = find_micro_batch(model, x[:16], y[:16], effective_batch_size=64)
    assert [b for b, _ in found.probes] == [1, 2, 4, 8, 16, 32, 64, 72]
    assert (found.micro_batch, found.accum_steps, found.largest_fitting) == (64, 1, 72)
    assert model.optimizer.accum_steps == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y, batch_size=found.micro_batch, epochs=2, shuffle=False, verbose=0)
    assert not [w for w in caught if "effective batch" in str(w.message)]     # 64 x 1 is E
    reference = memory_cliff.mlp(cliff=None)
    reference.compile(keras.optimizers.Adam(1e-2), "mse")
    reference.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == 16

    # The cliff between E and E / 0.9: E fits, but not with its margin: split, as any b that
    # close to the limit (69 fits: at most 62, N = 2, 32 each).
    model = _compiled(cliff=70)
    found = find_micro_batch(model, x[:16], y[:16], effective_batch_size=64)
    assert found.probes[-4:] == ((72, False), (68, True), (70, False), (69, True))
    assert (found.micro_batch, found.accum_steps, found.largest_fitting) == (32, 2, 69)
    # headroom=0: E whole wherever its step fits (the search stops at E).
    found = find_micro_batch(model, x[:16], y[:16], effective_batch_size=64, headroom=0.0)
    assert (found.micro_batch, found.accum_steps, found.largest_fitting) == (64, 1, 64)
    assert [b for b, _ in found.probes][-1] == 64


def test_split_takes_the_effective_batch_whole_where_it_fits_with_the_margin():
    assert smallest_taken_whole(300) == 334
    assert split(300, 334) == (300, 1) and split(300, 333) == (150, 2)
    assert split(300, 300) == (150, 2)            # E fit, but without its margin
    assert smallest_taken_whole(300, 0.0) == 300 and split(300, 300, 0.0) == (300, 1)
    for e in range(1, 80):
        for headroom in (0.0, 0.1, 0.25, 0.5, 0.9):
            whole = smallest_taken_whole(e, headroom)
            assert split(e, whole, headroom) == split(e, whole, headroom, uniform=True) == (e, 1)
            assert whole == 1 or split(e, whole - 1, headroom)[1] > 1, (e, headroom)


def test_fit_at_a_batch_size_whose_windows_are_not_the_effective_batch_warns_once(caplog):
    """The guide's case: the cliff at 48, E = 300: 38 x 8, so `fit(batch_size=38)` would
    train windows of 304. Told; not for the uniform split (30 x 10), whose b x N is E."""
    x, y = ref.regression_data(80)
    model = _compiled(cliff=48)

    def fit_warnings(data, **kwargs):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.fit(data, epochs=1, verbose=0, shuffle=False, **kwargs)
        return [str(w.message) for w in caught if "effective batch" in str(w.message)]

    # `max_micro_batch=47`, the largest below the cliff: the same split, in 7 probes rather than 12.
    found = find_micro_batch(model, x[:32], y[:32], effective_batch_size=300, uniform=True, max_micro_batch=47)
    assert (found.micro_batch, found.accum_steps) == (30, 10)
    assert fit_warnings(x[:60], y=y[:60], batch_size=30) == []

    found = find_micro_batch(model, x[:32], y[:32], effective_batch_size=300, max_micro_batch=47)
    assert (found.micro_batch, found.accum_steps) == (38, 8) and model.optimizer.found_micro_batch is found
    with caplog.at_level(logging.WARNING):
        said = fit_warnings(x[:76], y=y[:76], batch_size=38)
    assert len(said) == 1 and said[0] in caplog.text
    assert "batch_size=38 trains windows of 38 x 8 = 304 samples, not the effective batch 300" in said[0]
    assert "found.micro_batches(dataset)" in said[0] and "uniform=True" in said[0]
    assert fit_warnings(x[:76], y=y[:76], batch_size=38) == []          # once
    # Keras' 32 without a batch size; a dataset whose batches state their size in their shapes.
    assert "32 x 8 = 256" in " ".join(fit_warnings(x[:64], y=y[:64]))
    samples = tf.data.Dataset.from_tensor_slices((x, y))
    assert "20 x 8 = 160" in " ".join(fit_warnings(samples.batch(20, drop_remainder=True)))
    # Batches of a size their shapes do not state, and the found micro-batches: nothing said.
    assert fit_warnings(samples.batch(24)) == []
    assert fit_warnings(found.micro_batches(samples.batch(300))) == []


def test_the_micro_batches_count_is_known_where_the_batches_can_be_told():
    found = MicroBatchFit(32, 8, 250, 39, ())
    x, y = ref.regression_data(512)
    samples = tf.data.Dataset.from_tensor_slices((x, y))
    # 512 in batches of 250: 8 + 8 micro-batches, and 1 for the last 12 samples.
    for data, count in [(samples.batch(250), 17), (samples.batch(250, drop_remainder=True), 16),
                        (samples.shuffle(64, seed=1).batch(250).prefetch(2).cache(), 17),
                        (samples.padded_batch(250, drop_remainder=False), 17), (samples.take(500).batch(250), 16),
                        (samples.batch(250, drop_remainder=True).map(lambda a, b: (a, b)), 16)]:
        cut = found.micro_batches(data)
        assert int(cut.cardinality()) == count == sum(1 for _ in cut)
    # Not told without reading: a map after a batch that does not state its size, a take or repeat.
    unknown = [samples.batch(250).map(lambda a, b: (a, b)), samples.batch(250).take(2), samples.batch(250).repeat(),
               samples.filter(lambda a, b: True).batch(250)]
    assert [int(found.micro_batches(data).cardinality()) for data in unknown] == [tf.data.UNKNOWN_CARDINALITY] * 4

    # What a count unknown costs: Keras says the input ran out of data after each epoch.
    model = _compiled(cliff=None, accum_steps=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(found.micro_batches(unknown[0]), epochs=2, verbose=0)
    assert len([w for w in caught if "ran out of data" in str(w.message)]) == 2


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
