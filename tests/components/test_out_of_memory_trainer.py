"""`AccumulatingTrainer(accum_steps="fit")` survives an out-of-memory error in the middle of
training: the run_fn's unchanged `fit` goes through the recovery, real
`ResourceExhaustedError`s from data whose later examples are larger
(`growing_data_module.py`), the switches recorded, and the final weights Keras' large batch's."""

import dataclasses
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import MicroBatchFit
from tfx_gradient_accumulator.components import out_of_memory, settings as settings_lib
from tests.components import fixtures

MODULE = os.path.join(fixtures.TESTDATA, "growing_data_module.py")
EFFECTIVE, UPDATES, BUDGET = 64, 6, 48
# 384 examples, 6 windows of 64: sizes 1, 1 | 2, 2 | 4, 4 (by window). The probe sees the first
# batch (size 1): 47 fits, 42 with the headroom, so 32 x 2. Window 2 (size 2): 32 x 2 = 64 runs
# out, 16 x 4; window 4 (size 4): 16 x 4 = 64 runs out, 8 x 8 (the second epoch's first window).
SIZES = [1] * 128 + [2] * 128 + [4] * 128


@pytest.fixture(scope="module")
def sized_examples(tmp_path_factory):
    return fixtures.write_sized_examples(str(tmp_path_factory.mktemp("sized")), SIZES)


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


# About 25-35 s: two executor runs (55 s measured on a loaded machine).
def test_an_out_of_memory_error_mid_run_halves_the_micro_batch_is_recorded_and_trains_as_the_large_batch(
        sized_examples, tmp_path):
    outputs, seen, weights = fixtures.run_executor(
        tmp_path / "fit", sized_examples, num_steps=UPDATES, module=MODULE, custom_config={"budget": BUDGET},
        accum_steps_fit=1, effective_batch_size=EFFECTIVE)
    model = outputs["model"][0]
    switches = json.loads(model.get_string_custom_property("micro_batch_switches"))
    assert [(s["update"], s["previous_micro_batch"], s["micro_batch"], s["previous_accum_steps"], s["accum_steps"],
             s["epoch"]) for s in switches] == [(2, 32, 16, 2, 4, 0), (4, 16, 8, 4, 8, 1)]
    assert model.get_string_custom_property("out_of_memory_recovery") == "on"
    assert (model.get_int_custom_property("micro_batch_size"), model.get_int_custom_property("accum_steps")) == (32, 2)
    assert (model.get_int_custom_property("final_micro_batch_size"),
            model.get_int_custom_property("final_accum_steps")) == (8, 8)
    assert model.get_int_custom_property("optimizer_updates") == UPDATES
    with open(os.path.join(outputs["model_run"][0].uri, "accumulation", "record.json")) as f:
        assert "micro_batch_switches" in json.load(f)
    # The run_fn's fit: both epochs, validated, its TensorBoard callback written, 6 updates.
    assert seen["iterations"] == UPDATES and seen["accum_steps"] == 8 and seen["train_batch"] == 32
    assert seen["epochs"] == [0, 1] and len(seen["val_loss"]) == 2
    assert tf.io.gfile.glob(os.path.join(outputs["model_run"][0].uri, "logs", "train", "events.*"))

    # Keras' large batch (one step of 64 samples per update) on the same model without the cliff.
    _, large_seen, large = fixtures.run_executor(
        tmp_path / "large", sized_examples, num_steps=UPDATES, module=MODULE, accum_steps=1,
        effective_batch_size=EFFECTIVE)
    assert (large_seen["train_batch"], large_seen["iterations"]) == (EFFECTIVE, UPDATES)
    diff = _max_diff(weights, large)
    print(f"[measured] accum_steps='fit' with 2 switches mid-run vs Keras' large batch: max |dw| {diff:.1e}")
    assert diff <= 1e-5


