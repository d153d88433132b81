"""AutoAccumulation: growth decided from B_simple, recorded, replayed exactly, resumed."""

import keras
import pytest

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.schedules.auto_batch import AutoAccumulation
from tfx_gradient_accumulator.accumulator.schedules.callbacks import AccumulationSchedule
from tests.accumulator import reference as ref

MICRO = 4


def _model(start=1):
    model = ref.mlp()
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.05), start, schedulable=True,
                                    measure_noise_scale=True)
    model.compile(optimizer, "mse")
    return model, optimizer


# Easy to clear on these small tasks: the growth's mechanics, not the rule's statistics
# (those: test_batch_target.py).
EASY = dict(max_sample_overhead=1.0, confidence=0.6, min_windows=2, lr_ramp_updates=0)


def _auto(**kwargs):
    return AutoAccumulation(MICRO, 64, start_accum_steps=2, lr_scaling="linear", **{**EASY, **kwargs})


def test_auto_grows_and_its_recorded_schedule_replays_exactly():
    x, y = ref.regression_data(MICRO * 96)
    model, optimizer = _model(2)
    auto = _auto()
    history = model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0, callbacks=[auto])
    assert len(auto.schedule) >= 2, auto.schedule                 # it grew at least once
    assert sorted(auto.schedule.values()) == list(auto.schedule.values())   # never shrank
    assert max(auto.schedule.values()) * MICRO <= 64
    assert history.history["effective_batch_size"][-1] == optimizer.accum_steps * MICRO
    assert history.history["lr_multiplier"][-1] == pytest.approx(optimizer.accum_steps / 2)

    replay, replay_optimizer = _model(2)
    replay.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0, callbacks=[
        AccumulationSchedule(auto.schedule, by="update", lr_scaling="linear")])
    assert int(replay_optimizer.iterations.numpy()) == int(optimizer.iterations.numpy())
    assert ref.max_abs_diff(replay.get_weights(), model.get_weights()) <= 1e-6
    # Control: the starting batch kept throughout is another run.
    fixed, _ = _model(2)
    fixed.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(fixed.get_weights(), model.get_weights()) > 1e-3


def test_the_decisions_survive_a_restart():
    import json
    x, y = ref.regression_data(MICRO * 96)
    model, _ = _model(2)
    auto = _auto()
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0, callbacks=[auto])
    resumed = _auto()
    resumed.restore_state(json.loads(json.dumps(auto.state())))
    assert len(auto.schedule) >= 2 and resumed.schedule == auto.schedule and resumed.state() == auto.state()


@pytest.mark.parametrize("bad, error, match", [
    ({"max_sample_overhead": 0}, ValueError, "max_sample_overhead"),
    ({"max_sample_overhead": 1.5}, ValueError, "max_sample_overhead"),
    ({"confidence": 0.5}, ValueError, "confidence"), ({"confidence": 1}, ValueError, "confidence"),
    ({"min_windows": 1}, ValueError, "min_windows"), ({"geometry": "adam"}, ValueError, "geometry"),
    ({"lr_ramp_updates": -1}, ValueError, "lr_ramp_updates"),
    ({"margin": 2}, TypeError, "max_sample_overhead, confidence"),
    ({"patience": 3, "growth": 2}, TypeError, "no longer grows by a margin"),
])
def test_bad_arguments_are_refused(bad, error, match):
    with pytest.raises(error, match=match):
        AutoAccumulation(MICRO, 64, **bad)


def test_a_smoothing_too_short_for_the_gate_is_refused():
    x, y = ref.regression_data(MICRO * 8)
    model = ref.mlp()
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.05), 2, schedulable=True, measure_noise_scale=True,
                                      noise_scale_smoothing=0.5), "mse")
    with pytest.raises(ValueError, match="noise_scale_smoothing >= 0.9"):
        model.fit(x, y, batch_size=MICRO, verbose=0, callbacks=[AutoAccumulation(MICRO, 64, 2)])


