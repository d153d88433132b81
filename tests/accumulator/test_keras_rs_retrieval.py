"""GradientCache on a retrieval model as Keras Recommenders (keras-rs) users write one.

keras.io's keras-rs retrieval examples build a two-tower model in a way our own
test models do not: `call` returns only the query tower's embeddings; the candidate
tower runs inside `compute_loss`, on the labels (`y["item_id"]`); the in-batch
softmax puts the positives on the diagonal of the whole batch's scores; the loss is
tracked by the model's own `Mean` metric (its `metrics` property lists only that);
and a `keras_rs.layers.BruteForceRetrieval` layer, built on the candidate table,
serves top-k at inference. The model below is written in that style (user id and a
context flag fused in the query tower, an item table as the candidate tower), on
synthetic interactions.

For `GradientCache`, the candidate tower is then part of the loss: it runs once on
the whole batch in the scoring pass, as the loss's own variables do, and the query
tower in micro-batches. Reference: the same model trained by Keras' own `fit` at the
large batch. Control: plain accumulation, whose micro-batches score their own
negatives only.
"""

import keras
import numpy as np
import pytest

from tfx_gradient_accumulator.accumulator import GradientAccumulator, GradientCache
from tests.accumulator import reference as ref

keras_rs = pytest.importorskip("keras_rs", reason="keras-rs is installed only in .venv-tf-latest "
                               "(constraints/tf-latest-conformance.txt), as a client of the library")

USERS, ITEMS, DIM = 40, 60, 8
BATCH, N = 64, 4
TOLERANCE = 1e-5


class ContextualRetrieval(keras.Model):
    """Query tower: user and context embeddings fused by a Dense layer; candidate
    tower: an item table used in `compute_loss`; top-k by keras-rs at inference."""

    def __init__(self, users, items, dim, **kwargs):
        super().__init__(**kwargs)
        self.user_embedding = keras.layers.Embedding(users, dim)
        self.context_embedding = keras.layers.Embedding(2, dim)
        self.query_dense = keras.layers.Dense(dim, activation="relu")
        self.item_embedding = keras.layers.Embedding(items, dim)
        self.retrieval = keras_rs.layers.BruteForceRetrieval(k=5, return_scores=False)
        self.loss_fn = keras.losses.CategoricalCrossentropy(from_logits=True)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def build(self, input_shape):
        self.item_embedding.build((None,))        # used only in compute_loss
        self.retrieval.candidate_embeddings = self.item_embedding.embeddings
        self.retrieval.build((None, self.query_dense.units))
        super().build(input_shape)

    def call(self, inputs):
        fused = keras.ops.concatenate(
            [self.user_embedding(inputs["uid"]), self.context_embedding(inputs["is_organic"])], axis=1)
        return {"query_embeddings": self.query_dense(fused)}

    def compute_loss(self, x, y, y_pred, sample_weight, training=True):
        queries = y_pred["query_embeddings"]
        candidates = self.item_embedding(y["item_id"])
        scores = keras.ops.matmul(queries, keras.ops.transpose(candidates))
        labels = keras.ops.eye(keras.ops.shape(queries)[0])
        loss = self.loss_fn(labels, scores, sample_weight)
        self.loss_tracker.update_state(loss)
        return loss

    @property
    def metrics(self):
        return [self.loss_tracker]


def interactions(samples=256, seed=0):
    """Users who prefer the items of their cluster, more so in one context."""
    rng = np.random.default_rng(seed)
    uid = rng.integers(0, USERS, samples)
    organic = rng.integers(0, 2, samples)
    item = (uid * 3 + organic * 7 + rng.integers(0, 4, samples)) % ITEMS
    return ({"uid": uid.astype("int32"), "is_organic": organic.astype("int32")},
            {"item_id": item.astype("int32")})


def built(seed=0):
    keras.utils.set_random_seed(seed)
    model = ContextualRetrieval(USERS, ITEMS, DIM)
    model({"uid": np.zeros((1,), "int32"), "is_organic": np.zeros((1,), "int32")})
    return model


def test_a_keras_rs_style_retrieval_model_trains_like_keras_large_batch():
    x, y = interactions()
    initial = built().get_weights()

    expected = built()
    expected.compile(optimizer=keras.optimizers.Adagrad(0.5))
    large = expected.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    inner = built()
    cached = GradientCache(inner, N)
    cached.compile(optimizer=keras.optimizers.Adagrad(0.5))
    history = cached.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)

    assert ref.max_abs_diff(expected.get_weights(), initial) > 1e-2            # it trained
    assert ref.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    # The model's own loss metric saw the whole batches' losses.
    np.testing.assert_allclose(history.history["loss"], large.history["loss"], rtol=1e-5)

    # Control: micro-batches of 16, each scoring its own 15 negatives.
    plain = built()
    plain.compile(optimizer=GradientAccumulator(keras.optimizers.Adagrad(0.5), N))
    plain.fit(x, y, batch_size=BATCH // N, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(plain.get_weights(), expected.get_weights()) > 100 * TOLERANCE

    # Served as the examples serve it: top-k from keras-rs on the trained tables.
    query = inner({"uid": np.array([3], "int32"), "is_organic": np.array([1], "int32")})
    top = keras.ops.convert_to_numpy(inner.retrieval(query["query_embeddings"]))
    reference_top = keras.ops.convert_to_numpy(
        expected.retrieval(expected({"uid": np.array([3], "int32"),
                                     "is_organic": np.array([1], "int32")})["query_embeddings"]))
    assert top.shape == (1, 5) and (top == reference_top).all()
