"""A module file whose run_fn trains on a finite dataset of unknown size, to its end.

Two epochs of the train split read once each (no `repeat`, no `steps_per_epoch`):
`fit` learns an epoch's end only when the data run out. The run_fn writes what it
saw (the batches it trained on, counted by a callback, and the optimizer's
count) and the final weights into model_run_dir for the tests.
"""

import json
import os

import keras
import numpy as np
import tensorflow as tf
from tfx import v1 as tfx
from tfx_bsl.public import tfxio

FEATURES = ["x0", "x1", "x2", "x3"]
LABEL = "y"
BATCH_SIZE = 32
EPOCHS = 2


def _schema():
    from tensorflow_transform.tf_metadata import schema_utils
    spec = {k: tf.io.FixedLenFeature([1], tf.float32) for k in FEATURES + [LABEL]}
    return schema_utils.schema_from_feature_spec(spec)


class _Batches(keras.callbacks.Callback):
    count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


def run_fn(fn_args: tfx.components.FnArgs):
    train = fn_args.data_accessor.tf_dataset_factory(
        fn_args.train_files,
        tfxio.TensorFlowDatasetOptions(batch_size=BATCH_SIZE, label_key=LABEL, shuffle=False, num_epochs=1),
        _schema())
    keras.utils.set_random_seed(0)
    inputs = [keras.layers.Input(shape=(1,), name=k) for k in FEATURES]
    outputs = keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()(inputs)))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
    batches = _Batches()
    model.fit(train, epochs=EPOCHS, verbose=0, callbacks=[batches])
    seen = {
        "cardinality": int(train.cardinality()),
        "train_batch": int(next(iter(train))[1].shape[0]),
        "batches": batches.count,
        "iterations": int(model.optimizer.iterations.numpy()),
        "optimizer": type(model.optimizer).__name__,
    }
    os.makedirs(fn_args.model_run_dir, exist_ok=True)
    with open(os.path.join(fn_args.model_run_dir, "seen.json"), "w") as f:
        json.dump(seen, f)
    np.savez(os.path.join(fn_args.model_run_dir, "weights.npz"), *model.get_weights())
    model.export(fn_args.serving_model_dir)
