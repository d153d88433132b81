"""Conformance on sentence pairs: KerasHub's BERT as users fine-tune it on pairs.

* `BertTextClassifier` on pairs packed by its own preprocessor (token-type ids 0 for the
  first sentence, 1 for the second: per-sample data), through `GradientAccumulator`;
* a sentence-embedding model in sentence-transformers' style: one BERT encoder called on
  anchors, then on positives, with token-type ids of zeros shaped like the batch (a
  constant of the traced program), a per-sample similarity loss through
  `GradientAccumulator` and in-batch negatives (MultipleNegativesRankingLoss) through
  `GradientCache`, with AdamW, CosineDecay, weight decay and `global_clipnorm`.

Each against Keras' own `fit` at the large batch, decided as the conformance suite decides
(tests/accumulator/test_conformance.py). The encoder called twice once lost 3.6e-3 here:
its token-type table's two lookups were taken together for a position table.

KerasHub is installed only in .venv-tf-latest; elsewhere this file is skipped.
"""

import keras
import numpy as np
import pytest

pytest.importorskip("keras_hub", reason="KerasHub is installed only in .venv-tf-latest "
                                        "(constraints/tf-latest-conformance.txt)")

from tfx_gradient_accumulator.accumulator import GradientAccumulator, GradientCache  # noqa: E402
from tfx_gradient_accumulator.accumulator.rows import lookups
from tests.accumulator import conformance_models as cm  # noqa: E402
from tests.accumulator import reference as ref  # noqa: E402
from tests.accumulator.test_conformance import _permuted_inside_batches, assert_within_noise_floor  # noqa: E402

MICRO, N, UPDATES = 8, 4, 3
LARGE = MICRO * N
SAMPLES = LARGE * UPDATES


def _adamw():
    schedule = keras.optimizers.schedules.CosineDecay(1e-2, decay_steps=UPDATES, warmup_target=None)
    return keras.optimizers.AdamW(schedule, weight_decay=0.05, global_clipnorm=1.0)


def _sgd_clipped():
    return keras.optimizers.SGD(0.5, global_clipnorm=0.05)


def _fit(make, optimizer, x, y, batch, loss=None, cache=False, jit_compile="auto"):
    model = make()
    trained = GradientCache(model, N) if cache else model
    trained.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    trained.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


def _assert_like_large_batch(make, optimizer_fn, x, y=None, loss=None, cache=False, jit_compile="auto"):
    expected = _fit(make, optimizer_fn(), x, y, LARGE, loss, jit_compile=jit_compile)
    assert ref.max_abs_diff(expected.get_weights(), make().get_weights()) > 1e-3, "training hardly moved"
    if cache:
        got = _fit(make, optimizer_fn(), x, y, LARGE, loss, cache=True, jit_compile=jit_compile)
    else:
        got = _fit(make, GradientAccumulator(optimizer_fn(), N), x, y, MICRO, loss, jit_compile=jit_compile)
    assert_within_noise_floor(got.get_weights(), expected.get_weights(), [v.path for v in got.weights],
                              lambda seed: _fit(make, optimizer_fn(), *_permuted_inside_batches(x, y, LARGE, seed),
                                                LARGE, loss, jit_compile=jit_compile).get_weights())
    return got


def test_bert_classifier_on_sentence_pairs_with_its_preprocessors_segment_ids():
    x, y = cm.bert_pair_features(SAMPLES)
    assert set(np.unique(x["segment_ids"])) == {0, 1}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    _assert_like_large_batch(cm.bert_pair_classifier, _adamw, x, y, loss)


# SGD + global_clipnorm's cases run apart (`make test-apart`), as KerasHub's SGD cases do
# (test_conformance.py says why AdamW's can catch what they would); so do the XLA cases
# below, whose compiled steps cost minutes on CPU (test_conformance.py keeps BERT and
# keras.io's text layer under XLA in make test).
SGD_APART = pytest.param(_sgd_clipped, id="sgd-global_clipnorm", marks=pytest.mark.apart)


@pytest.mark.parametrize("optimizer_fn", [pytest.param(_adamw, id="adamw"), SGD_APART])
def test_sentence_similarity_one_encoder_called_twice(optimizer_fn):
    x = cm.sentence_ids(SAMPLES)
    y = np.random.RandomState(1).rand(SAMPLES, 1).astype("float32")
    got = _assert_like_large_batch(cm.sentence_similarity, optimizer_fn, x, y, "mse")
    assert isinstance(got.optimizer, GradientAccumulator)     # the accumulated run's own kinds
    assert got.optimizer.gradient_kinds["segment_embedding/embeddings"] == lookups.PER_SAMPLE


# Apart (64 s): the CLIP towers' GradientCache (test_conformance) and test_gradient_cache's
# in-batch negatives run in make test.
@pytest.mark.parametrize("optimizer_fn", [pytest.param(_adamw, id="adamw", marks=pytest.mark.apart), SGD_APART])
def test_gradient_cache_sentence_embedder_with_in_batch_negatives(optimizer_fn):
    _assert_like_large_batch(cm.sentence_embedder, optimizer_fn, cm.sentence_ids(SAMPLES), cache=True)


# Under XLA (`jit_compile=True`, Keras' "auto" on one GPU), both sides compiled: the
# encoder called twice (its token-type table per sample, its position table once per
# batch) through GradientAccumulator, and the in-batch negatives through GradientCache.
@pytest.mark.apart
@pytest.mark.parametrize("optimizer_fn", [_adamw, _sgd_clipped], ids=["adamw", "sgd-global_clipnorm"])
def test_sentence_similarity_one_encoder_called_twice_under_xla(optimizer_fn):
    x = cm.sentence_ids(SAMPLES)
    y = np.random.RandomState(1).rand(SAMPLES, 1).astype("float32")
    _assert_like_large_batch(cm.sentence_similarity, optimizer_fn, x, y, "mse", jit_compile=True)


@pytest.mark.apart
def test_gradient_cache_sentence_embedder_with_in_batch_negatives_under_xla():
    _assert_like_large_batch(cm.sentence_embedder, _adamw, cm.sentence_ids(SAMPLES), cache=True, jit_compile=True)
