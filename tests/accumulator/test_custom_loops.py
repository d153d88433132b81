"""Custom loops never drift from the large batch without a word (issue 58, item 2).

Each of the README's loop patterns runs as a program of its own (`custom_loop_patterns.py`,
forked by `tests/fork_server.py`, all at once), and what it prints is read back: where it
drifts it says so (once), and written with `optimizer.micro_batches(data)` (no
`micro_batch_weight`, no `close_partial_window`) it says nothing and its weights are Keras'
`fit(batch_size=32)`.
"""

import json
import os
import pathlib
import sys

import numpy as np
import pytest
import keras

from tests import fork_server

PATTERNS = pathlib.Path(__file__).with_name("custom_loop_patterns.py")
SAID = "CustomLoopWarning"
MODEL_OPEN = "the model's weights are read (get_weights, save, save_weights) while"
EXIT = "the program ends (or the optimizer is discarded) with 1 micro-batch(es)"
ANY_SIZE = "is traced for micro-batches of any size"
LEFT = "the loop left `optimizer.micro_batches(data)` before its data ended"

# (pattern, read, samples): 100 as the README (the last window: one micro-batch of 4),
# 92 where the short micro-batch shares its window with two of 8 (its weight matters).
RUNS = {
    "not_closed_get_weights": ("weighted_not_closed", "get_weights", 100),
    "not_closed_save": ("weighted_not_closed", "save", 100),
    "not_closed_save_weights": ("weighted_not_closed", "save_weights", 100),
    "not_closed_exit": ("weighted_not_closed", "none", 100),
    "reduce_retracing": ("reduce_retracing", "none", 92),
    "dataset_in_one_function": ("dataset_in_one_function", "none", 92),
    "helper_get_weights": ("helper", "get_weights", 92),
    "helper_any_size_save": ("helper_any_size", "save", 92),
    "helper_dataset_save_weights": ("helper_dataset", "save_weights", 92),
    "helper_break": ("helper_break", "none", 92),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{run: (its JSON line, its stderr)}, the runs forked at once and waited for together."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    folder = tmp_path_factory.mktemp("custom_loops")
    started = {name: fork_server.popen([sys.executable, str(PATTERNS), pattern, read, str(n)], env=env, cwd=folder)
               for name, (pattern, read, n) in RUNS.items()}
    done = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        done[name] = json.loads(out.strip().splitlines()[-1]), err
    return done


def _large_batch(n):
    """Keras' own `fit(batch_size=32)` on the programs' data and model: its weights."""
    x = np.random.default_rng(0).normal(size=(n, 8)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    model.fit(x, x.sum(axis=1, keepdims=True), batch_size=32, shuffle=False, verbose=0)
    return model.get_weights()


@pytest.fixture(scope="module")
def large_batches():
    return {n: _large_batch(n) for n in (92, 100)}


def _max_delta(name, runs, large_batches):
    ours = [np.asarray(w, dtype="float32") for w in runs[name][0]["weights"]]
    return max(float(np.max(np.abs(a - b))) for a, b in zip(ours, large_batches[RUNS[name][2]]))


@pytest.mark.parametrize("name", ["not_closed_get_weights", "not_closed_save", "not_closed_save_weights"])
def test_an_uncompiled_models_weights_read_with_a_window_open_are_told_of(name, runs, large_batches):
    result, err = runs[name]
    assert result["held"] == 1 and result["updates"] == 3          # one update lost ...
    assert _max_delta(name, runs, large_batches) > 1e-3           # ... and the weights drift
    assert err.count(SAID) == 1 and MODEL_OPEN in err and "holds 1 micro-batch(es)" in err
    assert EXIT not in err                                          # told once, at the read


def test_a_window_left_open_at_the_programs_end_is_told_of(runs, large_batches):
    result, err = runs["not_closed_exit"]
    assert result["held"] == 1 and _max_delta("not_closed_exit", runs, large_batches) > 1e-3
    assert err.count(SAID) == 1 and EXIT in err


@pytest.mark.parametrize("name", ["reduce_retracing", "dataset_in_one_function"])
def test_a_step_traced_for_any_size_without_a_weight_is_told_of(name, runs, large_batches):
    result, err = runs[name]
    assert result["held"] == 0 and result["updates"] == 3
    assert _max_delta(name, runs, large_batches) > 1e-4           # the 4-sample micro-batch weighs as 8
    assert err.count(SAID) == 1 and ANY_SIZE in err and "micro_batches(data)" in err


@pytest.mark.parametrize("name", ["helper_get_weights", "helper_any_size_save", "helper_dataset_save_weights"])
def test_the_loop_over_micro_batches_is_the_large_batch_and_says_nothing(name, runs, large_batches):
    result, err = runs[name]
    assert result["held"] == 0 and result["updates"] == 3
    assert _max_delta(name, runs, large_batches) <= 1e-5
    assert SAID not in err and "GradientAccumulator" not in err, err[-3000:]


def test_a_loop_that_leaves_micro_batches_early_keeps_the_window_and_says_so(runs):
    result, err = runs["helper_break"]
    assert result["held"] == 2 and result["updates"] == 2          # 10 of 12 micro-batches: 2 windows, 2 held
    assert err.count(SAID) == 1 and LEFT in err and "with 2 micro-batch(es) held" in err
