"""`optimizer_updates` on the Trainer's artifacts is the updates made, also for a
run_fn whose finite dataset of unknown size runs out (Keras then runs one more step
per epoch on the exhausted data; a stock optimizer counts it, the control)."""

import json
import os

import pytest

from tests.components import fixtures

MODULE = os.path.join(fixtures.TESTDATA, "to_the_end_module.py")
TRAIN, BATCH, EPOCHS = 384, 32, 2


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    return fixtures.write_examples(str(tmp_path_factory.mktemp("examples")), train=TRAIN)


def test_control_the_stock_trainer_trains_every_batch(examples, tmp_path):
    _, seen, _ = fixtures.run_executor(tmp_path, examples, num_steps=1, stock=True, module=MODULE)
    assert seen["cardinality"] == -2 and seen["train_batch"] == BATCH       # unknown size
    assert seen["batches"] == EPOCHS * TRAIN // BATCH
    # Keras 3.15.1 (the TFX stack's) runs the extra step and counts it, once per epoch.
    assert seen["iterations"] == seen["batches"] + EPOCHS


@pytest.mark.parametrize("accum_steps", [1, 4])
def test_the_record_counts_the_updates_made(examples, tmp_path, accum_steps):
    outputs, seen, _ = fixtures.run_executor(tmp_path, examples, num_steps=1, module=MODULE,
                                             accum_steps=accum_steps, effective_batch_size=BATCH)
    assert seen["optimizer"] == "GradientAccumulator" and seen["train_batch"] == BATCH // accum_steps
    updates = EPOCHS * TRAIN // BATCH
    assert seen["batches"] == updates * accum_steps and seen["iterations"] == updates
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        assert artifact.get_int_custom_property("optimizer_updates") == updates
    with open(os.path.join(outputs["model_run"][0].uri, "accumulation", "record.json")) as f:
        assert json.load(f)["optimizer_updates"] == {"intValue": str(updates)}
