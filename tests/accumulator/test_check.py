"""`accumulator.check_exact` and `python -m tfx_gradient_accumulator.accumulator.check`: the verdict both ways.

Each check trains three tiny models (Keras' large batch, its permuted twin, the
accumulator) for 3 updates. Exact setups must say exact; each deliberately
inexact setup must fail naming the variable and its kind, with a control that
differs from it in the one thing that makes it inexact.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator import accumulator
from tfx_gradient_accumulator.accumulator import check
from tfx_gradient_accumulator.accumulator.check import check_compare, check_runs
from tfx_gradient_accumulator.accumulator.rows import lookups
from tfx_gradient_accumulator.accumulator.check import ExactnessReport, check_exact, load_target, main

from tests.accumulator import test_lookups as lookup_models
from tests.accumulator.test_lookups import TokenAndPositionEmbedding

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
    # The arbiter ran by itself (a variable over its limit) and calls it real: in float64 too
    # the merged rows land far from Keras' large batch; the exact check needed no arbiter.
    assert exact.arbiter == "not run" and merged.arbiter == "real difference", str(merged)
    assert tokens.float64_delta > 100 * tokens.limit and not tokens.cleared
    assert tokens.accumulated_to_float64 > check.DEFAULT_ARBITER_FACTOR * tokens.keras_to_float64
    assert "REAL DIFFERENCE" in str(merged)
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


# ------------------------------------------------------------- random layers
def _users_text_model(attention_dropout=0.0):
    """A text model as a new user writes it: keras.io's token + position embeddings, a
    bidirectional GRU, self-attention, a residual LayerNormalization; AdamW with a schedule
    and clipnorm. The GRU and MultiHeadAttention own seed generators at every rate."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input((lookup_models.MAXLEN,), dtype="int32")
    hidden = TokenAndPositionEmbedding(lookup_models.MAXLEN, lookup_models.VOCAB, 8)(inputs)
    hidden = keras.layers.Bidirectional(keras.layers.GRU(4, return_sequences=True))(hidden)
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4, dropout=attention_dropout)(hidden, hidden)
    hidden = keras.layers.LayerNormalization()(keras.layers.Add()([hidden, attended]))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.GlobalAveragePooling1D()(hidden)))
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, decay_steps=2, decay_rate=0.8)
    model.compile(optimizer=keras.optimizers.AdamW(schedule, weight_decay=0.01, clipnorm=1.0), loss="mse")
    return model


@pytest.mark.apart      # 61 s; a zero rate kept exact (above) and the random layers (below) run in make test
def test_a_users_text_model_with_rates_at_0_is_exact_and_keeps_its_floor():
    report = check_exact(_users_text_model, lookup_models.text_data(96), None, 4, batch_size=8, verbose=False)
    assert report.exact and report.verdict == "exact", str(report)
    assert report.random_layers == [] and "random layers" not in str(report)
    assert "x floor" in report.rule and report.causes == []
    assert report.settings["optimizer"] == "AdamW"
    assert sum(v.moved > 1e-3 for v in report.variables) > len(report.variables) // 2


@pytest.mark.apart      # 49 s; as above
def test_attention_dropout_is_named_alone_when_it_explains_the_difference():
    report = check_exact(lambda: _users_text_model(attention_dropout=0.1), lookup_models.text_data(96), None, 4,
                         batch_size=8, verbose=False)
    assert not report.exact and report.verdict == "differs"
    assert len(report.random_layers) == 1, report.random_layers      # its inner Dropout is not named again
    assert "MultiHeadAttention" in report.random_layers[0] and "dropout=0.1" in report.random_layers[0]
    assert len(report.causes) == 1 and "random layers" in report.causes[0]
    assert not any("Embedding rows" in cause for cause in report.causes)
    assert "(random layers)" in report.rule
    # The arbiter cannot clear draws: "auto" says why it did not run.
    assert report.arbiter == "not run" and "random layers" in report.arbiter_reason


