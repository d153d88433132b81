"""A run_fn that trains in its own GradientTape loop and never calls `compile`."""

import keras
import numpy as np
import tensorflow as tf


def run_fn(fn_args):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    optimizer = keras.optimizers.SGD(0.1)
    x, y = np.random.RandomState(0).randn(32, 4).astype("float32"), np.zeros((32, 1), "float32")
    for _ in range(2):
        with tf.GradientTape() as tape:
            loss = keras.losses.mean_squared_error(y, model(x))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
    model.export(fn_args.serving_model_dir)
