"""`AccumulatingTrainer(accum_steps="fit")` survives an out-of-memory error in the middle of
training: the run_fn's unchanged `fit` goes through the recovery, real
`ResourceExhaustedError`s from data whose later examples are larger
(`growing_data_module.py`), the switches recorded, and the final weights Keras' large batch's."""

import json
import os

import numpy as np
import pytest
import tensorflow as tf

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
