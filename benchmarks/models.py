"""The benchmark workloads: models a user recognizes, and the data they train on.

* ``transformer``: a text classifier, token + position embeddings, Transformer
  encoder blocks (multi-head self-attention, GELU feed-forward, LayerNorm,
  dropout), mean pooling, 2 classes.
* ``resnet``: a ResNet-style CNN on 32x32 RGB images (basic residual blocks
  with BatchNormalization, three stages), 10 classes. The accumulator's
  contenders build it with `accumulator.AccumBatchNormalization`, the others
  with Keras' `BatchNormalization`.
* ``wide_mlp``: a wide MLP, ~100 MB of float32 parameters, for peak memory.
* ``tiny_cnn``: a model whose step takes a few ms: it measures the fixed
  per-micro-step overhead, nothing else.

Sizes: the "cpu" variants are sized so that one micro-step takes >= 50 ms on 2
CPU cores (the step time is measured and reported); the "gpu" variants, picked
when TensorFlow sees a GPU, are larger so a GPU step is compute-bound too.
"""

import os

import keras
import numpy as np
from keras import ops

# name -> size -> configuration. `micro` is the micro-batch b.
CONFIGS = {
    "transformer": {
        "cpu": dict(vocab=8192, sequence=128, width=192, heads=3, ff=768, layers=2, micro=16),
        "gpu": dict(vocab=32768, sequence=256, width=512, heads=8, ff=2048, layers=6, micro=32),
    },
    "resnet": {
        "cpu": dict(widths=(24, 48, 96), blocks=2, micro=32),
        "gpu": dict(widths=(64, 128, 256), blocks=3, micro=128),
    },
    "wide_mlp": {
        "cpu": dict(inputs=1024, hidden=(4096, 4096, 1024), micro=32),
        "gpu": dict(inputs=1024, hidden=(4096, 4096, 1024), micro=32),
    },
    "tiny_cnn": {
        "cpu": dict(image=16, filters=16, micro=32),
        "gpu": dict(image=16, filters=16, micro=32),
    },
}


# BENCH_MICRO_BATCH: another micro-batch b for every workload (a GPU run measures one
# that fills the device beside the default); recorded with each result as "micro".
MICRO_BATCH_ENV = "BENCH_MICRO_BATCH"


def config(name, size):
    chosen = dict(CONFIGS[name][size])
    if os.environ.get(MICRO_BATCH_ENV):
        chosen["micro"] = int(os.environ[MICRO_BATCH_ENV])
    return chosen


def describe(name, size):
    """A one-line description of a workload, for the report."""
    c = config(name, size)
    if name == "transformer":
        return (f"Transformer text classifier: {c['layers']} encoder blocks, width {c['width']}, "
                f"{c['heads']} heads, feed-forward {c['ff']}, sequence {c['sequence']}, "
                f"vocabulary {c['vocab']}")
    if name == "resnet":
        return (f"ResNet-style CNN, 32x32x3 images, {c['blocks']} basic blocks per stage, "
                f"widths {'/'.join(map(str, c['widths']))}, BatchNormalization")
    if name == "wide_mlp":
        return f"MLP {c['inputs']}-" + "-".join(map(str, c["hidden"])) + "-10"
    return f"tiny CNN, {c['image']}x{c['image']}x3, 2 conv layers of {c['filters']} filters"


