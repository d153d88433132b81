"""The two-tower retrieval module (in-batch softmax) written with Keras 2, as a TFX user
running `TF_USE_LEGACY_KERAS=1` writes it (`tf.keras` is then `tf_keras`, imported here
by that name so the test needs no process-wide switch), for
AccumulatingTrainer(gradient_cache=True).

The same model as `two_tower_module.py`: user id -> query tower, item id -> candidate
tower, each query's softmax over every candidate of the batch; `run_fn` wraps it in
`GradientCache(two_tower, accum_steps=1)` (the Keras 2 class, chosen from the model).
custom_config: `plain` trains the model unwrapped (the stock Trainer's reference).
"""

import json
import os

import numpy as np
import tensorflow as tf
import tf_keras as keras
from tfx import v1 as tfx
from tfx_bsl.public import tfxio

from tfx_gradient_accumulator.accumulator import GradientCache
from tfx_gradient_accumulator.accumulator.cache import contrastive

USERS, ITEMS = 40, 60
BATCH_SIZE = 32
EVAL_BATCH_SIZE = 16


class TwoTower(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.query = keras.Sequential([keras.layers.Embedding(USERS, 16), keras.layers.Dense(8)])
        self.candidate = keras.Sequential([keras.layers.Embedding(ITEMS, 16),
                                           keras.layers.Dense(8, use_bias=False)])

    def call(self, inputs):
        return {"query": self.query(tf.reshape(inputs["user"], [-1])),
                "candidate": self.candidate(tf.reshape(inputs["item"], [-1]))}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        return contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])


def _schema():
    from tensorflow_transform.tf_metadata import schema_utils
    return schema_utils.schema_from_feature_spec(
        {k: tf.io.FixedLenFeature([1], tf.int64) for k in ("user", "item")})


def _input_fn(file_pattern, data_accessor, batch_size):
    return data_accessor.tf_dataset_factory(
        file_pattern, tfxio.TensorFlowDatasetOptions(batch_size=batch_size, shuffle=False), _schema()
    ).repeat()


def _two_tower():
    keras.utils.set_random_seed(0)
    model = TwoTower()
    model({"user": tf.zeros([2, 1], tf.int64), "item": tf.zeros([2, 1], tf.int64)})
    return model


def run_fn(fn_args: tfx.components.FnArgs):
    config = fn_args.custom_config or {}
    train = _input_fn(fn_args.train_files, fn_args.data_accessor, config.get("batch_size", BATCH_SIZE))
    evaluation = _input_fn(fn_args.eval_files, fn_args.data_accessor, EVAL_BATCH_SIZE)
    two_tower = _two_tower()
    model = two_tower if config.get("plain") else GradientCache(two_tower, accum_steps=1)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    model.fit(train, steps_per_epoch=fn_args.train_steps, validation_data=evaluation,
              validation_steps=fn_args.eval_steps, verbose=0)
    seen = {
        "train_steps": fn_args.train_steps,
        "train_batch": int(next(iter(train))["user"].shape[0]),
        "model": type(model).__name__,
        "keras2": isinstance(model, keras.Model),
        "accum_steps": getattr(model, "accum_steps", None),
        "optimizer": type(model.optimizer).__name__,
        "iterations": int(model.optimizer.iterations.numpy()),
        "accumulation": config.get("accumulation"),
    }
    os.makedirs(fn_args.model_run_dir, exist_ok=True)
    with open(os.path.join(fn_args.model_run_dir, "seen.json"), "w") as f:
        json.dump(seen, f)
    np.savez(os.path.join(fn_args.model_run_dir, "weights.npz"), *two_tower.get_weights())
    query = tf.function(lambda user: two_tower.query(user), input_signature=[tf.TensorSpec([None], tf.int64)])
    candidate = tf.function(lambda item: two_tower.candidate(item),
                            input_signature=[tf.TensorSpec([None], tf.int64)])
    tf.saved_model.save(two_tower, fn_args.serving_model_dir,
                        signatures={"query": query, "candidate": candidate})
