"""Three models whose loss couples the batch, and their data (small, deterministic).

Each is an ordinary Keras 3 model with its own `compute_loss` on its outputs; the
reference for `GradientCache` is Keras' own `fit` of the same model at the large
batch. Parameters whose true gradient is zero (a candidate tower's output bias
shifts every logit of a row alike, which a softmax ignores) are left out: Adam
turns the rounding noise of such a gradient into full-size steps, in Keras' own
large batch as much as anywhere.
"""

import keras
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.cache import contrastive

USERS, ITEMS, WORDS, FEATURES, TOKENS = 40, 60, 50, 12, 6


class TwoTower(keras.Model):
    """Retrieval with in-batch negatives: user id -> query, item id -> candidate."""

    def __init__(self, dim=8, **kwargs):
        super().__init__(**kwargs)
        self.query = keras.Sequential([keras.layers.Embedding(USERS, 16), keras.layers.Dense(dim)])
        self.candidate = keras.Sequential([keras.layers.Embedding(ITEMS, 16),
                                           keras.layers.Dense(dim, use_bias=False)])

    def call(self, inputs):
        return {"query": self.query(inputs["user"]), "candidate": self.candidate(inputs["item"])}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])


class Clip(keras.Model):
    """CLIP-style: an "image" MLP and a "text" bag of embeddings, with a learned temperature."""

    def __init__(self, dim=8, **kwargs):
        super().__init__(**kwargs)
        self.image = keras.Sequential([keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(dim)])
        self.text = keras.Sequential([keras.layers.Embedding(WORDS, 16), keras.layers.GlobalAveragePooling1D(),
                                      keras.layers.Dense(dim)])
        self.logit_scale = self.add_weight(shape=(), initializer=keras.initializers.Constant(np.log(1 / 0.07)),
                                           name="logit_scale")

    def call(self, inputs):
        return {"image": self.image(inputs["image"]), "text": self.text(inputs["text"])}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return contrastive.symmetric_info_nce(y_pred["image"], y_pred["text"], self.logit_scale)


class SimClr(keras.Model):
    """SimCLR-style: one encoder and projection head over two views of each sample."""

    def __init__(self, dim=8, regularizer=None, **kwargs):
        super().__init__(**kwargs)
        self.encoder = keras.Sequential([
            keras.layers.Dense(16, activation="relu", kernel_regularizer=regularizer),
            keras.layers.LayerNormalization(), keras.layers.Dense(dim)])

    def call(self, inputs):
        return {"first": self.encoder(inputs["first"]), "second": self.encoder(inputs["second"])}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = contrastive.nt_xent(y_pred["first"], y_pred["second"], temperature=0.5)
        return loss + tf.add_n(self.losses) if self.losses else loss


def interactions(samples=256, seed=0):
    rng = np.random.RandomState(seed)
    users = rng.randint(0, USERS, samples)
    return {"user": users.astype("int32"), "item": ((users * 7 + rng.randint(0, 5, samples)) % ITEMS).astype("int32")}


def pairs(samples=256, seed=0):
    rng = np.random.RandomState(seed)
    text = rng.randint(0, WORDS, (samples, TOKENS)).astype("int32")
    image = np.eye(WORDS, FEATURES)[text].mean(1) + 0.1 * rng.randn(samples, FEATURES)
    return {"image": image.astype("float32"), "text": text}


def views(samples=256, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, FEATURES)
    return {"first": (x + 0.1 * rng.randn(*x.shape)).astype("float32"),
            "second": (x + 0.1 * rng.randn(*x.shape)).astype("float32")}


MODELS = {"two_tower": (TwoTower, interactions), "clip": (Clip, pairs), "simclr": (SimClr, views)}


def built(name, seed=1, **kwargs):
    """A fresh model of `MODELS[name]`, built, with weights fixed by `seed`."""
    make, data = MODELS[name]
    keras.utils.set_random_seed(seed)
    model = make(**kwargs)
    model({k: v[:2] for k, v in data(4).items()})
    return model