def test_under_two_mirrored_replicas_auto_grows_and_replays_exactly():
    # accum_steps and the LR change between windows under tf.distribute (no retracing).
    import tensorflow as tf
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    x, y = ref.regression_data(MICRO * 96)
    runs = []
    for make_callback in (_auto, lambda: AccumulationSchedule(runs[0][1].schedule, by="update",
                                                              lr_scaling="linear")):
        with strategy.scope():
            model, optimizer = _model(2)
        callback = make_callback()
        model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0, callbacks=[callback])
        runs.append((model, callback, optimizer))
    assert len(runs[0][1].schedule) >= 2, runs[0][1].schedule
    assert runs[1][2].accum_steps == runs[0][2].accum_steps
    assert ref.max_abs_diff(runs[1][0].get_weights(), runs[0][0].get_weights()) <= 1e-6


def test_an_interrupted_auto_run_resumes_with_its_decisions(tmp_path):
    from tfx_gradient_accumulator.accumulator import hooks
    from tfx_gradient_accumulator.accumulator.batch.backup import TrainingBackup

    class Interrupted(Exception):
        pass

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 61:
                raise Interrupted()

    import tensorflow as tf
    x, y = ref.regression_data(MICRO * 96)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    expected, _ = _model(2)
    uninterrupted = _auto()
    expected.fit(data, verbose=0, callbacks=[uninterrupted])
    directory = str(tmp_path / "backup")
    with hooks.fits_backed_up(TrainingBackup(directory, every_steps=7)):
        with pytest.raises(Interrupted):
            model, _ = _model(2)
            model.fit(data, verbose=0, callbacks=[_auto(), StopAt()])
    backup = TrainingBackup(directory, every_steps=7)
    assert len(backup.latest()["callback_states"][0]["schedule"]) >= 2      # decided before the backup
    resumed_auto = _auto()
    with hooks.fits_backed_up(backup):
        resumed, _ = _model(2)
        resumed.fit(data, verbose=0, callbacks=[resumed_auto])
    assert resumed_auto.schedule == uninterrupted.schedule
    assert ref.max_abs_diff(resumed.get_weights(), expected.get_weights()) <= 1e-6


def test_accumulating_compile_auto_grows_unchanged_training_code_and_resumes_with_its_decisions(tmp_path):
    """What the Trainer's accum_steps="auto" runs: a plain compile and fit, wrapped by
    `accumulating_compile(2, auto=...)`; interrupted and resumed from a backup, the run
    keeps the decisions taken before the backup and ends as the uninterrupted one."""
    import tensorflow as tf

    from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile
    from tfx_gradient_accumulator.accumulator.batch.backup import TrainingBackup

    class Interrupted(Exception):
        pass

    class StopAt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 61:
                raise Interrupted()

    x, y = ref.regression_data(MICRO * 96)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    auto = {"micro_batch_size": MICRO, "max_effective_batch_size": 64, **EASY}

    def train(backup=None, callbacks=()):      # training code that knows nothing of accumulation
        model = ref.mlp()
        model.compile(keras.optimizers.SGD(0.05), "mse")
        model.fit(data, verbose=0, callbacks=list(callbacks))
        return model

    with accumulating_compile(2, auto=auto, lr_scaling="linear"):
        expected = train()
    taken = expected.optimizer.auto_accumulation.schedule
    assert len(taken) >= 2 and expected.optimizer.measure_noise_scale
    directory = str(tmp_path / "backup")
    with pytest.raises(Interrupted):
        with accumulating_compile(2, auto=auto, lr_scaling="linear", backup=TrainingBackup(directory, 7)):
            train(callbacks=[StopAt()])
    assert len(TrainingBackup(directory, 7).latest()["callback_states"][0]["schedule"]) >= 2
    with accumulating_compile(2, auto=auto, lr_scaling="linear", backup=TrainingBackup(directory, 7)):
        resumed = train()
    assert resumed.optimizer.auto_accumulation.schedule == taken
    assert ref.max_abs_diff(resumed.get_weights(), expected.get_weights()) <= 1e-6
    with pytest.raises(ValueError, match="`auto` and `schedule` exclude each other"):
        with accumulating_compile(2, schedule={0: 2}, auto=auto):
            pass