def _recovery(**where):
    settings = dataclasses.replace(
        settings_lib.resolve(None, "fit", replicas=1, effective_batch_size=EFFECTIVE),
        fitted=MicroBatchFit(micro_batch=32, accum_steps=2, effective_batch_size=EFFECTIVE, largest_fitting=47,
                             probes=()))
    arguments = {"strategy": tf.distribute.get_strategy(), "workers": 1, "backup": None, **where}
    return out_of_memory.recovery_for(settings, arguments["strategy"], arguments["workers"], arguments["backup"])


class _Replicas:
    num_replicas_in_sync = 2


@pytest.mark.parametrize("where, said", [
    ({"workers": 2}, "off: a cluster of 2 workers"),
    ({"strategy": _Replicas()}, "off: 2 replicas"),
    ({"backup": object()}, "off: backup_dir is set"),
])
def test_where_it_cannot_be_exact_it_is_off_and_says_why(where, said):
    recovery = _recovery(**where)
    assert recovery.off.startswith(said) and out_of_memory.route(recovery) is None
    assert out_of_memory.properties(recovery) == ({}, {"out_of_memory_recovery": recovery.off,
                                                       "micro_batch_switches": "[]"})
    assert out_of_memory.route(_recovery()) is not None and out_of_memory.route(None) is None


def _fit_arguments(**given):
    return {"x": tf.data.Dataset.from_tensor_slices((np.zeros((8, 2)), np.zeros((8, 1)))).batch(4), "y": None,
            "batch_size": None, "epochs": 1, "verbose": 0, "callbacks": None, "validation_split": 0.0,
            "validation_data": None, "shuffle": True, "class_weight": None, "sample_weight": None,
            "initial_epoch": 0, "steps_per_epoch": None, "validation_steps": None, "validation_batch_size": None,
            "validation_freq": 1, **given}


@pytest.mark.parametrize("given, said", [
    ({"x": np.zeros((8, 2)), "y": np.zeros((8, 1)), "batch_size": 4}, "trains on ndarray"),
    ({"class_weight": {0: 1.0}}, "sets class_weight"),
    ({"steps_per_epoch": 5}, "steps_per_epoch=5, not a multiple of the 2 micro-steps"),
    ({"x": tf.data.Dataset.from_tensors(np.zeros((4, 3), "float32")).padded_batch(2, padded_shapes=[None, 3])},
     "examples of varying shapes"),
])
def test_a_fit_it_cannot_read_as_windows_trains_as_it_was_and_says_why(given, said):
    recovery, calls = _recovery(), []
    returned = recovery.fit(lambda model, **arguments: calls.append((model, arguments)) or "history", "model",
                            _fit_arguments(**given))
    assert returned == "history" and calls[0][0] == "model" and calls[0][1].keys() == _fit_arguments().keys()
    assert recovery.off.startswith("off: this fit ") and said in recovery.off
    assert recovery.switches == [] and out_of_memory.properties(recovery)[1]["out_of_memory_recovery"] == recovery.off


def test_with_backup_dir_it_trains_at_the_found_micro_batch_and_records_the_recovery_off(sized_examples, tmp_path):
    """A backup resumes by fit steps, which a switch would change: the run keeps the found b
    (on the early data alone: the cliff never comes), says so, and is backed up."""
    outputs, seen, _ = fixtures.run_executor(
        tmp_path / "fit", fixtures.write_sized_examples(str(tmp_path / "small"), [1] * 128), num_steps=2,
        module=MODULE, custom_config={"budget": BUDGET}, accum_steps_fit=1, effective_batch_size=EFFECTIVE,
        backup_dir=str(tmp_path / "backups"))
    model = outputs["model"][0]
    assert model.get_string_custom_property("out_of_memory_recovery").startswith("off: backup_dir is set")
    assert model.get_string_custom_property("micro_batch_switches") == "[]"
    assert model.get_int_custom_property("backup_resumes") == 0
    assert (seen["iterations"], seen["accum_steps"], seen["train_batch"]) == (2, 2, 32)
