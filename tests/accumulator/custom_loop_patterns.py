"""The README's custom loop, and the ways it drifts, each run as a program of its own.

`python custom_loop_patterns.py PATTERN [READ [N]]`: trains the README's model (N samples,
100 by default, in micro-batches of 8, the last of 4, `accum_steps=4`, no `compile`; with
92 the short one shares its window with two of 8) as PATTERN says, then
reads the weights as READ says ("get_weights", "save", "save_weights"; "none": nothing,
the program just ends), and prints one line of JSON: the weights (as trained, before the
read), the micro-batches held and the updates. What the library says goes to stderr (`tests/accumulator/test_custom_loops.py`
reads both back).
"""

import json
import os
import sys
import tempfile

import numpy as np
import keras
import tensorflow as tf

from tfx_gradient_accumulator import GradientAccumulator

MICRO, ACCUM = 8, 4
N = int(sys.argv[3]) if len(sys.argv) > 3 else 100


def data():
    x = np.random.default_rng(0).normal(size=(N, 8)).astype("float32")
    return x, x.sum(axis=1, keepdims=True)


def build_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])


def train(pattern, model, optimizer):
    """One pass over the data in micro-batches, as `pattern` writes the loop."""
    x, y = data()
    loss_fn = keras.losses.MeanSquaredError()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)     # the last of 4

    def step(xb, yb, weighted):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        weight = tf.cast(tf.shape(xb)[0], tf.float32) if weighted else None
        optimizer.apply_gradients(zip(grads, model.trainable_variables), micro_batch_weight=weight)

    if pattern == "weighted_not_closed":           # the README's loop without close_partial_window()
        traced = tf.function(lambda xb, yb: step(xb, yb, weighted=True))
        for start in range(0, N, MICRO):
            traced(x[start:start + MICRO], y[start:start + MICRO])
    elif pattern == "reduce_retracing":            # no micro_batch_weight, traced for any size
        traced = tf.function(lambda xb, yb: step(xb, yb, weighted=False), reduce_retracing=True)
        for start in range(0, N, MICRO):
            traced(x[start:start + MICRO], y[start:start + MICRO])
        optimizer.close_partial_window()
    elif pattern == "dataset_in_one_function":     # no micro_batch_weight, the whole loop traced once
        @tf.function
        def epoch(ds):
            for xb, yb in ds:
                step(xb, yb, weighted=False)

        epoch(dataset)
        optimizer.close_partial_window()
    elif pattern in ("helper", "helper_any_size", "helper_dataset"):   # micro_batches: no weight, no close
        traced = tf.function(lambda xb, yb: step(xb, yb, weighted=False),
                             reduce_retracing=pattern == "helper_any_size")
        batches = dataset if pattern == "helper_dataset" else \
            [(x[s:s + MICRO], y[s:s + MICRO]) for s in range(0, N, MICRO)]
        for xb, yb in optimizer.micro_batches(batches):
            traced(xb, yb)
    elif pattern == "helper_break":                # left after 10 of 13 micro-batches: 2 held
        traced = tf.function(lambda xb, yb: step(xb, yb, weighted=False))
        for i, (xb, yb) in enumerate(optimizer.micro_batches(dataset)):
            traced(xb, yb)
            if i == 9:
                break
    else:
        raise ValueError(f"unknown pattern {pattern!r}")


def main(pattern, read):
    model = build_model()
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), accum_steps=ACCUM)
    train(pattern, model, optimizer)
    ours = [v.numpy() for v in model.weights]       # not get_weights: that is a read under test
    folder = tempfile.mkdtemp()
    if read == "get_weights":
        model.get_weights()
    elif read == "save":
        model.save(os.path.join(folder, "model.keras"))
    elif read == "save_weights":
        model.save_weights(os.path.join(folder, "model.weights.h5"))
    print(json.dumps({"weights": [w.tolist() for w in ours], "held": optimizer.held_micro_batches,
                      "updates": int(optimizer.iterations)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "none")
