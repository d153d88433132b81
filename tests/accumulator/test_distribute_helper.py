"""Choosing the strategy from TF_CONFIG and the local GPUs; clear errors for bad TF_CONFIG."""

import json
import os
import sys

import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import distribute
from tests import fork_server

TWO_WORKERS = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]},
               "task": {"type": "worker", "index": 1}}


@pytest.mark.parametrize(
    "config, gpus, kind",
    [
        (TWO_WORKERS, 0, "multi_worker"),
        (TWO_WORKERS, 4, "multi_worker"),
        ({"cluster": {"chief": ["h:1"], "worker": ["h:2"]}, "task": {"type": "chief", "index": 0}}, 1, "multi_worker"),
        ({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 0}}, 2, "mirrored"),
        ({}, 8, "mirrored"),
        ({}, 1, "one_device"),
        ({}, 0, "default"),
    ],
)
def test_choice(config, gpus, kind):
    assert distribute.choose_strategy_kind(config, gpus) == kind


@pytest.mark.parametrize(
    "raw, message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"cluster": {"worker": "h:1"}}), "lists of 'host:port'"),
        (json.dumps({"cluster": {"worker": ["h:1"]}}), "'type' and 'index'"),
        (json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "ps", "index": 0}}), "not a job"),
        (json.dumps({"cluster": {"worker": ["h:1"]}, "task": {"type": "worker", "index": 3}}), r"\[0, 1\)"),
    ],
)
def test_invalid_tf_config_is_refused(raw, message):
    with pytest.raises(ValueError, match=message):
        distribute.parse_tf_config(raw)


def test_environment_without_cluster_or_gpu_gives_the_default_strategy(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    if tf.config.list_physical_devices("GPU"):
        pytest.skip("this machine has a GPU")
    strategy = distribute.strategy_from_environment()
    assert strategy is tf.distribute.get_strategy()
    assert distribute.num_replicas(strategy) == 1


def test_invalid_tf_config_in_environment_fails_before_any_strategy(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", "{oops")
    with pytest.raises(ValueError, match="TF_CONFIG"):
        distribute.strategy_from_environment()


def test_unknown_kind():
    with pytest.raises(ValueError, match="kind"):
        distribute.strategy_from_environment("tpu")


_TWO_STRATEGIES = """
import sys
import tensorflow as tf
from tfx_gradient_accumulator.accumulator.core import distribute
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

def all_reduce(strategy, size):
    step = tf.function(lambda: strategy.run(
        lambda: tf.distribute.get_replica_context().all_reduce("sum", tf.ones([size]))))
    return strategy.experimental_local_results(step())[0].shape[0]

make = {"ours": lambda: distribute.strategy_from_environment("mirrored"), "plain": tf.distribute.MirroredStrategy}
try:
    print("sizes", all_reduce(make[sys.argv[1]](), 3), all_reduce(make[sys.argv[1]](), 5))
except tf.errors.OpError as err:
    print("failed", err.message.splitlines()[0])
"""


@pytest.mark.parametrize("made_by, printed", [
    ("ours", "sizes 3 5"),
    ("plain", "failed"),   # the control
])
def test_two_mirrored_strategies_of_one_process_do_not_share_collective_keys(made_by, printed):
    """A second `MirroredStrategy` on the same devices (a second Trainer run in one process)
    reuses the first's collective keys in TF, and its first all-reduce of another shape
    fails; the library's strategies have keys of their own. In a process of its own: the
    control's failure would poison this one's collectives."""
    run = fork_server.run([sys.executable, "-c", _TWO_STRATEGIES, made_by], capture_output=True, timeout=300,
                          env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    lines = [line for line in run.stdout.splitlines() if line.startswith(("sizes", "failed"))]
    assert lines and lines[-1].startswith(printed), run.stdout + run.stderr
    assert made_by == "ours" or "Shape mismatch in the collective instance" in lines[-1]
