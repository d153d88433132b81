"""Test session set-up: quiet TensorFlow, the Keras TF backend, 2 logical CPUs.

The logical CPUs must be configured before TensorFlow initialises its devices,
which is why it happens here, at import time of the test session.

`--record-deltas=PATH` writes every test's outcome and each max |Δw| it compared
(see `tests/deltas.py`): the figures a run on new hardware reports.
"""

import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # devices already initialised by an earlier import
    pass


# ------------------------------------------------ --record-deltas=PATH (tests/deltas.py)
_record_path = None     # from --record-deltas
_outcomes = {}          # {test node id: outcome}, in the order the tests ended


def pytest_addoption(parser):
    parser.addoption("--record-deltas", metavar="PATH", default=None,
                     help="write each test's outcome and every max |Δw| it compared to PATH (JSON), "
                          "rewritten after each test")


def pytest_configure(config):
    global _record_path
    _record_path = config.getoption("--record-deltas")


# ------------------------------------------------ the end of a test process
# Once pytest has reported (terminal summary, junit, deltas written in sessionfinish), the
# process ends at once with pytest's status: the interpreter's own teardown, TensorFlow's
# threads and thousands of traced functions, took from 10 s to almost 4 minutes after a
# lane's last test, a slot of make test held and nothing run. ACCUMULATOR_TEST_TEARDOWN=1
# keeps the ordinary exit (to debug what that teardown does). The fork servers
# (tests/fork_server.py) are ended first: they would end at the end of their input
# anyway, but not before their logs could be removed.
_exit_status = None


def pytest_sessionfinish(session, exitstatus):
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    if _exit_status is not None and os.environ.get("ACCUMULATOR_TEST_TEARDOWN") != "1":
        if "tests.fork_server" in sys.modules:
            sys.modules["tests.fork_server"].close_servers()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_exit_status)


def pytest_runtest_logreport(report):
    if _record_path is None or (report.when != "call" and report.passed):
        return
    outcome = "skipped" if report.skipped else report.outcome
    _outcomes.setdefault(report.nodeid, outcome if report.when == "call" else f"{outcome} in {report.when}")
    _write_deltas(_record_path)


def _write_deltas(path):
    import json
    import platform

    from tests import deltas

    record = {"python": platform.python_version(), "tensorflow": tf.__version__,
              "keras": getattr(tf.keras, "__version__", None),
              "gpus": [d.name for d in tf.config.list_logical_devices("GPU")],
              "tests": [{"test": test, "outcome": outcome, "max_abs_dw": deltas.RECORDED.get(test, [])}
                        for test, outcome in _outcomes.items()]}
    with open(path + ".partial", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(path + ".partial", path)


@pytest.fixture
def easy_auto(monkeypatch):
    """AutoAccumulation's defaults made easy to clear, for tests of what happens when it grows
    (records, replays, resumes) on tasks whose noise scale is too small for the real defaults:
    no overhead budget past B_simple itself, a 60% bound, 2 windows a look, no ramp."""
    from tfx_gradient_accumulator.accumulator.schedules.auto_batch import _AutoAccumulationRule
    defaults = dict(_AutoAccumulationRule.__init__.__kwdefaults__)
    defaults.update(max_sample_overhead=1.0, confidence=0.6, min_windows=2, lr_ramp_updates=0)
    monkeypatch.setattr(_AutoAccumulationRule.__init__, "__kwdefaults__", defaults)
    return defaults
