"""Choosing the strategy from TF_CONFIG and the local GPUs; clear errors for bad TF_CONFIG."""

import json

import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import distribute

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
