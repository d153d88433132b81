"""`AccumulatingTrainer(options=TrainerOptions(verify_exactness=...))`: the check on the run_fn's model, before training.

The stock-style regression module (Adam with a schedule and clipnorm) must be
recorded exact; the same module with a BatchNormalization layer must be recorded
"differs" naming its moving statistics, and `"refuse"` must stop it before
anything trains (no model written, the run_fn never finished).
"""

import os

import keras
import pytest

from tfx_gradient_accumulator.components import TrainerOptions, exactness
from tfx_gradient_accumulator.components.component import AccumulatingTrainer
from tests.components import fixtures


def _batch_norm_module(tmp_path):
    """The regression module with a BatchNormalization after its hidden layer."""
    with open(fixtures.MODULE) as f:
        source = f.read()
    hidden = 'x = keras.layers.Dense(8, activation="tanh")(x)'
    assert hidden in source
    path = tmp_path / "batch_norm_module.py"
    path.write_text(source.replace(hidden, hidden + "\n    x = keras.layers.BatchNormalization()(x)"))
    return str(path)


def seeded_at_import_module(tmp_path, dtype_policy=None):
    """The regression module seeded once, when it is imported, not in its run_fn (and given
    `dtype_policy` there): the model's initial weights come from the random state (and the
    policy) the run finds, which the check must leave as they were."""
    with open(fixtures.MODULE) as f:
        source = f.read()
    seeded = 'def _make_keras_model():\n    keras.utils.set_random_seed(0)\n'
    assert seeded in source
    at_import = "keras.utils.set_random_seed(0)\n" + (
        f"keras.config.set_dtype_policy({dtype_policy!r})\n" if dtype_policy else "")
    path = tmp_path / f"seeded_at_import_{dtype_policy}_module.py"
    path.write_text(source.replace(seeded, 'def _make_keras_model():\n').replace(
        'BATCH_SIZE = 32\n', 'BATCH_SIZE = 32\n' + at_import))
    return str(path)


def _properties(artifact):
    return (artifact.get_string_custom_property("exactness"),
            artifact.get_float_custom_property("exactness_max_delta"),
            artifact.get_string_custom_property("exactness_detail"))


def test_an_exact_run_fn_is_recorded_exact_and_trains_as_without_the_check(examples, tmp_path):
    module = seeded_at_import_module(tmp_path, "float64")
    keras.backend.clear_session()       # each run starts from fresh Keras names
    outputs, seen, weights = fixtures.run_executor(tmp_path / "checked", examples, num_steps=3, accum_steps=4,
                                                   effective_batch_size=32, verify_exactness="record", module=module)
    keras.backend.clear_session()
    plain, _, unchecked = fixtures.run_executor(tmp_path / "plain", examples, num_steps=3, accum_steps=4,
                                                effective_batch_size=32, module=module)
    keras.config.set_dtype_policy("float32")
    for artifact in (outputs["model"][0], outputs["model_run"][0]):
        verdict, delta, detail = _properties(artifact)
        assert verdict == "exact" and delta <= 1e-5 and "within its limit" in detail
    assert seen["iterations"] == 3 and seen["optimizer"] == "GradientAccumulator"
    # The probe stopped at fit, and the random state and dtype policy it and the check
    # touched were put back: the run that followed trained from the same start.
    assert [w.dtype for w in weights] == [w.dtype for w in unchecked] == ["float64"] * len(weights)
    assert max(float(abs(a - b).max()) for a, b in zip(weights, unchecked)) == 0.0
    # ... and with the same layer names: the check's models are forgotten.
    assert _layer_names(outputs) == _layer_names(plain)
    with open(os.path.join(outputs["model_run"][0].uri, "accumulation", "record.json")) as f:
        assert '"exactness"' in f.read()


def _layer_names(outputs):
    import tensorflow as tf

    loaded = tf.saved_model.load(os.path.join(outputs["model"][0].uri, "Format-Serving"))
    return sorted(v.name for v in loaded.variables)


def test_batch_normalization_is_recorded_as_differing_and_still_trains(examples, tmp_path):
    outputs, seen, _ = fixtures.run_executor(tmp_path, examples, num_steps=2, accum_steps=4,
                                             effective_batch_size=32, module=_batch_norm_module(tmp_path),
                                             verify_exactness="record")
    verdict, delta, detail = _properties(outputs["model"][0])
    assert verdict == "differs" and delta > 1e-5
    assert "moving_mean (batch-norm statistics)" in detail and "normalized with its own statistics" in detail
    assert seen["iterations"] == 2


def test_refuse_stops_an_inexact_run_fn_before_training(examples, tmp_path):
    inputs, outputs, properties = fixtures.executor_arguments(
        tmp_path, examples, num_steps=2, module=_batch_norm_module(tmp_path), accum_steps=4,
        effective_batch_size=32, verify_exactness="refuse")
    with pytest.raises(RuntimeError) as raised:
        _executor(tmp_path).Do(inputs, outputs, properties)
    message = str(raised.value)
    assert "nothing was trained" in message and "batch-norm statistics" in message
    assert not os.path.exists(os.path.join(outputs["model_run"][0].uri, "seen.json"))
    assert not os.path.exists(outputs["model"][0].uri)


def test_refuse_stops_where_nothing_can_be_checked(examples, tmp_path):
    inputs, outputs, properties = fixtures.executor_arguments(
        tmp_path, examples, num_steps=2, accum_steps=1, verify_exactness="refuse")
    with pytest.raises(RuntimeError, match="could not check .*accum_steps=1: nothing accumulates"):
        _executor(tmp_path).Do(inputs, outputs, properties)


def _executor(tmp_path):
    from tfx.dsl.components.base import base_executor

    from tfx_gradient_accumulator.components.executor import Executor

    return Executor(base_executor.BaseExecutor.Context(tmp_dir=str(tmp_path / "tmp"), unique_id="1"))


@pytest.mark.parametrize("mode, stored", [(False, None), (None, None), (True, "record"), ("refuse", "refuse")])
def test_the_modes(mode, stored):
    assert exactness.validate_mode(mode) == stored


@pytest.mark.parametrize("mode", ["yes", 1, "Refuse"])
def test_a_bad_mode_is_refused_by_the_component(mode):
    with pytest.raises(ValueError, match=r"`verify_exactness` must be one of \(False, True, 'refuse'\)"):
        AccumulatingTrainer(examples=_channel(), module_file=fixtures.MODULE,
                            options=TrainerOptions(verify_exactness=mode))


def _channel():
    from tfx import types
    from tfx.types import standard_artifacts

    return types.Channel(type=standard_artifacts.Examples)
