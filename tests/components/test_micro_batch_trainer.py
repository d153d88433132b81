"""`AccumulatingTrainer(accum_steps="fit")`: the micro-batch that fits the device, found
before training on a model with a real memory cliff (`memory_cliff_module.py`: a step of
`cliff` samples or more raises ResourceExhaustedError), recorded, and the run trains as
Keras' large batch at the effective batch.
"""

import json
import os

import numpy as np
import pytest

from tfx_gradient_accumulator.components import TrainerOptions, settings as settings_lib
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
    (dict(effective_batch_size=64, options=TrainerOptions(accum_schedule={0: 2})), "leave `accum_schedule`"),
    (dict(effective_batch_size=64, options=TrainerOptions(gradient_cache=True)), "gradient_cache"),
])
def test_fit_is_refused_with_what_it_cannot_go_with(arguments, match):
    with pytest.raises(ValueError, match=match):
        settings_lib.resolve(None, "fit", replicas=1, **{"effective_batch_size": None, **arguments})


def test_fit_takes_a_tuned_effective_batch_and_drops_a_tuned_accum_steps():
    tuned = settings_lib.resolve({"values": {"effective_batch_size": 128, "accum_steps": 8}}, "fit", None, replicas=2)
    assert tuned.fit_to_device and tuned.accum_steps == 1 and tuned.effective_batch_size == 128
    assert tuned.sources["accum_steps"] == "fit" and tuned.window_options.schedulable


def test_fit_tuned_alone_is_taken_from_the_hyperparameters_over_the_components_accum_steps():
    # AccumulatingHyperModel(accum_steps="fit") stores accum_steps="fit" with the tuned batch.
    tuned = settings_lib.resolve({"values": {"effective_batch_size": 128, "accum_steps": "fit"}}, 4, 32, replicas=2)
    assert tuned.fit_to_device and tuned.accum_steps == 1 and tuned.effective_batch_size == 128
    assert tuned.sources == {"accum_steps": "fit", "effective_batch_size": "hyperparameters",
                             "measure_noise_scale": "default", "noise_scale_smoothing": "default"}
    with pytest.raises(ValueError, match=r"'fit'` \(from hyperparameters.*needs `effective_batch_size`"):
        settings_lib.resolve({"values": {"accum_steps": "fit"}}, None, None, replicas=1)
    with pytest.raises(ValueError, match=r"from hyperparameters.*leave `accum_schedule`"):
        settings_lib.resolve({"values": {"accum_steps": "fit", "effective_batch_size": 64}}, None, None,
                             replicas=1, options=TrainerOptions(accum_schedule={0: 2}))


# Apart (48 s): tests/pipelines/test_tuned_fit_pipeline.py's Trainer takes the tuned "fit" and effective
# batch over its own accum_steps=2 and effective_batch_size=32, and finds its micro-batch below the cliff.
@pytest.mark.apart
def test_a_tuned_fit_runs_the_trainers_own_fit(examples, tmp_path):
    hp = fixtures.hyperparameters_artifact(str(tmp_path / "hp"), {"accum_steps": "fit", "effective_batch_size": 64})
    outputs, seen, _ = fixtures.run_executor(
        tmp_path / "tuned", examples, num_steps=2, hyperparameters=hp, module=MODULE,
        custom_config={"cliff": CLIFF}, accum_steps=2, effective_batch_size=32)
    model = outputs["model"][0]
    assert model.get_int_custom_property("accum_steps_fit") == 1
    assert model.get_int_custom_property("effective_batch_size") == 64
    assert model.get_int_custom_property("accum_steps") == 4 == seen["accum_steps"]
    assert model.get_int_custom_property("micro_batch_size") == 16 == seen["train_batch"]
    assert seen["iterations"] == 2


@pytest.mark.apart      # about 80 s: 2 processes, then the large batch in one (the library's 2 workers run in make test)
def test_on_two_processes_both_take_the_micro_batch_of_the_one_that_hits_the_cliff(examples, tmp_path):
    """The Trainer's cluster (chief + worker, TF_CONFIG as Vertex sets it): only the worker's
    device has a cliff (12 samples: 11 fit); 2 replicas, E = 64: 22 fit the cluster, 19
    with the headroom, so 16 x 4 (8 per process) on both, where the chief alone would have
    taken 32 x 2 (16 per process: over the worker's cliff). The run trains like Keras'
    large batch of 64 on one process."""
    from tests.components import local_cluster

    inputs, outputs, properties = fixtures.executor_arguments(
        tmp_path / "run", examples, num_steps=UPDATES, module=MODULE, accum_steps_fit=1,
        effective_batch_size=EFFECTIVE)
    results = local_cluster.run(local_cluster.container_command(inputs, outputs, properties), 2, tmp_path / "tmp",
                                env={1: {"MEMORY_CLIFF": 12}})
    assert [code for code, _, _ in results] == [0, 0], results[0][2][-3000:] + results[1][2][-3000:]
    said = [[line.split("accum_steps='fit': ", 1)[1] for line in err.splitlines()
             if "accum_steps='fit': micro-batch" in line] for _, _, err in results]
    assert len(said[0]) == len(said[1]) == 1, said
    for line in (said[0][0], said[1][0]):      # the same split on both; the probes are each one's own
        assert line.startswith("micro-batch 16 x 4 steps for the effective batch 64 (largest that fit: 22;"), line
    assert "32 fits" in said[0][0] and "16 OOM" in said[1][0]      # each worker's own probes
    recorded = local_cluster.custom_properties(local_cluster.published(results[0][1])["model"][0])
    assert {k: recorded[k] for k in ("accum_steps", "micro_batch_size", "largest_fitting_micro_batch", "workers")} == {
        "accum_steps": 4, "micro_batch_size": 16, "largest_fitting_micro_batch": 22, "workers": 2}
    # Every worker would have to switch at the same update: the found micro-batch is kept.
    assert recorded["out_of_memory_recovery"].startswith("off: a cluster of 2 workers")
    seen, weights = fixtures.read_run(outputs["model_run"][0].uri)
    assert (seen["iterations"], seen["train_batch"]) == (UPDATES, 16)     # the global micro-batch
    _, _, large = fixtures.run_executor(tmp_path / "large", examples, num_steps=UPDATES, module=MODULE,
                                        accum_steps=1, effective_batch_size=EFFECTIVE)
    print(f"[measured] accum_steps='fit' on 2 processes vs Keras' large batch: max |dw| {_max_diff(weights, large):.1e}")
    assert _max_diff(weights, large) <= 1e-5