class _Jitter(keras.layers.Layer):
    """A custom layer that draws with a seed generator and shows no rate."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.random.SeedGenerator(1)

    def call(self, x, training=False):
        return x + keras.random.normal(keras.ops.shape(x), stddev=0.01, seed=self.generator) if training else x


@pytest.mark.parametrize("layer, random", [
    (keras.layers.GRU(3, return_sequences=True), False),
    (keras.layers.GRU(3, return_sequences=True, recurrent_dropout=0.2), True),
    (keras.layers.Bidirectional(keras.layers.LSTM(3, return_sequences=True, dropout=0.1)), True),
    (keras.layers.SimpleRNN(3, return_sequences=True), False),
    (keras.layers.Dropout(0.0), False),
    (keras.layers.SpatialDropout1D(0.2), True),
    (keras.layers.GaussianNoise(0.0), False),
    (keras.layers.GaussianNoise(0.1), True),
    (keras.layers.GaussianDropout(0.1), True),
    (keras.layers.AlphaDropout(0.1), True),
    (_Jitter(), True),
])
def test_a_layer_is_random_only_when_it_draws(layer, random):
    model = keras.Sequential([keras.Input((5, 3)), layer])
    found = check_compare.layers_that_draw(model)
    assert bool(found) == random, found
    if isinstance(layer, _Jitter):
        assert "no rate the check can read" in found[0]


class _Idle(keras.layers.Layer):
    """A custom layer that owns a seed generator it never uses, and shows no rate."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.generator = keras.random.SeedGenerator(1)

    def call(self, x):
        return x


def test_an_unknown_layer_with_a_seed_generator_is_counted_as_random_and_the_report_says_why():
    """Conservative: the floor is not used; but its weights match, so no cause claims they cannot."""
    report = check_exact(lambda: _mlp([_Idle()]), _regression(), _adam, 4, batch_size=8, loss="mse", verbose=False)
    assert report.exact, str(report)
    assert len(report.random_layers) == 1 and "no rate the check can read" in report.random_layers[0]
    assert "(random layers)" in report.rule and report.causes == []
    assert "random layers (they draw in training): " in str(report) and "cannot match" not in str(report)


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_a_keras_hub_layer_is_random_by_its_dropout(dropout):
    keras_hub = pytest.importorskip("keras_hub", reason="KerasHub is installed only in .venv-tf-latest")
    encoder = keras_hub.layers.TransformerEncoder(intermediate_dim=8, num_heads=2, dropout=dropout)
    found = check_compare.layers_that_draw(keras.Sequential([keras.Input((5, 4)), encoder]))
    assert found == ([f"{encoder.name} (TransformerEncoder: dropout=0.1)"] if dropout else []), found


def test_a_random_augmentation_layer_is_random():
    model = keras.Sequential([keras.Input((8, 8, 3)), keras.layers.RandomFlip(), keras.layers.Flatten()])
    assert [name for name in check_compare.layers_that_draw(model) if "RandomFlip" in name]


# ------------------------------------------------------------ the float64 arbiter
def _shift_the_accumulated_float32_run(monkeypatch, shift):
    """Adds `shift` to the first kernel of every float32 accumulated run: a difference of
    known size, where Keras' own rounding on this MLP is ~1e-8."""
    train = check_runs.train

    def shifted(model_fn, initial, optimizer, *args, **kwargs):
        model = train(model_fn, initial, optimizer, *args, **kwargs)
        if isinstance(optimizer, check_runs.GradientAccumulator) and model.weights[0].dtype == "float32":
            weights = model.get_weights()
            weights[0] = weights[0] + np.float32(shift)
            model.set_weights(weights)
        return model
    monkeypatch.setattr(check_runs, "train", shifted)


