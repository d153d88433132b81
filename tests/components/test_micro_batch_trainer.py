"""`AccumulatingTrainer(accum_steps="fit")`: the micro-batch that fits the device, found
before training on a model with a real memory cliff (`memory_cliff_module.py`: a step of
`cliff` samples or more raises ResourceExhaustedError), recorded, and the run trains as
Keras' large batch at the effective batch.
"""

import json
import os

import numpy as np
import pytest

from tfx_gradient_accumulator.components import settings as settings_lib
from tests.components import fixtures

MODULE = os.path.join(fixtures.TESTDATA, "memory_cliff_module.py")
CLIFF, EFFECTIVE, UPDATES = 24, 64, 6


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def test_fit_finds_the_micro_batch_below_the_cliff_records_it_and_trains_as_the_large_batch(examples, tmp_path):
    outputs, seen, weights = fixtures.run_executor(
        tmp_path / "fit", examples, num_steps=UPDATES, module=MODULE, custom_config={"cliff": CLIFF},
        accum_steps_fit=1, effective_batch_size=EFFECTIVE)
    model = outputs["model"][0]
    probes = json.loads(model.get_string_custom_property("micro_batch_probes"))
    assert all(fitted == (b < CLIFF) for b, fitted in probes) and [CLIFF - 1, True] in probes
    assert model.get_int_custom_property("largest_fitting_micro_batch") == CLIFF - 1
    # 23 fits; 10% headroom: 20; the divisor of 64 from there: 16 x 4.
    assert model.get_int_custom_property("accum_steps_fit") == 1
    assert model.get_int_custom_property("accum_steps") == 4 == seen["accum_steps"]
    assert model.get_int_custom_property("micro_batch_size") == 16 == seen["train_batch"]
    assert seen["iterations"] == UPDATES and seen["train_steps"] == UPDATES * 4

    # The probe changed nothing: the same split set by hand, on the model without the cliff.
    _, by_hand_seen, by_hand = fixtures.run_executor(
        tmp_path / "by_hand", examples, num_steps=UPDATES, module=MODULE, accum_steps=4,
        effective_batch_size=EFFECTIVE)
    assert by_hand_seen["iterations"] == UPDATES
    assert _max_diff(weights, by_hand) == 0.0
    # Keras' large batch (one step of 64 samples per update), where it fits: no cliff.
    _, large_seen, large = fixtures.run_executor(
        tmp_path / "large", examples, num_steps=UPDATES, module=MODULE, accum_steps=1,
        effective_batch_size=EFFECTIVE)
    assert large_seen["train_batch"] == EFFECTIVE
    diff = _max_diff(weights, large)
    print(f"accum_steps='fit' vs Keras' large batch: max |dw| {diff:.1e}")
    assert diff <= 1e-5


@pytest.mark.parametrize("arguments, match", [
    (dict(), "needs `effective_batch_size`"),
    (dict(effective_batch_size=64, schedule={0: 2}), "leave `accum_schedule`"),
    (dict(effective_batch_size=64, gradient_cache=True), "gradient_cache"),
])
def test_fit_is_refused_with_what_it_cannot_go_with(arguments, match):
    with pytest.raises(ValueError, match=match):
        settings_lib.resolve(None, "fit", replicas=1, **{"effective_batch_size": None, **arguments})


def test_fit_takes_a_tuned_effective_batch_and_drops_a_tuned_accum_steps():
    tuned = settings_lib.resolve({"values": {"effective_batch_size": 128, "accum_steps": 8}}, "fit", None, replicas=2)
    assert tuned.fit_to_device and tuned.accum_steps == 1 and tuned.effective_batch_size == 128
    assert tuned.sources["accum_steps"] == "fit" and tuned.window_options.schedulable
