"""The three tasks of the AutoAccumulation benchmark: data, models, budgets (`benchmarks/auto_batch_tasks.md`).

* ``digits`` (tuned on): the demo's digits CNN on the 8x8 digits, half of them validating;
* ``text`` (tuned on): a small causal language model on synthetic trigram text, loss per sequence;
* ``pydoc`` (held out, never tuned on): a byte-level causal language model, one pass over
  the Python language reference that ships with CPython (`pydoc_data.topics`).

The recipes are fixed in `benchmarks/auto_batch_tasks.md`, written before any run.
TensorFlow is imported inside the functions (the report imports nothing of this).
"""

import hashlib
import math
import sys

# Per task: micro-batch, smallest and largest effective batch, lr0 at the smallest, passes over the training set.
SETTINGS = {
    "digits": {"micro": 16, "start": 32, "max": 256, "lr0": 7e-3, "epochs": 12},
    "text": {"micro": 16, "start": 32, "max": 256, "lr0": 1e-2, "epochs": 5},
    "pydoc": {"micro": 16, "start": 32, "max": 256, "lr0": 3e-3, "epochs": 1},
}
HELD_OUT = ("pydoc",)
TEXT = {"vocab": 32, "length": 24, "train": 8192, "val": 512, "width": 64, "concentration": 0.1}
PYDOC = {"length": 32, "width": 64, "dilations": (1, 2, 4), "train_share": 0.9,
         "python": "3.11.7", "bytes": 466_273,
         "sha256": "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"}


def digits_data():
    """(train features, train labels, val features, val labels): 899 training, 898 validation digits."""
    import numpy as np
    from sklearn.datasets import load_digits

    from tfx_gradient_accumulator.pipelines.digits.data import FEATURE_KEYS

    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    cut = (len(order) + 1) // 2
    images, labels = digits.data.astype("float32"), digits.target.astype("int64")[:, None]

    def features(rows):
        return {key: images[rows, i:i + 1] for i, key in enumerate(FEATURE_KEYS)}

    return features(order[:cut]), labels[order[:cut]], features(order[cut:]), labels[order[cut:]]


def text_data(vocab=TEXT["vocab"], length=TEXT["length"], train=TEXT["train"], val=TEXT["val"],
              concentration=TEXT["concentration"], seed=1234):
    """Sequences from a fixed random trigram source: (train x, train y, val x, val y, entropy rate in nats).

    Every pair of tokens has its own next-token distribution, drawn once from a
    Dirichlet(`concentration`) (peaked: the text is learnable, not deterministic);
    y is x shifted by one token."""
    import numpy as np
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(vocab, concentration), size=(vocab, vocab))
    cumulative = table.cumsum(-1)
    n = train + val
    tokens = np.zeros((n, length + 1), dtype="int32")
    tokens[:, :2] = rng.integers(0, vocab, size=(n, 2))
    for t in range(2, length + 1):
        u = rng.random(n)[:, None]
        rows = cumulative[tokens[:, t - 2], tokens[:, t - 1]]
        tokens[:, t] = np.minimum((u > rows).sum(-1), vocab - 1)
    entropy = float(-(table * np.log(np.maximum(table, 1e-12))).sum(-1).mean())
    x, y = tokens[:, :-1], tokens[:, 1:]
    return x[:train], y[:train], x[train:], y[train:], entropy


def text_model(vocab=TEXT["vocab"], width=TEXT["width"], length=TEXT["length"]):
    """A small causal language model: embedding, two causal convolutions, next-token logits."""
    import keras
    inputs = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, width)(inputs)
    x = keras.layers.Conv1D(width, 3, padding="causal", activation="relu")(x)
    x = keras.layers.Conv1D(width, 3, padding="causal", activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(vocab)(x))


def pydoc_bytes():
    """(the language reference's text as UTF-8 bytes, its sha256, this Python's version)."""
    from pydoc_data.topics import topics
    data = "\n\n".join(topics[k] for k in sorted(topics)).encode("utf-8")
    return data, hashlib.sha256(data).hexdigest(), ".".join(map(str, sys.version_info[:3]))


def byte_windows(data, length):
    """(x, y): consecutive windows of `length` + 1 bytes taken every `length` bytes; y is x shifted by one."""
    import numpy as np
    array = np.frombuffer(data, dtype="uint8").astype("int32")
    n = (len(array) - 1) // length
    x = np.stack([array[i * length:(i + 1) * length] for i in range(n)])
    y = np.stack([array[i * length + 1:(i + 1) * length + 1] for i in range(n)])
    return x, y


def pydoc_data(length=PYDOC["length"], train_share=PYDOC["train_share"]):
    """(train x, train y, val x, val y, facts): the first 90% of the bytes train, the contiguous rest validates."""
    data, digest, python = pydoc_bytes()
    cut = int(train_share * len(data))
    x, y = byte_windows(data[:cut], length)
    x_val, y_val = byte_windows(data[cut:], length)
    facts = {"python": python, "bytes": len(data), "sha256": digest, "as_fixed": digest == PYDOC["sha256"]}
    return x, y, x_val, y_val, facts