@pytest.mark.parametrize("shift, exact", [(1e-7, True), (1e-4, False)])
def test_the_arbiter_clears_rounding_and_keeps_a_real_difference(monkeypatch, shift, exact):
    """With the tolerance far below float32 (1e-12) and the floor taken once, a shift of about
    a float32 step (1e-7) puts the kernel over its limit: the arbiter finds it about as close
    to float64 as Keras' own float32 (cleared, factor 4). 1e-4 is far beyond Keras' rounding:
    real."""
    _shift_the_accumulated_float32_run(monkeypatch, shift)
    common = dict(accum_steps=4, batch_size=8, loss="mse", tolerance=1e-12, floor_factor=1.0, arbiter_factor=4,
                  verbose=False)
    report = check_exact(_mlp, _regression(), _adam, **common)
    kernel = report.variables[0]
    assert kernel.over_limit and kernel.keras_to_float64 is not None
    assert kernel.float64_delta < 1e-12                       # accumulation is exact in float64
    assert keras.config.dtype_policy().name == "float32"      # the policy is restored
    if exact:
        assert report.exact and report.verdict == "exact-by-arbiter", str(report)
        assert kernel.cleared and not kernel.differs and report.differing == []
        assert report.arbiter == "as close as Keras" and "EXACT BY ARBITER" in str(report)
        assert kernel.accumulated_to_float64 <= 4 * kernel.keras_to_float64 + check.ARBITER_SLACK
        # Control: the float32 verdict alone calls the same runs different.
        alone = check_exact(_mlp, _regression(), _adam, arbiter=False, **common)
        assert not alone.exact and alone.arbiter == "not run" and alone.variables[0].cleared is None
    else:
        assert not report.exact and report.verdict == "differs" and report.arbiter == "real difference"
        assert kernel.differs and not kernel.cleared
        assert kernel.accumulated_to_float64 > 1000 * kernel.keras_to_float64
        assert "REAL DIFFERENCE" in str(report) and kernel.path in report.arbiter_reason


def test_a_coupled_loss_without_gradient_cache_is_a_real_difference():
    """A loss that compares each sample with the batch's mean prediction: a micro-batch's
    mean is not the large batch's, in float64 as in float32."""
    def coupled(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred - keras.ops.mean(y_pred) - y_true))

    report = check_exact(_mlp, _regression(), _adam, 4, batch_size=8, loss=coupled, verbose=False)
    assert not report.exact and report.arbiter == "real difference", str(report)
    assert all(v.float64_delta > 1e-5 for v in report.differing)
    assert any("couples the samples" in cause for cause in report.causes)


def _fixed_float32_mlp():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, activation="tanh"),
                             keras.layers.Dense(1, dtype="float32")])


def _mixed_mlp():
    return keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(8, dtype="mixed_bfloat16"),
                             keras.layers.Dense(1, dtype="float32")])


_ONE_MODEL = []


def _the_same_model():
    """A model_fn that builds once and returns that model at every call."""
    if not _ONE_MODEL:
        _ONE_MODEL.append(_mlp())
    return _ONE_MODEL[0]


@pytest.mark.parametrize("model_fn, words", [
    (_fixed_float32_mlp, "fix their dtype"),
    (_mixed_mlp, "mixed precision"),
    (_the_same_model, "not a fresh one"),
])
def test_where_float64_cannot_be_had_the_report_says_why(model_fn, words):
    report = check_exact(model_fn, _regression(), _adam, 4, batch_size=8, loss="mse", arbiter=True, verbose=False)
    assert report.arbiter == "unavailable" and words in report.arbiter_reason, str(report)
    assert "float64 cannot be had" in str(report)
    assert all(v.cleared is None for v in report.variables)
    assert keras.config.dtype_policy().name == "float32"


def test_the_float64_policy_is_restored_on_error():
    with pytest.raises(RuntimeError):
        with check.float64_policy():
            assert keras.layers.Dense(2).dtype_policy.name == "float64"
            raise RuntimeError("inside")
    assert keras.config.dtype_policy().name == "float32" and keras.config.floatx() == "float32"


def test_float64_loss_computes_in_float64_and_refuses_what_it_cannot_rebuild():
    for loss in ("mse", keras.losses.MeanSquaredError(reduction="sum"), lambda t, p: keras.ops.abs(t - p)):
        rebuilt = check.float64_loss(loss)
        assert rebuilt.dtype == "float64"
        assert float(rebuilt(np.ones((2, 1)), np.zeros((2, 1)))) > 0

    class Fixed(keras.losses.Loss):
        def __init__(self):
            super().__init__(dtype="float32")

        def call(self, y_true, y_pred):
            return keras.ops.square(y_true - y_pred)

    with pytest.raises(ValueError, match="cannot be rebuilt"):
        check.float64_loss(Fixed())


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
    (dict(arbiter="yes"), ValueError, "`arbiter` must be \"auto\""),
    (dict(arbiter=1), ValueError, "`arbiter` must be \"auto\""),
    (dict(arbiter_factor=0.5), ValueError, "`arbiter_factor` must be a finite number >= 1"),
    (dict(floor_factor=0.5), ValueError, "`floor_factor` must be a number >= 1"),
    (dict(seed=-1), ValueError, "`seed` must be an integer from 0 to 4294967294"),
    (dict(optimizer_fn="adam"), TypeError, "`optimizer_fn` must be a function"),
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


