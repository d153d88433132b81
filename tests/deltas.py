"""Every max |Δw| the tests compare, by test, for `pytest --record-deltas=PATH`.

A passing test only says a difference was under its tolerance; a run on new
hardware (issue 13: a GPU with XLA on by default) also needs the figures. The
comparison helpers (`tests/accumulator/reference.py`, `tests/keras2`) pass each
difference through `note`; `tests/conftest.py` writes them, with each test's
outcome, after every test (so a run cut short keeps what it measured).
"""

import os

import numpy as np

# {test node id: [max |Δw| of each comparison, in the order the test made them]}
RECORDED = {}


def note(value):
    """Records `value` under the running test and returns it unchanged."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "outside a test").rsplit(" (", 1)[0]
    RECORDED.setdefault(test, []).append(float(value))
    return value


def max_abs_diff(weights_a, weights_b):
    """The largest absolute difference between two weight lists, computed in float64, noted."""
    return note(max(float(np.max(np.abs(np.asarray(a, "float64") - np.asarray(b, "float64"))))
                    for a, b in zip(weights_a, weights_b)))
