"""The ways to train with an effective batch of N*b, built side by side.

Each contender is a `train(steps)` closure that runs `steps` optimizer updates
worth of data on one model; all see the same data and models.
"""

import keras
import numpy as np
import tensorflow as tf

from accumulator import GradientAccumulator

IMAGE = 24
SEQUENCE, FEATURES = 32, 32
WIDE = 256


def cnn():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((IMAGE, IMAGE, 3)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(64, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ])


def attention_mlp():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((SEQUENCE, FEATURES))
    x = keras.layers.MultiHeadAttention(4, 16)(inputs, inputs)
    x = keras.layers.LayerNormalization()(x + inputs)
    x = keras.layers.Dense(128, activation="gelu")(x)
    x = keras.layers.Dense(FEATURES)(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(inputs, keras.layers.Dense(10)(x))


def wide_mlp():
    """Parameters (about 13 MB) that dwarf the noise of resident-memory readings."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((WIDE,)),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(1024, activation="relu"),
        keras.layers.Dense(10),
    ])


MODELS = {"cnn": cnn, "attention_mlp": attention_mlp, "wide_mlp": wide_mlp}


def data(model_name, samples, seed=0):
    rng = np.random.RandomState(seed)
    shape = {"cnn": (IMAGE, IMAGE, 3), "attention_mlp": (SEQUENCE, FEATURES), "wide_mlp": (WIDE,)}[model_name]
    x = rng.randn(samples, *shape).astype("float32")
    y = rng.randint(0, 10, size=(samples,)).astype("int32")
    return x, y


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat().prefetch(2)


def _fit_contender(model, optimizer, x, y, batch, micro_steps_per_update):
    model.compile(optimizer=optimizer, loss=_loss())
    dataset = _dataset(x, y, batch)

    def train(updates):
        model.fit(dataset, steps_per_epoch=updates * micro_steps_per_update, epochs=1, verbose=0)

    return model, train


def _tape_contender(model, x, y, micro, accum):
    """The seeds' loop: sum micro-batch gradients in buffers, apply every N."""
    optimizer = keras.optimizers.Adam(1e-3)
    loss_fn = _loss()
    variables = model.trainable_variables
    optimizer.build(variables)
    buffers = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
    iterator = iter(_dataset(x, y, micro))

    @tf.function
    def update():
        for _ in tf.range(accum):
            xb, yb = next(iterator)
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            for buf, g in zip(buffers, tape.gradient(loss, variables)):
                buf.assign_add(g)
        optimizer.apply_gradients([(buf / accum, v) for buf, v in zip(buffers, variables)])
        for buf in buffers:
            buf.assign(tf.zeros_like(buf))

    def train(updates):
        for _ in range(updates):
            update()

    return model, train


def build(name, model_name, micro, accum, x, y):
    """Returns (model, train(updates)) for a contender at effective batch accum*micro.

    `train(updates)` always processes updates * accum * micro samples.
    """
    model = MODELS[model_name]()
    if name == "plain_b":           # no accumulation, batch b: the speed peer (N updates per N*b)
        return _fit_contender(model, keras.optimizers.Adam(1e-3), x, y, micro, accum)
    if name == "plain_Nb":          # the big batch itself (needs N times the memory)
        return _fit_contender(model, keras.optimizers.Adam(1e-3), x, y, micro * accum, 1)
    if name == "accumulator":
        return _fit_contender(model, GradientAccumulator(keras.optimizers.Adam(1e-3), accum), x, y, micro, accum)
    if name == "keras_builtin":
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accum if accum > 1 else None)
        return _fit_contender(model, optimizer, x, y, micro, accum)
    if name == "seeds_tape_loop":
        return _tape_contender(model, x, y, micro, accum)
    raise ValueError(f"unknown contender {name!r}")


CONTENDERS = ["plain_b", "plain_Nb", "accumulator", "keras_builtin", "seeds_tape_loop"]
