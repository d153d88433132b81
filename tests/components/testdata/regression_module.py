"""A module file written for the stock TFX Trainer (penguin style), used unchanged.

Besides training and exporting, run_fn writes what it saw (steps, batches,
optimizer, strategy) and the final weights into model_run_dir for the tests.
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
EVAL_BATCH_SIZE = 16


def _schema():
    from tensorflow_transform.tf_metadata import schema_utils
    spec = {k: tf.io.FixedLenFeature([1], tf.float32) for k in FEATURES + [LABEL]}
    return schema_utils.schema_from_feature_spec(spec)


def _input_fn(file_pattern, data_accessor, batch_size):
    return data_accessor.tf_dataset_factory(
        file_pattern,
        tfxio.TensorFlowDatasetOptions(batch_size=batch_size, label_key=LABEL, shuffle=False),
        _schema(),
    ).repeat()


def _make_keras_model():
    keras.utils.set_random_seed(0)
    inputs = [keras.layers.Input(shape=(1,), name=k) for k in FEATURES]
    x = keras.layers.Concatenate()(inputs)
    x = keras.layers.Dense(8, activation="tanh")(x)
    outputs = keras.layers.Dense(1)(x)
    model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(
            keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.7), clipnorm=0.5
        ),
        loss="mse",
    )
    return model


# What a module written for the stock Trainer may construct (custom_config "own_strategy").
OWN_STRATEGIES = {
    "mirrored": lambda: tf.distribute.MirroredStrategy(),           # as TFX's penguin example does
    "one_device": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
    "multi_worker": lambda: tf.distribute.MultiWorkerMirroredStrategy(),
    "default": tf.distribute.get_strategy,
    "central_storage": lambda: tf.distribute.experimental.CentralStorageStrategy(),
}


def run_fn(fn_args: tfx.components.FnArgs):
    train = _input_fn(fn_args.train_files, fn_args.data_accessor, BATCH_SIZE)
    evaluation = _input_fn(fn_args.eval_files, fn_args.data_accessor, EVAL_BATCH_SIZE)
    own = (fn_args.custom_config or {}).get("own_strategy")
    own_strategy = OWN_STRATEGIES["mirrored" if own is True else own]() if own else None
    if own_strategy is not None:
        with own_strategy.scope():
            model = _make_keras_model()
    else:
        model = _make_keras_model()
    extra = (fn_args.custom_config or {}).get("extra_micro_steps", 0)   # for the tests
    multipliers = []      # each batch's logged `lr_multiplier` (custom_config "log_lr_multipliers")
    logged = [keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: multipliers.append((logs or {}).get("lr_multiplier")))
              ] if (fn_args.custom_config or {}).get("log_lr_multipliers") else []
    history = model.fit(train, steps_per_epoch=fn_args.train_steps + extra, callbacks=logged,
                        validation_data=evaluation, validation_steps=fn_args.eval_steps, verbose=0)
    seen = {
        "train_steps": fn_args.train_steps,
        "train_batch": int(next(iter(train))[1].shape[0]),
        "eval_batch": int(next(iter(evaluation))[1].shape[0]),
        "optimizer": type(model.optimizer).__name__,
        "accum_steps": getattr(model.optimizer, "accum_steps", None),
        "partial_window": getattr(model.optimizer, "partial_window", None),
        "merge_duplicate_rows": getattr(model.optimizer, "merge_duplicate_rows", None),
        "iterations": int(model.optimizer.iterations.numpy()),
        "strategy": type(model.distribute_strategy).__name__,
        "own_strategy": type(own_strategy).__name__ if own_strategy is not None else None,
        "own_strategy_replicas": own_strategy.num_replicas_in_sync if own_strategy is not None else None,
    }
    if getattr(model.optimizer, "measure_noise_scale", False):
        # What the optimizer holds, and what `fit` logged at the epoch's end.
        seen.update(
            noise_scale=model.optimizer.noise_scale,
            noise_scale_windows=int(model.optimizer.noise_scale_estimate.window_count),
            noise_scale_smoothing=model.optimizer.noise_scale_smoothing,
            logged_noise_scale=history.history["noise_scale"][-1],
        )
    if logged:
        seen["lr_multipliers"] = [None if m is None else float(m) for m in multipliers]
    os.makedirs(fn_args.model_run_dir, exist_ok=True)
    with open(os.path.join(fn_args.model_run_dir, "seen.json"), "w") as f:
        json.dump(seen, f)
    np.savez(os.path.join(fn_args.model_run_dir, "weights.npz"), *model.get_weights())
    model.export(fn_args.serving_model_dir)
