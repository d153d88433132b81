"""`accumulator.check_exact` and `python -m tfx_gradient_accumulator.accumulator.check`: the verdict both ways.

Each check trains three tiny models (Keras' large batch, its permuted twin, the
accumulator) for 3 updates. Exact setups must say exact; each deliberately
inexact setup must fail naming the variable and its kind, with a control that
differs from it in the one thing that makes it inexact.
"""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator import accumulator
from tfx_gradient_accumulator.accumulator import lookups
from tfx_gradient_accumulator.accumulator.check import ExactnessReport, check_exact, load_target, main

from tests.accumulator import test_lookups as lookup_models

ROOT = Path(__file__).resolve().parents[2]
FEATURES = 6


def _regression(samples=96):
    rng = np.random.RandomState(0)
    x = rng.randn(samples, FEATURES).astype("float32")
    return x, (np.tanh(x[:, :1]) + 0.1 * rng.randn(samples, 1)).astype("float32")


def _mlp(middle=()):
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"), *middle,
                             keras.layers.Dense(1)])


def _adam():
    return keras.optimizers.Adam(1e-2)


# ------------------------------------------------ what the command line loads
def exact_setup():
    """(model_fn, data, optimizer_fn): an MLP with Adam, exact (the loss: the one it compiles with)."""
    return _compiled_mlp, _regression(), _adam


def inexact_setup():
    """A dict: a Dropout model, which differs by design."""
    return {"model_fn": lambda: _mlp([keras.layers.Dropout(0.3)]), "data": _regression(),
            "optimizer_fn": _adam, "loss": "mse"}


def _compiled_mlp():
    model = _mlp()
    model.compile(optimizer=_adam(), loss="mse")
    return model


# -------------------------------------------------------------------- exact
def test_an_mlp_with_adam_is_exact_and_the_check_moved_the_weights():
    report = check_exact(_compiled_mlp, _regression(), accum_steps=4, batch_size=8, verbose=False)
    assert isinstance(report, ExactnessReport)
    assert report.exact and report.verdict == "exact" and report.kinds == []
    assert [v.kind for v in report.variables] == ["dense"] * 4
    assert report.max_delta <= 1e-5
    # Not vacuous: training moved every variable far beyond the tolerance.
    assert min(v.moved for v in report.variables) > 1e-3
    assert report.settings["optimizer"] == "Adam" and report.settings["large_batch"] == 32
    text = str(report)
    assert "verdict: EXACT" in text and report.variables[0].path in text


def test_token_and_position_embedding_is_exact_and_differs_with_merged_rows():
    """keras.io's TokenAndPositionEmbedding: a per-token table beside a once-per-batch position
    table. merge_duplicate_rows=True with Adam sums the token rows before Adam's square."""
    data = tf.data.Dataset.from_tensor_slices(lookup_models.text_data(96)).batch(8).repeat()   # batch: 8
    common = dict(loss="mse", verbose=False)
    exact = check_exact(lookup_models.text_model, data, _adam, 4, **common)
    merged = check_exact(lookup_models.text_model, data, _adam, 4, accumulator_options={"merge_duplicate_rows": True},
                         **common)
    assert exact.exact, str(exact)
    assert exact.settings["batch_size"] == 8
    tables = sorted(v.kind for v in exact.variables if v.path.endswith("embeddings"))
    assert tables == ["once-per-batch rows", "rows"]
    assert not merged.exact and merged.verdict == "differs"
    tokens = next(v for v in merged.variables if v.path.endswith("embeddings") and v.differs)
    assert tokens.kind == "rows" and tokens.delta > 100 * tokens.limit
    assert "rows" in merged.kinds
    assert any("merge_duplicate_rows=True sums" in cause for cause in merged.causes)
    assert "DIFFERS" in str(merged) and tokens.path in str(merged)


def test_position_rows_kept_apart_are_caught(monkeypatch):
    """Control: a window that keeps the position table's rows apart (as before lookups were
    told apart) is not Keras' large batch, and the check names that table."""
    monkeypatch.setattr(lookups, "kind_of_rows", lambda indices: lookups.PER_SAMPLE)
    report = check_exact(lookup_models.text_model, lookup_models.text_data(96), _adam, 4, batch_size=8,
                         loss="mse", verbose=False)
    assert not report.exact
    differing = [v for v in report.variables if v.differs]
    positions = [v for v in differing if v.path.endswith("embeddings")]
    assert positions and all(v.kind == "rows" for v in positions)
    assert any("position table" in cause for cause in report.causes)


def test_a_sum_reduced_loss_with_sample_weights_is_exact():
    """Keras' large batch applies the gradient of the sum over its samples; so must the window."""
    x, y = _regression()
    weights = np.random.RandomState(2).uniform(0.5, 2.0, size=len(x)).astype("float32")
    report = check_exact(_mlp, (x, y, weights), lambda: keras.optimizers.SGD(1e-2), 4, batch_size=8,
                         loss=keras.losses.MeanSquaredError(reduction="sum"), verbose=False)
    assert report.exact, str(report)
    assert min(v.moved for v in report.variables) > 1e-3


