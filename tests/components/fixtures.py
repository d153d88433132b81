"""Artifacts and executor calls for component tests, without a pipeline."""

import importlib.util
import json
import os

import numpy as np
import tensorflow as tf
from tfx.components.trainer import executor as tfx_executor
from tfx.dsl.components.base import base_executor
from tfx.proto import trainer_pb2
from tfx.types import artifact_utils, standard_artifacts
from tfx.utils import json_utils, proto_utils

from tfx_gradient_accumulator.components.executor import Executor

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "testdata")
MODULE = os.path.join(TESTDATA, "regression_module.py")


def load_module(path, name):
    """A module file imported on its own (for building its model outside TFX)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _float(value):
    return tf.train.Feature(float_list=tf.train.FloatList(value=[value]))


def _int(value):
    return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))


def _write_split(root, split, features):
    """Writes `features` (an iterable of {name: tf.train.Feature}) as ExampleGen's `Split-<split>`."""
    directory = os.path.join(root, f"Split-{split}")
    os.makedirs(directory, exist_ok=True)
    with tf.io.TFRecordWriter(os.path.join(directory, "data.tfrecord.gz"), options="GZIP") as writer:
        for feature in features:
            writer.write(tf.train.Example(features=tf.train.Features(feature=feature)).SerializeToString())


def _examples_artifact(root):
    examples = standard_artifacts.Examples()
    examples.uri = root
    examples.split_names = artifact_utils.encode_split_names(["train", "eval"])
    return examples


def write_examples(root, train=384, evaluation=64):
    rng = np.random.RandomState(0)
    w = rng.randn(4)

    def rows(count):
        for _ in range(count):
            x = rng.randn(4)
            yield {**{f"x{i}": _float(x[i]) for i in range(4)}, "y": _float(np.tanh(x @ w))}

    for split, count in (("train", train), ("eval", evaluation)):
        _write_split(root, split, rows(count))
    return _examples_artifact(root)


def write_sized_examples(root, sizes, evaluation=64):
    """`write_examples`' rows with a float feature `size`: `sizes[i]` for training example i
    (evaluation examples: 1)."""
    rng = np.random.RandomState(0)
    w = rng.randn(4)

    def rows(sizes):
        for size in sizes:
            x = rng.randn(4)
            yield {**{f"x{i}": _float(x[i]) for i in range(4)}, "size": _float(size), "y": _float(np.tanh(x @ w))}

    for split, split_sizes in (("train", sizes), ("eval", [1] * evaluation)):
        _write_split(root, split, rows(split_sizes))
    return _examples_artifact(root)


def write_interactions(root, train=384, evaluation=64, users=40, items=60):
    """(user, item) pairs as int64 features `user`, `item`: each user prefers a few items."""
    rng = np.random.RandomState(0)
    for split, count in (("train", train), ("eval", evaluation)):
        user = rng.randint(0, users, count)
        item = (user * 7 + rng.randint(0, 5, count)) % items
        _write_split(root, split, ({"user": _int(u), "item": _int(i)} for u, i in zip(user, item)))
    return _examples_artifact(root)


def hyperparameters_artifact(root, values):
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "best_hyperparameters.txt"), "w") as f:
        json.dump({"space": [], "values": values}, f)
    artifact = standard_artifacts.HyperParameters()
    artifact.uri = root
    return artifact


def executor_arguments(tmp, examples, num_steps=5, hyperparameters=None, module=MODULE, custom_config=None,
                       **accumulation):
    """(inputs, outputs, exec_properties) of a Trainer execution writing under `tmp`."""
    tmp = str(tmp)
    model, model_run = standard_artifacts.Model(), standard_artifacts.ModelRun()
    model.uri, model_run.uri = os.path.join(tmp, "model"), os.path.join(tmp, "model_run")
    inputs = {"examples": [examples]}
    if hyperparameters is not None:
        inputs["hyperparameters"] = [hyperparameters]
    outputs = {"model": [model], "model_run": [model_run]}
    properties = {
        "train_args": proto_utils.proto_to_json(trainer_pb2.TrainArgs(num_steps=num_steps)),
        "eval_args": proto_utils.proto_to_json(trainer_pb2.EvalArgs(num_steps=2)),
        "module_file": module,
        "custom_config": json_utils.dumps(custom_config),
        **accumulation,
    }
    return inputs, outputs, properties


def run_executor(tmp, examples, num_steps=5, hyperparameters=None, stock=False, module=MODULE,
                 custom_config=None, **accumulation):
    """Runs our executor (or the stock GenericExecutor); returns (outputs, seen, weights)."""
    inputs, outputs, properties = executor_arguments(
        tmp, examples, num_steps, hyperparameters, module, custom_config, **({} if stock else accumulation))
    context = base_executor.BaseExecutor.Context(tmp_dir=os.path.join(str(tmp), "tmp"), unique_id="1")
    executor_class = tfx_executor.GenericExecutor if stock else Executor
    executor_class(context).Do(inputs, outputs, properties)
    seen, weights = read_run(outputs["model_run"][0].uri)
    return outputs, seen, weights


def read_run(model_run_dir):
    """What the test module's run_fn wrote: (seen, final weights)."""
    with open(os.path.join(model_run_dir, "seen.json")) as f:
        seen = json.load(f)
    data = np.load(os.path.join(model_run_dir, "weights.npz"))
    return seen, [data[f"arr_{i}"] for i in range(len(data.files))]


def write_digits_examples(root, evaluation=256):
    """The demo's shipped digits (sklearn's 8x8 images) as ExampleGen would write them."""
    from sklearn.datasets import load_digits

    from tfx_gradient_accumulator.pipelines.digits.data import FEATURE_KEYS, LABEL_KEY

    digits = load_digits()
    splits = {"eval": range(evaluation), "train": range(evaluation, len(digits.target))}
    for split, rows in splits.items():
        _write_split(root, split, ({**{key: _float(digits.data[row][i]) for i, key in enumerate(FEATURE_KEYS)},
                                    LABEL_KEY: _int(digits.target[row])} for row in rows))
    return _examples_artifact(root)
