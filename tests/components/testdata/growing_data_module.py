"""A stock-style module file whose later training examples need more memory: each example
has a `size` feature, and the model's step runs out of memory once the micro-batch times
its largest `size` reaches `custom_config["budget"]` (`tests.accumulator.memory_cliff.SizeCliff`,
which changes nothing of the model's math; no cliff without a budget). The run_fn sets no
accumulation (the Trainer does) and trains as TFX run_fns do: a repeated dataset,
`steps_per_epoch`, two epochs, validation on the eval split, a TensorBoard callback.

run_fn writes what it saw and the final weights into model_run_dir for the tests.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf
from tfx import v1 as tfx
from tfx_bsl.public import tfxio

from tests.accumulator.memory_cliff import SizeCliff

FEATURES = ["x0", "x1", "x2", "x3"]
SIZE = "size"
LABEL = "y"
EPOCHS = 2


def _schema():
    from tensorflow_transform.tf_metadata import schema_utils
    spec = {k: tf.io.FixedLenFeature([1], tf.float32) for k in FEATURES + [SIZE, LABEL]}
    return schema_utils.schema_from_feature_spec(spec)


def _input_fn(file_pattern, data_accessor, batch_size):
    return data_accessor.tf_dataset_factory(
        file_pattern, tfxio.TensorFlowDatasetOptions(batch_size=batch_size, label_key=LABEL, shuffle=False),
        _schema()).repeat()


def _make_keras_model(budget):
    keras.utils.set_random_seed(0)
    inputs = {k: keras.layers.Input(shape=(1,), name=k) for k in FEATURES + [SIZE]}
    x = keras.layers.Concatenate()([inputs[k] for k in FEATURES])
    x = SizeCliff(budget)([x, inputs[SIZE]])
    x = keras.layers.Dense(8, activation="tanh")(x)
    model = keras.Model(inputs, keras.layers.Dense(1)(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
    return model


def run_fn(fn_args: tfx.components.FnArgs):
    train = _input_fn(fn_args.train_files, fn_args.data_accessor, 32)
    evaluation = _input_fn(fn_args.eval_files, fn_args.data_accessor, 32)
    model = _make_keras_model((fn_args.custom_config or {}).get("budget"))
    tensorboard = keras.callbacks.TensorBoard(log_dir=os.path.join(fn_args.model_run_dir, "logs"))
    history = model.fit(train, epochs=EPOCHS, steps_per_epoch=fn_args.train_steps // EPOCHS, verbose=0,
                        validation_data=evaluation, validation_steps=fn_args.eval_steps, callbacks=[tensorboard])
    os.makedirs(fn_args.model_run_dir, exist_ok=True)
    with open(os.path.join(fn_args.model_run_dir, "seen.json"), "w") as f:
        json.dump({"train_steps": fn_args.train_steps, "train_batch": int(next(iter(train))[1].shape[0]),
                   "accum_steps": getattr(model.optimizer, "accum_steps", None),
                   "iterations": int(model.optimizer.iterations.numpy()),
                   "epochs": list(history.epoch), "val_loss": history.history.get("val_loss", [])}, f)
    np.savez(os.path.join(fn_args.model_run_dir, "weights.npz"), *model.get_weights())
    model.export(fn_args.serving_model_dir)
