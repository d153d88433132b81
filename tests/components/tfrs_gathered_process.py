"""The retrieval demo's TensorFlow Recommenders module through `AccumulatingTrainer`, on
2 replicas with `gather_across_replicas=1` and on one device, in a process of its own.

TFRS needs `tf.keras` to be Keras 2 (`TF_USE_LEGACY_KERAS=1` before TensorFlow is first
imported), which the test process, on Keras 3, cannot give it. The module file runs
unchanged (`pipelines/retrieval/tfrs_model.py`): it wraps its `tfrs.Model` in
GradientCache, with a Retrieval task whose loss is the batch's mean.

Runs, each for UPDATES updates of E = 64 in 4 micro-batches:
  large:    one device, accum_steps=1: TFRS's own step on the batch of 64 (the reference);
  one:      one device;
  gathered: MirroredStrategy on 2 logical CPUs, gather_across_replicas=1;
  alone:    the same 2 replicas without gathering (the control: tf_keras refuses a
            mean loss inside a replica, as the module's docstring says).
Prints one JSON line: the max |difference| of every user's and item's embedding (the
exported `query` and `candidate` signatures, functions of every trained weight) of
gathered and of one from large, how far large moved from the initial towers, what each run recorded,
and the control's error.

    TF_USE_LEGACY_KERAS=1 python -m tests.components.tfrs_gathered_process OUTPUT_DIR
"""

import json
import os
import sys

os.environ["TF_USE_LEGACY_KERAS"] = "1"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.set_logical_device_configuration(tf.config.list_physical_devices("CPU")[0],
                                           [tf.config.LogicalDeviceConfiguration()] * 2)

from tfx.dsl.components.base import base_executor  # noqa: E402

from tests.components import fixtures  # noqa: E402
from tfx_gradient_accumulator.components.executor import Executor  # noqa: E402
from tfx_gradient_accumulator.pipelines.retrieval import data, tfrs_model  # noqa: E402

UPDATES = 4
SETTINGS = dict(gradient_cache=1, accum_steps=4, effective_batch_size=64)


def _examples(root):
    users, items = data.interactions(count=512)
    train, evaluation = slice(0, 448), slice(448, None)
    for split, rows in (("train", train), ("eval", evaluation)):
        fixtures._write_split(root, split, ({data.USER_KEY: fixtures._int(int(u)), data.ITEM_KEY: fixtures._int(int(i))}
                                            for u, i in zip(users[rows], items[rows])))
    return fixtures._examples_artifact(root)


def _train(tmp, examples, **settings):
    # The module's input_fn shuffles (with an op seed) before its build_model sets the
    # global seed, so a process's first run would read another order than its later
    # ones: every run starts from the same global seed.
    tf.random.set_seed(0)
    inputs, outputs, properties = fixtures.executor_arguments(tmp, examples, UPDATES, module=tfrs_model.__file__,
                                                              **{**SETTINGS, **settings})
    context = base_executor.BaseExecutor.Context(tmp_dir=os.path.join(tmp, "tmp"), unique_id="1")
    Executor(context).Do(inputs, outputs, properties)
    model = outputs["model"][0]
    recorded = {name: model.get_int_custom_property(name)
                for name in ("gather_across_replicas", "replicas", "gradient_cache", "accum_steps")}
    with open(os.path.join(outputs["model_run"][0].uri, tfrs_model.TRAINED_FILE)) as f:
        trained = json.load(f)
    return _embeddings(os.path.join(model.uri, "Format-Serving")), recorded, trained


def _embeddings(serving_dir):
    loaded = tf.saved_model.load(serving_dir)
    return [loaded.query(tf.range(data.USERS, dtype=tf.int64)).numpy(),
            loaded.candidate(tf.range(data.ITEMS, dtype=tf.int64)).numpy()]


def _initial_embeddings():
    model = tfrs_model.build_model().model
    return [model.query_model(tf.range(data.USERS, dtype=tf.int64)).numpy(),
            model.candidate_model(tf.range(data.ITEMS, dtype=tf.int64)).numpy()]


def _max_diff(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def main(output_dir):
    examples = _examples(os.path.join(output_dir, "examples"))
    large, _, _ = _train(os.path.join(output_dir, "large"), examples, accum_steps=1)
    one, one_recorded, trained = _train(os.path.join(output_dir, "one"), examples)
    gathered, gathered_recorded, _ = _train(os.path.join(output_dir, "gathered"), examples,
                                            strategy="mirrored", gather_across_replicas=1)
    try:
        _train(os.path.join(output_dir, "alone"), examples, strategy="mirrored")
        control = None
    except Exception as error:  # noqa: BLE001 - the control's refusal is its result
        control = f"{type(error).__name__}: {error}"
    print(json.dumps({"gathered": _max_diff(gathered, large), "one": _max_diff(one, large),
                      "moved": _max_diff(large, _initial_embeddings()),
                      "one_recorded": one_recorded, "gathered_recorded": gathered_recorded, "trained": trained,
                      "control": control}))


if __name__ == "__main__":
    main(sys.argv[1])
