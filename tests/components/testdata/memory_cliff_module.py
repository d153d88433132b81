"""A stock-style module file (as `regression_module.py`) whose model has a memory cliff:
its training step runs out of memory from a micro-batch of `custom_config["cliff"]` samples
on (`tests.accumulator.memory_cliff.MemoryCliff`, which changes nothing of the model's
math); without it, the process's `MEMORY_CLIFF` environment variable (a cluster's
workers can differ); no cliff without either. The run_fn sets no accumulation: the Trainer does.

run_fn writes what it saw and the final weights into model_run_dir for the tests.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf
from tfx import v1 as tfx
from tfx_bsl.public import tfxio

from tests.accumulator.memory_cliff import MemoryCliff

FEATURES = ["x0", "x1", "x2", "x3"]
LABEL = "y"


def _schema():
    from tensorflow_transform.tf_metadata import schema_utils
    spec = {k: tf.io.FixedLenFeature([1], tf.float32) for k in FEATURES + [LABEL]}
    return schema_utils.schema_from_feature_spec(spec)


def _input_fn(file_pattern, data_accessor, batch_size):
    return data_accessor.tf_dataset_factory(
        file_pattern, tfxio.TensorFlowDatasetOptions(batch_size=batch_size, label_key=LABEL, shuffle=False),
        _schema()).repeat()


def _make_keras_model(cliff):
    keras.utils.set_random_seed(0)
    inputs = [keras.layers.Input(shape=(1,), name=k) for k in FEATURES]
    x = keras.layers.Concatenate()(inputs)
    if cliff:
        x = MemoryCliff(cliff)(x)
    x = keras.layers.Dense(8, activation="tanh")(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def run_fn(fn_args: tfx.components.FnArgs):
    train = _input_fn(fn_args.train_files, fn_args.data_accessor, 32)
    model = _make_keras_model((fn_args.custom_config or {}).get("cliff") or int(os.environ.get("MEMORY_CLIFF", 0)))
    model.fit(train, steps_per_epoch=fn_args.train_steps, verbose=0)
    os.makedirs(fn_args.model_run_dir, exist_ok=True)
    with open(os.path.join(fn_args.model_run_dir, "seen.json"), "w") as f:
        json.dump({"train_steps": fn_args.train_steps, "train_batch": int(next(iter(train))[1].shape[0]),
                   "accum_steps": getattr(model.optimizer, "accum_steps", None),
                   "iterations": int(model.optimizer.iterations.numpy())}, f)
    np.savez(os.path.join(fn_args.model_run_dir, "weights.npz"), *model.get_weights())
    model.export(fn_args.serving_model_dir)
