"""`AccumulatingTrainer(micro_batch_size=b)`: the run_fn's data at the effective batch, each
`fit` step one update split into micro-batches inside the step; refused with what it
excludes, tunable over the effective batch alone, recorded in ML Metadata and TensorBoard,
and trained as the stock Trainer trains the same module at the effective batch.
"""

import glob
import json
import os

import pytest
import tensorflow as tf
from tfx.orchestration import data_types
from tfx.types import Channel, standard_artifacts

from tfx_gradient_accumulator.accumulator.core import options as library_options
from tfx_gradient_accumulator.components import AccumulatingTrainer, TrainerOptions
from tfx_gradient_accumulator.components import settings as settings_lib
from tests.accumulator.reference import max_abs_diff
from tests.components import fixtures

EFFECTIVE, MICRO, UPDATES = 32, 12, 6      # 12 + 12 + 8: the last micro-batch filled up and masked
TAG = "accumulation/micro_batch_size_taken"


def _tensorboard(model_run_uri, tag):
    """{step: value} of the executor's scalar `tag`."""
    values = {}
    for path in glob.glob(os.path.join(model_run_uri, "accumulation", "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    values[event.step] = float(tf.make_ndarray(value.tensor))
    return values


def _trainer(**parameters):
    return AccumulatingTrainer(run_fn="tfx_gradient_accumulator.pipelines.digits.model.run_fn",
                               examples=Channel(type=standard_artifacts.Examples), **parameters)


def _auto_has_landed():
    try:
        library_options.validate_micro_batch_size("auto")
    except (TypeError, ValueError):
        return False
    return True


@pytest.mark.parametrize("parameters, match", [
    (dict(accum_steps=4), r"`micro_batch_size=16`.*`accum_steps`.*pass one.*accum_steps=4"),
    (dict(accum_steps="fit"), r"`accum_steps`.*pass one.*accum_steps='fit'"),
    (dict(accum_steps="auto", options=TrainerOptions(max_effective_batch_size=128)),
     r"`accum_steps`.*pass one.*accum_steps='auto'"),
    (dict(options=TrainerOptions(gradient_cache=True)), r"`micro_batch_size=16` does not go with `gradient_cache`"),
    (dict(options=TrainerOptions(accum_schedule={0: 2})), r"does not go with `accum_schedule`"),
    (dict(options=TrainerOptions(measure_noise_scale=True)), r"does not go with `measure_noise_scale`"),
    (dict(options=TrainerOptions(partial_window="carry")), r"does not go with `partial_window`"),
    (dict(effective_batch_size=None), r"`micro_batch_size=16` needs `effective_batch_size`"),
    (dict(micro_batch_size="large"), r"`micro_batch_size` must be an int >= 1 or 'auto'.*'large'"),
    (dict(micro_batch_size=0), r"`micro_batch_size` must be a positive integer"),
])
def test_the_component_refuses_what_micro_batch_size_excludes_when_the_pipeline_is_defined(parameters, match):
    arguments = {"effective_batch_size": 64, "micro_batch_size": 16, **parameters}
    with pytest.raises(ValueError, match=match):
        _trainer(**arguments)


def test_the_component_stores_an_int_and_auto_and_leaves_what_it_cannot_know_to_the_executor():
    trainer = _trainer(effective_batch_size=64, micro_batch_size=16)
    assert (trainer.exec_properties["micro_batch_size"], trainer.exec_properties["micro_batch_size_auto"]) == (16, 0)
    auto = _trainer(effective_batch_size=64, micro_batch_size="auto")
    assert (auto.exec_properties["micro_batch_size"], auto.exec_properties["micro_batch_size_auto"]) == (None, 1)
    # The effective batch may come from the Tuner: what is excluded is still refused now.
    tuned = _trainer(micro_batch_size=16, hyperparameters=Channel(type=standard_artifacts.HyperParameters))
    assert tuned.exec_properties["micro_batch_size"] == 16
    with pytest.raises(ValueError, match="pass one"):
        _trainer(micro_batch_size=16, accum_steps=2, hyperparameters=Channel(type=standard_artifacts.HyperParameters))
    # A RuntimeParameter is known when the executor runs: it checks it then.
    runtime = data_types.RuntimeParameter(name="micro_batch_size", ptype=int, default=16)
    assert _trainer(micro_batch_size=runtime, accum_steps=4, effective_batch_size=64).exec_properties[
        "micro_batch_size"] is runtime


def test_the_executor_refuses_a_runtime_value_that_goes_with_accum_steps_before_training(examples, tmp_path):
    with pytest.raises(ValueError, match=r"`micro_batch_size=16`.*pass one.*accum_steps=4"):
        fixtures.run_executor(tmp_path, examples, num_steps=2, accum_steps=4, effective_batch_size=64,
                              micro_batch_size=16)
    assert not os.path.exists(os.path.join(tmp_path, "model_run", "seen.json"))      # nothing trained
    with pytest.raises(ValueError, match=r"global, like `fit`'s batch.*divide by 2"):
        settings_lib.resolve(None, None, 64, replicas=2, micro_batch_size=7)


def test_the_run_fn_reads_the_effective_batch_and_trains_as_the_stock_trainer_at_it(examples, stock_regression,
                                                                                     tmp_path):
    """The stock Trainer: the module's batch of 32, 6 steps (Adam with an exponential decay and
    clipnorm). Ours: effective 32 in micro-batches of 12 inside each of 6 steps."""
    _, stock_seen, stock_weights = stock_regression
    outputs, seen, weights = fixtures.run_executor(tmp_path, examples, num_steps=UPDATES,
                                                   effective_batch_size=EFFECTIVE, micro_batch_size=MICRO)
    assert stock_seen["train_batch"] == EFFECTIVE and stock_seen["iterations"] == UPDATES
    assert (seen["train_batch"], seen["train_steps"], seen["iterations"]) == (EFFECTIVE, UPDATES, UPDATES)
    assert (seen["optimizer"], seen["accum_steps"], seen["eval_batch"]) == ("GradientAccumulator", 1, 16)
    diff = max_abs_diff(weights, stock_weights)
    print(f"[measured] micro_batch_size={MICRO} at E={EFFECTIVE} vs the stock Trainer at {EFFECTIVE}: "
          f"max |dw| {diff:.1e}")
    assert diff <= 1e-5
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        ints = {name: artifact.get_int_custom_property(name) for name in (
            "micro_batch_size", "micro_batch_size_auto", "micro_batches_per_update", "effective_batch_size",
            "accum_steps", "optimizer_updates", "micro_batch_out_of_memory_errors", "unapplied_micro_batches")}
        assert ints == {"micro_batch_size": MICRO, "micro_batch_size_auto": 0, "micro_batches_per_update": 3,
                        "effective_batch_size": EFFECTIVE, "accum_steps": 1, "optimizer_updates": UPDATES,
                        "micro_batch_out_of_memory_errors": 0, "unapplied_micro_batches": 0}
        assert json.loads(artifact.get_string_custom_property("micro_batch_changes")) == []
    with open(os.path.join(outputs["model_run"][0].uri, "accumulation", "record.json")) as f:
        assert json.load(f)["micro_batch_size"] == {"intValue": str(MICRO)}
    assert _tensorboard(outputs["model_run"][0].uri, TAG) == {0: float(MICRO)}
    assert _tensorboard(outputs["model_run"][0].uri, "accumulation/micro_batches_per_update") == {0: 3.0}
    assert os.path.exists(os.path.join(outputs["model"][0].uri, "Format-Serving", "saved_model.pb"))


def test_a_tuned_effective_batch_just_changes_the_batch_and_a_tuned_accum_steps_is_not_applied(examples, tmp_path):
    hp = fixtures.hyperparameters_artifact(str(tmp_path / "hp"), {"effective_batch_size": 64, "accum_steps": 4})
    outputs, seen, _ = fixtures.run_executor(tmp_path / "run", examples, num_steps=2, hyperparameters=hp,
                                             effective_batch_size=EFFECTIVE, micro_batch_size=16)
    assert (seen["train_batch"], seen["train_steps"], seen["iterations"], seen["accum_steps"]) == (64, 2, 2, 1)
    model = outputs["model"][0]
    assert (model.get_int_custom_property("effective_batch_size"), model.get_int_custom_property("micro_batch_size"),
            model.get_int_custom_property("micro_batches_per_update")) == (64, 16, 4)
    settings = settings_lib.resolve({"values": {"effective_batch_size": 64, "accum_steps": 4}}, None, EFFECTIVE,
                                    replicas=1, micro_batch_size=16)
    assert settings.sources["effective_batch_size"] == "hyperparameters"
    assert settings.sources["accum_steps"] == "default"
    with pytest.raises(ValueError, match=r"hyperparameters' accum_steps='auto'.*Tune the effective batch alone"):
        settings_lib.resolve({"values": {"accum_steps": "auto", "effective_batch_size": 64}}, None, None,
                             replicas=1, micro_batch_size=16)
    with pytest.raises(ValueError, match=r"`measure_noise_scale=True` \(from hyperparameters\)"):
        settings_lib.resolve({"values": {"measure_noise_scale": True}}, None, 64, replicas=1, micro_batch_size=16)


def test_verify_exactness_says_it_cannot_check_micro_batches_inside_a_step(examples, tmp_path):
    with pytest.raises(RuntimeError, match=r"could not check .*micro_batch_size=16: check_exact compares"):
        fixtures.run_executor(tmp_path, examples, num_steps=2, effective_batch_size=EFFECTIVE, micro_batch_size=16,
                              verify_exactness="refuse")
    assert not os.path.exists(os.path.join(tmp_path, "model_run", "seen.json"))      # nothing trained


def test_a_micro_batch_above_the_effective_batch_trains_it_whole():
    settings = settings_lib.resolve(None, None, EFFECTIVE, replicas=1, micro_batch_size=100)
    assert (settings.micro_batch_size, settings.train_batch, settings.steps_per_update) == (EFFECTIVE, EFFECTIVE, 1)
    assert settings.window_options.micro_batch_size == EFFECTIVE


@pytest.mark.skipif(not _auto_has_landed(), reason="micro_batch_size='auto' is not in the library yet")
def test_auto_finds_the_micro_batch_below_the_cliff_records_each_change_and_trains_as_the_large_batch(
        examples, tmp_path):
    """The memory-cliff module (a micro-batch of 40 samples or more runs out of memory): "auto"
    starts at the effective batch of 64, and the run trains the first batch again at a smaller
    b; the weights are those of Keras' large batch on the same model without the cliff."""
    module = os.path.join(fixtures.TESTDATA, "memory_cliff_module.py")
    outputs, seen, weights = fixtures.run_executor(
        tmp_path / "auto", examples, num_steps=UPDATES, module=module, custom_config={"cliff": 40},
        effective_batch_size=64, micro_batch_size="auto")
    assert (seen["train_batch"], seen["iterations"]) == (64, UPDATES)
    model = outputs["model"][0]
    changes = json.loads(model.get_string_custom_property("micro_batch_changes"))
    in_use = model.get_int_custom_property("micro_batch_size")
    assert 0 < in_use < 40 and changes and changes[-1]["micro_batch"] == in_use
    assert changes[0]["previous_micro_batch"] == 64 and changes[0]["update"] == 0
    assert model.get_int_custom_property("micro_batch_size_auto") == 1
    assert model.get_int_custom_property("micro_batch_out_of_memory_errors") == sum(
        c["out_of_memory_errors"] for c in changes) >= 1
    steps = _tensorboard(outputs["model_run"][0].uri, TAG)
    assert steps[changes[-1]["update"]] == float(in_use)
    _, _, large = fixtures.run_executor(tmp_path / "large", examples, num_steps=UPDATES, module=module,
                                        accum_steps=1, effective_batch_size=64)
    diff = max_abs_diff(weights, large)
    print(f"[measured] micro_batch_size='auto' (b={in_use}, changes {changes}) vs Keras' large batch: {diff:.1e}")
    assert diff <= 1e-5