def pydoc_model(length=PYDOC["length"], width=PYDOC["width"], dilations=PYDOC["dilations"]):
    """A byte-level causal language model: embedding, residual dilated causal convolutions, 256 logits."""
    import keras
    inputs = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(256, width)(inputs)
    for d in dilations:
        x = keras.layers.Add()([x, keras.layers.Conv1D(width, 3, padding="causal", dilation_rate=d,
                                                       activation="relu")(x)])
    return keras.Model(inputs, keras.layers.Dense(256)(x))


def _description(name, facts):
    if name == "digits":
        return ("the demo's digits CNN (2 convolutions with AccumBatchNormalization, 64 per-pixel inputs) on the "
                "8x8 digits: 899 training, 898 validation images")
    if name == "text":
        return (f"a causal language model (embedding {TEXT['width']}, two causal convolutions of width 3, "
                f"{TEXT['vocab']}-token vocabulary) on synthetic text from a fixed random trigram source: "
                f"{TEXT['train']:,} training and {TEXT['val']:,} validation sequences of {TEXT['length']} tokens "
                f"(entropy rate {facts['entropy']:.3f} nats/token, the lowest loss possible), loss per sequence")
    return (f"**held out**: a byte-level causal language model (embedding {PYDOC['width']}, residual causal "
            f"convolutions of width 3 dilated {', '.join(map(str, PYDOC['dilations']))}) on the Python language "
            f"reference shipped with CPython {facts['python']} (`pydoc_data.topics`, {facts['bytes']:,} bytes"
            + ("" if facts["as_fixed"] else ", **not the text fixed in auto_batch_tasks.md**")
            + f"): one pass over the first 90% in sequences of {PYDOC['length']} bytes, the contiguous rest "
            "validating, loss per sequence")


class Task:
    """The data, the model, the loss and the budget of one task.

    Args:
        name: "digits", "text" or "pydoc".
        budget_share: the share of the task's budget to train (1.0; --quick: a fifth).
        epochs: passes over the training set in place of the task's own (None: its own).
    """

    def __init__(self, name: str, budget_share: float = 1.0, epochs=None):
        import keras
        if name not in SETTINGS:
            raise ValueError(f"task must be one of {sorted(SETTINGS)}; received {name!r}")
        self.name = name
        self.settings = dict(SETTINGS[name])
        self.facts = {}
        if name == "digits":
            self.x, self.y, self.x_val, self.y_val = digits_data()
            self.loss = keras.losses.SparseCategoricalCrossentropy()
        elif name == "text":
            self.x, self.y, self.x_val, self.y_val, entropy = text_data()
            self.facts["entropy"] = entropy
            self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        else:
            self.x, self.y, self.x_val, self.y_val, self.facts = pydoc_data()
            self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        self.description = _description(name, self.facts)
        self.train_size = len(self.y)
        largest = self.settings["max"]
        passes = (epochs or self.settings["epochs"]) * budget_share
        # One pass (pydoc) must not repeat a sequence: round down there, to the nearest elsewhere.
        units = passes * self.train_size / largest
        self.budget = largest * max(1, math.floor(units) if self.settings["epochs"] == 1 else round(units))

    def build(self):
        """A fresh model (the seed set before)."""
        if self.name == "digits":
            import keras_tuner

            from tfx_gradient_accumulator.pipelines.digits.model import build_model
            hp = keras_tuner.HyperParameters()
            hp.Fixed("learning_rate", self.settings["lr0"])
            return build_model(hp)
        return text_model() if self.name == "text" else pydoc_model()

    def dataset(self, seed: int):
        """The training set shuffled by `seed`, repeated, at the micro-batch."""
        import tensorflow as tf
        return (tf.data.Dataset.from_tensor_slices((self.x, self.y))
                .shuffle(self.train_size, seed=seed, reshuffle_each_iteration=True).repeat()
                .batch(self.settings["micro"], drop_remainder=True).prefetch(2))

    def batches(self) -> list:
        """The fixed effective batches: from the smallest to the largest, doubling."""
        out, e = [], self.settings["start"]
        while e <= self.settings["max"]:
            out.append(e)
            e *= 2
        return out

    def lr(self, effective: int) -> float:
        """The square-root rule's learning rate at `effective` (lr0 at the smallest batch)."""
        return self.settings["lr0"] * math.sqrt(effective / self.settings["start"])

    def record(self) -> dict:
        """What the report states of the task."""
        return {"description": self.description, "settings": self.settings, "budget": self.budget,
                "train_size": self.train_size, "val_size": len(self.y_val), "facts": self.facts,
                "held_out": self.name in HELD_OUT}