# ------------------------------------------------------------------ inexact
def test_batch_normalization_differs_and_names_its_statistics():
    report = check_exact(lambda: _mlp([keras.layers.BatchNormalization()]), _regression(), _adam, 4,
                         batch_size=8, loss="mse", verbose=False)
    assert not report.exact
    statistics = [v for v in report.variables if v.kind == "batch-norm statistics"]
    assert [v.path.rsplit("/", 1)[-1] for v in statistics] == ["moving_mean", "moving_variance"]
    assert all(v.differs for v in statistics)
    assert "batch-norm statistics" in report.kinds
    assert any("normalized with its own statistics" in cause for cause in report.causes)


def test_dropout_differs_by_design_and_a_zero_rate_is_exact():
    dropout = check_exact(lambda: _mlp([keras.layers.Dropout(0.3)]), _regression(), _adam, 4,
                          batch_size=8, loss="mse", verbose=False)
    assert not dropout.exact
    assert dropout.random_layers and "Dropout" in dropout.random_layers[0]
    assert any("by design" in cause for cause in dropout.causes)
    # Control: the same model with rate 0 draws nothing.
    off = check_exact(lambda: _mlp([keras.layers.Dropout(0.0)]), _regression(), _adam, 4,
                      batch_size=8, loss="mse", verbose=False)
    assert off.exact and off.random_layers == [], str(off)


# ------------------------------------------------------------- bad input
def _never_called():
    raise AssertionError("model_fn was called: the arguments should have been refused first")


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(accum_steps=1), ValueError, "`accum_steps` must be an integer >= 2"),
    (dict(accum_steps=2.5), TypeError, "`accum_steps`"),
    (dict(updates=0), ValueError, "`updates` must be a positive integer"),
    (dict(batch_size=0), ValueError, "`batch_size` must be a positive integer"),
    (dict(tolerance=0), ValueError, "`tolerance` must be a positive number"),
    (dict(batch_size=32), ValueError, "the check needs `updates` x `accum_steps` x `batch_size`"),
    (dict(data=[1, 2, 3, 4]), ValueError, "`data` must be (x, y)"),
])
def test_bad_arguments_are_refused_before_any_training(kwargs, error, words):
    arguments = dict(model_fn=_never_called, data=_regression(), optimizer_fn=_adam, accum_steps=4,
                     batch_size=8, loss="mse", verbose=False)
    arguments.update(kwargs)
    with pytest.raises(error, match=None) as raised:
        check_exact(**arguments)
    assert words in str(raised.value)


@pytest.mark.parametrize("model_fn, loss, optimizer_fn, words", [
    (lambda: "not a model", "mse", _adam, "`model_fn` must return a Keras model"),
    (_mlp, None, _adam, "pass `loss=`"),
    (_mlp, "mse", None, "pass `optimizer_fn`"),
])
def test_a_model_it_cannot_check_gets_a_clear_message(model_fn, loss, optimizer_fn, words):
    with pytest.raises((TypeError, ValueError)) as raised:
        check_exact(model_fn, _regression(), optimizer_fn, 4, batch_size=8, loss=loss, verbose=False)
    assert words in str(raised.value)


# ------------------------------------------------------------ command line
def test_the_package_exports_it():
    assert accumulator.check_exact is check_exact
    assert "check_exact" in accumulator.__all__


def test_the_command_line_exits_0_on_an_exact_setup(capsys):
    assert main(["tests.accumulator.test_check:exact_setup", "--accum_steps", "2", "--batch_size", "16",
                 "--quiet"]) == 0
    assert "verdict: EXACT" in capsys.readouterr().out


def test_the_command_line_exits_1_on_an_inexact_setup_in_its_own_process():
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "tfx_gradient_accumulator.accumulator.check", "tests.accumulator.test_check:inexact_setup",
                           "--accum_steps", "4", "--batch_size", "8", "--updates", "2"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "verdict: DIFFERS" in done.stdout and "by design" in done.stdout
    assert "check_exact [3/3]" in done.stderr                # the progress lines
    assert "found in sys.modules" not in done.stderr         # runpy's double-import warning


@pytest.mark.parametrize("spec, words", [
    ("no_colon", "Expected `module:function`"),
    ("tests.accumulator.test_check:missing", "has no function 'missing'"),
    ("tests.accumulator.test_check:_mlp", "must return (model_fn, data, optimizer_fn) or a dict"),
])
def test_the_command_line_refuses_a_bad_target(spec, words):
    with pytest.raises(ValueError) as raised:
        load_target(spec)
    assert words in str(raised.value)