def test_accumulating_compile_ramps_the_learning_rate_of_a_schedule_by_update():
    """What the Trainer hands over for a schedule with `lr_ramp_updates`: the multiplier moves
    in equal steps over the ramp's updates after the change; refused where nothing ramps."""
    import tensorflow as tf

    from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile

    x, y = ref.regression_data(MICRO * 40)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    seen = []

    class Multipliers(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append((int(self.model.optimizer.iterations.numpy()), float(logs["lr_multiplier"])))

    with accumulating_compile(2, schedule={0: 2, 3: 4}, schedule_by="update", lr_scaling="linear",
                              lr_ramp_updates=4):
        model = ref.mlp()
        model.compile(keras.optimizers.SGD(0.05), "mse")
        model.fit(data, verbose=0, callbacks=[Multipliers()])
    by_update = dict(seen)
    assert [by_update[u] for u in (3, 4, 5, 6, 7, 8)] == pytest.approx([1.0, 1.25, 1.5, 1.75, 2.0, 2.0])
    with pytest.raises(ValueError, match="without one nothing changes"):
        with accumulating_compile(2, lr_ramp_updates=4):
            pass
    with pytest.raises(ValueError, match="lr_ramp_updates"):
        with accumulating_compile(2, schedule={0: 2, 1: 4}, lr_ramp_updates=4):     # by epoch
            pass


# ------------------------------------------------- GradientAccumulator(accum_steps="auto")
def _noisy(samples):
    """Random labels of 10 classes: the noise scale (~800 samples) is far above small batches."""
    import numpy as np
    rng = np.random.RandomState(0)
    return rng.randn(samples, 8).astype("float32"), rng.randint(0, 10, size=(samples,))


def _classifier():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(10)])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _auto_model(**kwargs):
    model = _classifier()
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.02), accum_steps="auto", **kwargs)
    model.compile(optimizer, LOSS)
    return model, optimizer


def test_accum_steps_auto_grows_in_plain_fit_and_its_schedule_replays_exactly():
    """`GradientAccumulator(opt, accum_steps="auto", max_effective_batch_size=M)` and a plain
    `fit(batch_size=...)`: the window starts at 2, grows (the defaults) up to M, never
    shrinks; the decisions, replayed as a schedule by update with the same learning-rate
    ramp, give the same weights."""
    x, y = _noisy(MICRO * 128)
    model, optimizer = _auto_model(max_effective_batch_size=32, lr_scaling="sqrt")
    assert optimizer.accum_steps == 2 and optimizer.measure_noise_scale and optimizer.schedulable
    history = model.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    auto = optimizer.auto_accumulation
    assert auto is not None and auto.micro_batch_size == MICRO       # read from fit's batch_size
    assert len(auto.schedule) >= 2, auto.schedule                    # it grew
    assert sorted(auto.schedule.values()) == list(auto.schedule.values())
    assert max(auto.schedule.values()) * MICRO <= 32
    assert history.history["effective_batch_size"][-1] == optimizer.accum_steps * MICRO
    assert 1.0 < history.history["lr_multiplier"][-1] <= (optimizer.accum_steps / 2) ** 0.5 + 1e-9
    assert history.history["noise_scale_lower"][-1] <= history.history["noise_scale"][-1]

    replay = _classifier()
    replay_optimizer = GradientAccumulator(keras.optimizers.SGD(0.02), 2, schedulable=True)
    replay.compile(replay_optimizer, LOSS)
    replay.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0,
               callbacks=[AccumulationSchedule(auto.schedule, by="update", lr_scaling="sqrt", lr_ramp_updates=50)])
    print("auto vs its replay:", ref.max_abs_diff(replay.get_weights(), model.get_weights()), auto.schedule)
    assert int(replay_optimizer.iterations.numpy()) == int(optimizer.iterations.numpy())
    assert ref.max_abs_diff(replay.get_weights(), model.get_weights()) <= 1e-6
    # Control: 2 micro-batches throughout is another run.
    fixed = _classifier()
    fixed.compile(GradientAccumulator(keras.optimizers.SGD(0.02), 2), LOSS)
    fixed.fit(x, y, batch_size=MICRO, epochs=3, shuffle=False, verbose=0)
    assert ref.max_abs_diff(fixed.get_weights(), model.get_weights()) > 1e-3

    # A second fit carries on with the same rule and its decisions.
    grown = dict(auto.schedule)
    model.fit(x, y, batch_size=MICRO, epochs=1, shuffle=False, verbose=0)
    assert optimizer.auto_accumulation is auto and all(auto.schedule[k] == v for k, v in grown.items())


