"""AccumulatingTrainer's declaration: a drop-in for tfx.components.Trainer."""

import pytest
from tfx import v1 as tfx
from tfx.types import channel_utils, standard_artifacts

from components import AccumulatingTrainer
from components.component import AccumulatingTrainerSpec


def _examples():
    return channel_utils.as_channel([standard_artifacts.Examples()])


def _kwargs(**extra):
    return dict(module_file="/m.py", examples=_examples(),
                train_args=tfx.proto.TrainArgs(num_steps=10), **extra)


def test_same_inputs_and_outputs_as_the_stock_trainer():
    stock = tfx.components.Trainer(**_kwargs())
    ours = AccumulatingTrainer(**_kwargs(accum_steps=4, effective_batch_size=64))
    assert isinstance(ours, tfx.components.Trainer)
    assert set(ours.outputs) == set(stock.outputs) == {"model", "model_run"}
    for key in stock.outputs:
        assert ours.outputs[key].type == stock.outputs[key].type
    assert set(AccumulatingTrainerSpec.INPUTS) == set(type(stock.spec).INPUTS)
    assert set(type(stock.spec).PARAMETERS) < set(AccumulatingTrainerSpec.PARAMETERS)
    assert ours.exec_properties["accum_steps"] == 4
    assert ours.exec_properties["effective_batch_size"] == 64
    assert ours.exec_properties["strategy"] == "auto"
    assert ours.exec_properties["train_args"] == stock.exec_properties["train_args"]


def test_hyperparameters_channel_is_accepted():
    hp = channel_utils.as_channel([standard_artifacts.HyperParameters()])
    trainer = AccumulatingTrainer(**_kwargs(hyperparameters=hp))
    assert "hyperparameters" in trainer.inputs


@pytest.mark.parametrize(
    "extra, error, message",
    [
        ({"accum_steps": 0}, ValueError, "accum_steps"),
        ({"accum_steps": 2.0}, TypeError, "accum_steps"),
        ({"effective_batch_size": 0}, ValueError, "effective_batch_size"),
        ({"accum_steps": 3, "effective_batch_size": 64}, ValueError, "divide evenly"),
        ({"strategy": "gpu"}, ValueError, "strategy"),
        ({"partial_window": "keep"}, ValueError, "partial_window"),
    ],
)
def test_bad_parameters_fail_when_the_pipeline_is_defined(extra, error, message):
    with pytest.raises(error, match=message):
        AccumulatingTrainer(**_kwargs(**extra))


def test_stock_argument_rules_hold():
    with pytest.raises(ValueError, match="module_file"):
        AccumulatingTrainer(examples=_examples())
    with pytest.raises(ValueError, match="example"):
        AccumulatingTrainer(module_file="/m.py")


def test_accum_schedule_is_validated_and_stored_as_json():
    trainer = AccumulatingTrainer(**_kwargs(accum_schedule={0: 2, 3: 8}))
    assert trainer.exec_properties["accum_schedule"] == '{"0": 2, "3": 8}'
    with pytest.raises(ValueError, match="schedule"):
        AccumulatingTrainer(**_kwargs(accum_schedule={0: 0}))