@keras.saving.register_keras_serializable(package="benchmarks")
class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding of each position to the token embeddings."""

    def build(self, input_shape):
        self.positions = self.add_weight(
            name="positions", shape=tuple(input_shape[1:]), initializer="random_normal")

    def call(self, x):
        return x + ops.cast(self.positions, x.dtype)


def transformer(size="cpu", batch_norm=None, seed=0):
    del batch_norm      # no BatchNormalization in a Transformer
    c = config("transformer", size)
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((c["sequence"],), dtype="int32")
    x = keras.layers.Embedding(c["vocab"], c["width"])(tokens)
    x = PositionEmbedding()(x)
    for _ in range(c["layers"]):
        attended = keras.layers.MultiHeadAttention(
            c["heads"], c["width"] // c["heads"], dropout=0.1)(x, x)
        x = keras.layers.LayerNormalization(epsilon=1e-6)(x + keras.layers.Dropout(0.1)(attended))
        hidden = keras.layers.Dense(c["ff"], activation="gelu")(x)
        hidden = keras.layers.Dropout(0.1)(keras.layers.Dense(c["width"])(hidden))
        x = keras.layers.LayerNormalization(epsilon=1e-6)(x + hidden)
    x = keras.layers.GlobalAveragePooling1D()(x)
    return keras.Model(tokens, keras.layers.Dense(2)(x), name="transformer")


def resnet(size="cpu", batch_norm=None, seed=0):
    """`batch_norm`: the BatchNormalization class (Keras' by default)."""
    c = config("resnet", size)
    norm = batch_norm or keras.layers.BatchNormalization
    keras.utils.set_random_seed(seed)

    def conv(x, filters, strides=1, kernel=3):
        return keras.layers.Conv2D(filters, kernel, strides=strides, padding="same",
                                   use_bias=False, kernel_initializer="he_normal")(x)

    images = keras.Input((32, 32, 3))
    x = keras.layers.ReLU()(norm()(conv(images, c["widths"][0])))
    for stage, filters in enumerate(c["widths"]):
        for block in range(c["blocks"]):
            strides = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            y = keras.layers.ReLU()(norm()(conv(x, filters, strides)))
            y = norm()(conv(y, filters))
            if strides != 1 or shortcut.shape[-1] != filters:
                shortcut = norm()(conv(shortcut, filters, strides, kernel=1))
            x = keras.layers.ReLU()(keras.layers.Add()([shortcut, y]))
    x = keras.layers.GlobalAveragePooling2D()(x)
    return keras.Model(images, keras.layers.Dense(10)(x), name="resnet")


def wide_mlp(size="cpu", batch_norm=None, seed=0):
    del batch_norm
    c = config("wide_mlp", size)
    keras.utils.set_random_seed(seed)
    layers = [keras.Input((c["inputs"],))]
    layers += [keras.layers.Dense(units, activation="relu") for units in c["hidden"]]
    return keras.Sequential(layers + [keras.layers.Dense(10)], name="wide_mlp")


def tiny_cnn(size="cpu", batch_norm=None, seed=0):
    del batch_norm
    c = config("tiny_cnn", size)
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((c["image"], c["image"], 3)),
        keras.layers.Conv2D(c["filters"], 3, padding="same", activation="relu"),
        keras.layers.Conv2D(c["filters"], 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10),
    ], name="tiny_cnn")


BUILDERS = {"transformer": transformer, "resnet": resnet, "wide_mlp": wide_mlp, "tiny_cnn": tiny_cnn}
# Models with BatchNormalization, which the accumulator contenders build with
# AccumBatchNormalization.
HAS_BATCH_NORM = {"resnet"}


def build(name, size="cpu", batch_norm=None, seed=0):
    return BUILDERS[name](size, batch_norm=batch_norm, seed=seed)


def data(name, size, samples, seed=0):
    """Random inputs and labels of the right shapes and ranges (throughput does
    not depend on the values)."""
    c = config(name, size)
    rng = np.random.RandomState(seed)
    if name == "transformer":
        x = rng.randint(0, c["vocab"], size=(samples, c["sequence"])).astype("int32")
        return x, rng.randint(0, 2, size=(samples,)).astype("int32")
    if name == "resnet":
        shape = (32, 32, 3)
    elif name == "wide_mlp":
        shape = (c["inputs"],)
    else:
        shape = (c["image"], c["image"], 3)
    x = rng.randn(samples, *shape).astype("float32")
    return x, rng.randint(0, 10, size=(samples,)).astype("int32")


def parameter_bytes(model):
    return int(sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.trainable_variables))