def test_accum_steps_auto_reads_the_micro_batch_from_a_dataset_and_takes_the_users_rule():
    import tensorflow as tf
    x, y = _noisy(MICRO * 40)
    model, optimizer = _auto_model(max_effective_batch_size=64)
    model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO), verbose=0)   # batch dim unknown
    assert optimizer.auto_accumulation.micro_batch_size == MICRO
    # A rule passed to fit (its own settings) is the optimizer's from then on.
    model, optimizer = _auto_model(max_effective_batch_size=64)
    mine = _auto()
    model.fit(x, y, batch_size=MICRO, verbose=0, callbacks=[mine])
    assert optimizer.auto_accumulation is mine


def test_accum_steps_auto_saves_and_loads(tmp_path):
    x, y = _noisy(MICRO * 16)
    model, optimizer = _auto_model(max_effective_batch_size=64, lr_scaling="linear")
    config = optimizer.get_config()
    assert (config["accum_steps"], config["max_effective_batch_size"], config["lr_scaling"]) == ("auto", 64, "linear")
    model.fit(x, y, batch_size=MICRO, verbose=0)
    model.save(tmp_path / "m.keras")
    loaded = keras.models.load_model(tmp_path / "m.keras")
    assert loaded.optimizer.auto == {"max_effective_batch_size": 64, "lr_scaling": "linear"}
    assert ref.max_abs_diff(loaded.get_weights(), model.get_weights()) == 0.0


@pytest.mark.parametrize("kwargs, error, match", [
    ({"accum_steps": "auto"}, ValueError, "needs `max_effective_batch_size`"),
    ({"accum_steps": "Auto", "max_effective_batch_size": 64}, TypeError, "integer >= 1 or 'auto'"),
    ({"accum_steps": "auto", "max_effective_batch_size": 1}, ValueError, "max_effective_batch_size"),
    ({"accum_steps": "auto", "max_effective_batch_size": 64, "lr_scaling": "cubic"}, ValueError, "lr_scaling"),
    ({"accum_steps": 4, "max_effective_batch_size": 64}, ValueError, "go with accum_steps='auto'"),
    ({"accum_steps": 4, "lr_scaling": "sqrt"}, ValueError, "go with accum_steps='auto'"),
])
def test_accum_steps_auto_bad_settings_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        GradientAccumulator(keras.optimizers.SGD(0.02), **kwargs)


def test_accum_steps_auto_without_a_readable_micro_batch_says_what_to_pass():
    x, y = _noisy(MICRO * 8)

    def batches():
        while True:
            yield x[:MICRO], y[:MICRO]

    model, _ = _auto_model(max_effective_batch_size=64)
    with pytest.raises(ValueError, match="AutoAccumulation\\(micro_batch_size="):
        model.fit(batches(), steps_per_epoch=4, verbose=0)
