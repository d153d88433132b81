"""`fit_with_out_of_memory_recovery`: real out-of-memory errors in the middle of training
(`memory_cliff.SequenceCliff`: sequences that grow), the micro-batch halved, and the final
weights those of Keras' large batch on the same model without the cliff."""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import (GradientAccumulator, MicroBatchFit, find_micro_batch,
                                                  fit_with_out_of_memory_recovery)
from tests.accumulator import memory_cliff
from tests.accumulator import reference as ref

E = 32
FEATURES = 3
BUDGET = 160      # a step runs out of memory from micro-batch x longest sequence = 160 on


def _rows(longest_per_batch, ascending=True, seed=1):
    """Sequences and targets, E per batch; in batch i, row j has length longest * (j + 1) / E
    (ascending: the longest last) or `longest` (all the same)."""
    rng = np.random.default_rng(seed)
    rows = []
    for longest in longest_per_batch:
        for j in range(E):
            length = max(1, -(-longest * (j + 1) // E)) if ascending else longest
            x = rng.normal(size=(length, FEATURES)).astype("float32")
            rows.append((x, np.array([np.tanh(x.sum() / length)], "float32")))
    return rows


def _dataset(rows):
    """Batches of E, each padded to its own longest sequence; of known size (Keras' own `fit`
    on a dataset of unknown size counts one more Adam iteration at each epoch's end)."""
    data = tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=(
        tf.TensorSpec((None, FEATURES), tf.float32), tf.TensorSpec((1,), tf.float32)))
    return data.padded_batch(E).apply(tf.data.experimental.assert_cardinality(-(-len(rows) // E)))


def _first_batch(rows):
    return next(iter(_dataset(rows)))


def _compiled(budget=BUDGET, inner=None):
    model = memory_cliff.sequence_model(budget, FEATURES)
    model.compile(GradientAccumulator(inner or keras.optimizers.Adam(1e-2), schedulable=True), "mse")
    return model


def _keras_large_batch(rows, epochs):
    model = memory_cliff.sequence_model(None, FEATURES)
    model.compile(keras.optimizers.Adam(1e-2), "mse")
    model.fit(_dataset(rows), epochs=epochs, verbose=0)
    return model


GROWING = [4, 4, 8, 8, 16, 16, 24, 24]   # the longest sequence of each batch of E


def _as_probed(model):
    """What `find_micro_batch` finds and sets on the early data (a first batch whose longest
    sequence is 4: 32 x 4 fits, 16 x 2 with the headroom), without its steps: the tests that
    probe (`test_sequences_that_grow_...`, `test_two_switches_...`, the backward pass's) check
    it; here the recovery is what is tested."""
    model.optimizer.set_accum_steps(2)
    return MicroBatchFit(micro_batch=16, accum_steps=2, effective_batch_size=E, largest_fitting=E, probes=())


# Apart (31 s): the first micro-step with nothing held: test_two_switches_in_one_window_feed_it_once's
# first switch (dropped 0), then exact against Keras' large batch.
@pytest.mark.parametrize("ascending", [True, pytest.param(False, marks=pytest.mark.apart)],
                         ids=["at-the-closing-micro-step", "at-the-first-micro-step"])
def test_sequences_that_grow_halve_the_micro_batch_and_land_on_keras_large_batch(ascending, caplog):
    rows = _rows(GROWING, ascending)
    model = _compiled()
    x, y = _first_batch(rows)
    # `max_micro_batch=E`: the search stops at E (36 x 4 fits too, which would take E whole).
    found = find_micro_batch(model, x.numpy()[:16], y.numpy()[:16], effective_batch_size=E, max_micro_batch=E)
    # The early data (4 steps): 32 x 4 = 128 fits; 10% headroom: 16 x 2.
    assert (found.largest_fitting, found.micro_batch, found.accum_steps) == (32, 16, 2)
    with caplog.at_level(logging.WARNING, logger="tfx_gradient_accumulator"):
        run = fit_with_out_of_memory_recovery(model, _dataset(rows), found, epochs=2, verbose=0)
    # 16 x 16 steps = 256 in batch 4 (update 4); 8 x 24 = 192 in batch 6 (update 6); 4 x 24 fits.
    assert [(s.update, s.micro_batch, s.accum_steps) for s in run.switches] == [(4, 8, 4), (6, 4, 8)]
    assert [(s.previous_micro_batch, s.previous_accum_steps, s.epoch) for s in run.switches] == [(16, 2, 0), (8, 4, 0)]
    # Ascending lengths: the closing micro-step runs out, after the window's first N - 1 (1, then 3).
    # The same lengths: the window's first micro-step runs out, with nothing held.
    assert [s.dropped for s in run.switches] == ([1, 3] if ascending else [0, 0])
    assert (run.micro_batch, run.accum_steps, model.optimizer.accum_steps) == (4, 8, 8)
    assert run.switches[0].as_record() == {"update": 4, "micro_batch": 8, "accum_steps": 4}
    assert sum("out of memory in epoch 0 at update 4 with micro-batch 16 x 2" in r.message
               for r in caplog.records) == 1

    reference = _keras_large_batch(rows, epochs=2)
    delta = ref.max_abs_diff(model.get_weights(), reference.get_weights())
    print(f"max |dw| against Keras' batch of {E} after 2 epochs, {run.switches}: {delta:.3g}")
    assert delta <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == 2 * len(GROWING)
    assert run.history.epoch == [0, 1] and len(run.history.history["loss"]) == 2
    np.testing.assert_allclose(run.history.history["loss"][1], reference.history.history["loss"][1], rtol=1e-4)


def test_two_switches_in_one_window_feed_it_once():
    rows = _rows([4, 4, 24, 24])           # 16 x 24 and 8 x 24 run out in batch 2; 4 x 24 fits
    model = _compiled()
    x, y = _first_batch(rows)
    found = find_micro_batch(model, x.numpy()[:16], y.numpy()[:16], effective_batch_size=E, max_micro_batch=E)
    run = fit_with_out_of_memory_recovery(model, _dataset(rows), found, epochs=2, verbose=0)
    assert [(s.update, s.micro_batch, s.accum_steps, s.dropped) for s in run.switches] == [(2, 8, 4, 0), (2, 4, 8, 3)]
    delta = ref.max_abs_diff(model.get_weights(), _keras_large_batch(rows, epochs=2).get_weights())
    print(f"max |dw| (two switches in one window): {delta:.3g}")
    assert delta <= 1e-5 and int(model.optimizer.iterations.numpy()) == 8


def test_an_error_in_the_backward_pass_of_the_closing_micro_step_leaves_the_weights():
    """The output layer's gradient is made, and added to its sum, before the backward pass
    runs out: the window's update waits for every gradient, so nothing is written."""
    rows = _rows(GROWING)
    model = memory_cliff.backward_sequence_model(BUDGET, FEATURES)
    model.compile(GradientAccumulator(keras.optimizers.Adam(1e-2), schedulable=True), "mse")
    x, y = _first_batch(rows)
    found = find_micro_batch(model, x.numpy()[:16], y.numpy()[:16], effective_batch_size=E, max_micro_batch=E)
    assert (found.micro_batch, found.accum_steps) == (16, 2)
    run = fit_with_out_of_memory_recovery(model, _dataset(rows), found, epochs=2, verbose=0)
    # The window counted the failed micro-step too (its count waits on the forward pass):
    # full, and yet not closed.
    assert [(s.update, s.micro_batch, s.accum_steps, s.dropped) for s in run.switches] == [(4, 8, 4, 2), (6, 4, 8, 4)]
    reference = memory_cliff.backward_sequence_model(None, FEATURES)
    reference.compile(keras.optimizers.Adam(1e-2), "mse")
    reference.fit(_dataset(rows), epochs=2, verbose=0)
    delta = ref.max_abs_diff(model.get_weights(), reference.get_weights())
    print(f"max |dw| (an error in the backward pass): {delta:.3g}")
    assert delta <= 1e-5


class _Seen(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.calls = []

    def on_train_begin(self, logs=None):
        self.calls.append("train_begin")

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(f"epoch_begin {epoch}")

    def on_epoch_end(self, epoch, logs=None):
        self.calls.append(f"epoch_end {epoch}")


def test_without_an_error_it_is_fit_at_the_found_micro_batch(tmp_path):
    rows = _rows([4, 4, 8])
    model = _compiled()
    found = _as_probed(model)
    seen = _Seen()
    run = fit_with_out_of_memory_recovery(model, _dataset(rows), found, epochs=3, initial_epoch=1, verbose=0,
                                          callbacks=[seen], validation_data=_dataset(_rows([4])))
    assert run.switches == () and (run.micro_batch, run.accum_steps) == (16, 2)
    assert run.history.epoch == [1, 2] and len(run.history.history["val_loss"]) == 2
    assert seen.calls == ["train_begin", "epoch_begin 1", "epoch_end 1", "epoch_begin 2", "epoch_end 2"]
    reference = _keras_large_batch(rows, epochs=2)
    assert ref.max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-5
    # The counter the run added is not part of what is saved.
    model.save(tmp_path / "model.keras")
    loaded = keras.models.load_model(tmp_path / "model.keras", custom_objects={
        "SequenceCliff": memory_cliff.SequenceCliff})
    assert len(loaded.optimizer.variables) == len(model.optimizer.variables)


def test_an_error_in_validation_is_raised_as_it_is():
    rows = _rows([4, 4])
    model = _compiled()
    found = _as_probed(model)
    with pytest.raises(tf.errors.ResourceExhaustedError) as raised:
        fit_with_out_of_memory_recovery(model, _dataset(rows), found, verbose=0,
                                        validation_data=_dataset(_rows([8])))   # 32 x 8 in one batch
    assert "micro-batch of 1" not in str(raised.value)     # not taken for a training step
    assert int(model.optimizer.iterations.numpy()) == 2 and model.optimizer.accum_steps == found.accum_steps


def test_callbacks_see_a_new_fit_after_a_switch():
    rows = _rows([4, 16, 4])
    model = _compiled()
    found = _as_probed(model)
    seen = _Seen()
    run = fit_with_out_of_memory_recovery(model, _dataset(rows), found, epochs=2, verbose=0, callbacks=[seen])
    assert [(s.update, s.micro_batch, s.accum_steps, s.epoch) for s in run.switches] == [(1, 8, 4, 0)]
    # The epoch it happened in begins again (to its end only), then a new fit for the rest.
    assert seen.calls == ["train_begin", "epoch_begin 0", "train_begin", "epoch_begin 0", "epoch_end 0",
                          "train_begin", "epoch_begin 1", "epoch_end 1"]
    assert run.history.epoch == [0, 1]


def test_a_micro_batch_of_one_that_still_runs_out_is_refused():
    rows = _rows([4, 4, 200])          # 1 x 200 > 160: no micro-batch fits batch 2
    model = _compiled()
    found = _as_probed(model)
    with pytest.raises(tf.errors.ResourceExhaustedError, match="micro-batch of 1 sample .*update 2, epoch 0"):
        fit_with_out_of_memory_recovery(model, _dataset(rows), found, verbose=0)
    assert model.optimizer.accum_steps == 32 and int(model.optimizer.iterations.numpy()) == 2
    assert model.optimizer.held_micro_batches == 0        # the open window dropped
    reference = _keras_large_batch(rows[:2 * E], epochs=1)   # the two batches before it
    assert ref.max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-5


class _RunsOutInItsUpdate(keras.optimizers.SGD):
    """SGD whose update of the output layer's bias asks for 4 TiB at update `at`: the error
    comes inside the inner update, after the gradients, with other variables written or not."""

    def __init__(self, at, **kwargs):
        super().__init__(**kwargs)
        self.at = at

    def update_step(self, gradient, variable, learning_rate):
        if tuple(variable.shape) == (1,):    # the output layer's bias
            elements = tf.where(self.iterations == self.at, tf.constant(memory_cliff.OUT_OF_MEMORY_ELEMENTS, tf.int64),
                                tf.constant(1, tf.int64))
            total = tf.reduce_sum(gradient)
            gradient = gradient + (tf.reduce_max(tf.fill(tf.reshape(elements, [1]), total)) - total)
        super().update_step(gradient, variable, learning_rate)


def test_an_update_stopped_half_way_stops_the_run():
    rows = _rows([4, 4, 4])
    model = _compiled(inner=_RunsOutInItsUpdate(at=1, learning_rate=0.1))
    found = _as_probed(model)
    with pytest.raises(RuntimeError, match="inside the inner optimizer's update"):
        fit_with_out_of_memory_recovery(model, _dataset(rows), found, verbose=0)
    assert int(model.optimizer.track_updates().numpy()) % 2 == 1


def _found(accum_steps=2):
    return MicroBatchFit(micro_batch=E // accum_steps, accum_steps=accum_steps, effective_batch_size=E,
                         largest_fitting=E, probes=())


@pytest.mark.parametrize("kwargs, error, match", [
    ({"epochs": 0}, ValueError, "`epochs`"),
    ({"epochs": 2.0}, TypeError, "`epochs`"),
    ({"epochs": 2, "initial_epoch": 2}, ValueError, "`initial_epoch`"),
    ({"initial_epoch": -1}, ValueError, "`initial_epoch`"),
    ({"verbose": 3}, ValueError, "`verbose`.*'auto', 0, 1, 2"),
    ({"validation_freq": 0}, ValueError, "`validation_freq`"),
    ({"steps_per_epoch": 0}, ValueError, "`steps_per_epoch`"),
    ({"validation_steps": 1.5}, TypeError, "`validation_steps`"),
    ({"callbacks": [print]}, TypeError, "`callbacks`"),
    ({"found": (16, 2)}, TypeError, "`found`.*MicroBatchFit"),
    ({"found": _found(4)}, ValueError, "accum_steps=2 is not found.accum_steps=4"),
    ({"dataset": np.zeros((4, 3))}, TypeError, "`dataset`.*tf.data.Dataset"),
])
def test_bad_options_are_refused_before_any_step(kwargs, error, match):
    model = _compiled()
    model.optimizer.set_accum_steps(2)
    arguments = {"dataset": _dataset(_rows([4])), "found": _found(), **kwargs}
    with pytest.raises(error, match=match):
        fit_with_out_of_memory_recovery(model, arguments.pop("dataset"), arguments.pop("found"), **arguments)
    assert int(model.optimizer.iterations.numpy()) == 0 and not model.optimizer.built


def test_models_it_cannot_train_are_refused():
    plain = memory_cliff.sequence_model(BUDGET, FEATURES)
    plain.compile(keras.optimizers.Adam(), "mse")
    with pytest.raises(TypeError, match="GradientAccumulator"):
        fit_with_out_of_memory_recovery(plain, _dataset(_rows([4])), _found())
    passthrough = memory_cliff.sequence_model(BUDGET, FEATURES)
    passthrough.compile(GradientAccumulator(keras.optimizers.Adam()), "mse")
    with pytest.raises(ValueError, match="schedulable=True"):
        fit_with_out_of_memory_recovery(passthrough, _dataset(_rows([4])), _found())


def test_a_repeated_dataset_with_steps_per_epoch_goes_on_from_epoch_to_epoch():
    """`fit(steps_per_epoch=...)` on a repeated dataset, the TFX way: each epoch trains the
    next batches of one reading; a switch in the second epoch (its second window, the
    dataset's fifth batch) rewinds that epoch's windows only."""
    rows = _rows([4, 4, 4, 4, 16, 4])
    model = _compiled()
    found = _as_probed(model)
    run = fit_with_out_of_memory_recovery(model, _dataset(rows).repeat(), found, epochs=2, steps_per_epoch=3,
                                          verbose=0, validation_data=_dataset(_rows([4])).repeat(),
                                          validation_steps=1)
    assert [(s.update, s.micro_batch, s.accum_steps, s.epoch) for s in run.switches] == [(4, 8, 4, 1)]
    assert int(model.optimizer.iterations.numpy()) == 6 and run.history.epoch == [0, 1]
    assert len(run.history.history["val_loss"]) == 2
    reference = memory_cliff.sequence_model(None, FEATURES)
    reference.compile(keras.optimizers.Adam(1e-2), "mse")
    reference.fit(_dataset(rows).repeat(), epochs=2, steps_per_epoch=3, verbose=0)
    delta = ref.max_abs_diff(model.get_weights(), reference.get_weights())
    print(f"max |dw| (steps_per_epoch on a repeated dataset): {delta:.3g}")
    assert delta <= 1e-5


def test_data_that_runs_out_before_steps_per_epoch_stops_the_training(caplog):
    rows = _rows([4, 4, 4])
    model = _compiled()
    found = _as_probed(model)
    with caplog.at_level(logging.WARNING, logger="tfx_gradient_accumulator"):
        run = fit_with_out_of_memory_recovery(model, _dataset(rows), found, epochs=3, steps_per_epoch=2, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3 and run.history.epoch == [0, 1]
    assert any("data ran out before epoch 1" in r.message for r in caplog.records)