# Apart (4 s): test_the_command_line_runs_the_arbiter_when_asked runs the same target to exit 0.
@pytest.mark.apart
def test_the_command_line_exits_0_on_an_exact_setup(capsys):
    assert main(["tests.accumulator.test_check:exact_setup", "--accum_steps", "2", "--batch_size", "16",
                 "--quiet"]) == 0
    assert "verdict: EXACT" in capsys.readouterr().out


def test_the_command_line_runs_the_arbiter_when_asked(capsys):
    assert main(["tests.accumulator.test_check:exact_setup", "--accum_steps", "2", "--batch_size", "16",
                 "--arbiter", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "arbiter: AS CLOSE AS KERAS" in out and "f64 accum" in out


def _command(*arguments):
    """`python -m tfx_gradient_accumulator.accumulator.check ...` run in its own process."""
    env = {**os.environ, "KERAS_BACKEND": "tensorflow", "TF_CPP_MIN_LOG_LEVEL": "2",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "tfx_gradient_accumulator.accumulator.check", *arguments],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_the_command_line_exits_1_on_an_inexact_setup_in_its_own_process():
    done = _command("tests.accumulator.test_check:inexact_setup", "--accum_steps", "4", "--batch_size", "8",
                    "--updates", "2")
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


def _main_exit(capsys, *arguments):
    """`main` in this process, for what ends in argparse's exit: (status, stdout, stderr).
    `main` is what `python -m ...check` runs (`sys.exit(main())`); an exception other
    than argparse's SystemExit (a traceback in its own process) fails `pytest.raises`.
    The command's own process is tested above (exit status 1, runpy's warning)."""
    with pytest.raises(SystemExit) as exited:
        main(list(arguments))
    captured = capsys.readouterr()
    return exited.value.code, captured.out, captured.err


@pytest.mark.parametrize("flags, words", [
    (["--accum_steps", "1"], ["--accum_steps", "an integer >= 2", "received 1"]),
    (["--batch_size", "0"], ["--batch_size", "a positive integer", "received 0"]),
    (["--tolerance", "-1"], ["--tolerance", "a positive number"]),
    # Known only once the target's data is loaded: 96 samples, 40 updates of 4 x 8 need 1280.
    (["--accum_steps", "4", "--batch_size", "8", "--updates", "40"],
     ["`data` holds 96 samples", "40 x 4 x 8 = 1280", "lower `updates`, `accum_steps` or `batch_size`"]),
])
def test_a_bad_argument_exits_2_with_one_line_and_no_traceback(flags, words, capsys):
    code, out, err = _main_exit(capsys, "tests.accumulator.test_check:exact_setup", "--quiet", *flags)
    assert code == 2, out + err
    assert "Traceback" not in err and out == ""
    errors = [line for line in err.splitlines() if "error:" in line]
    assert len(errors) == 1, err
    assert all(word in errors[0] for word in words), errors[0]


def test_the_help_gives_every_option_its_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")           # as in a process whose output is a pipe
    code, out, err = _main_exit(capsys, "--help")
    assert code == 0, err
    options = re.split(r"\n(?:options|optional arguments):", out)[-1]     # Python >= 3.10, 3.9
    blocks = re.split(r"\n  (?=-)", options)[1:]              # one per option, its help wrapped below it
    named = {block.split()[0].rstrip(",") for block in blocks}
    assert {"--accum_steps", "--batch_size", "--updates", "--tolerance", "--floor_factor", "--arbiter",
            "--no_arbiter", "--arbiter_factor", "--seed", "--quiet"} <= named, named
    missing = [block.split()[0] for block in blocks if "(default" not in " ".join(block.split())
               and not block.startswith("-h")]
    assert missing == [], missing
