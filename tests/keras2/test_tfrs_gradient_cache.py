"""GradientCache on a TensorFlow Recommenders model, unchanged: like TFRS's own large batch.

The model is TFRS's retrieval tutorial's (StringLookup + Embedding towers, a
`tfrs.tasks.Retrieval` with `FactorizedTopK` over the candidates), on synthetic
interactions. Reference: the same model trained by TFRS's own `fit` at the large
batch; control: plain accumulation of micro-batches (each with its own
negatives), which lands elsewhere, so the comparison can fail.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, GradientCache
from tfx_gradient_accumulator.accumulator.core import flavours
from tests import deltas

tfrs = pytest.importorskip("tensorflow_recommenders", reason="TensorFlow Recommenders is installed "
                           "in the Keras 2 on TensorFlow 2.21 environment only")
k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None or not issubclass(tfrs.models.Model, k2.Model),
                                reason="TFRS needs tf.keras to be Keras 2 (TF_USE_LEGACY_KERAS=1)")

BATCH, N = 32, 4
TOLERANCE = 1e-5
USERS = [f"user{i}" for i in range(30)]
MOVIES = [f"movie{i}" for i in range(40)]


def interactions(samples=192, seed=0):
    rng = np.random.RandomState(seed)
    user = rng.randint(0, len(USERS), samples)
    movie = (user * 3 + rng.randint(0, 4, samples)) % len(MOVIES)
    return {"user_id": np.array(USERS)[user], "movie_title": np.array(MOVIES)[movie],
            "weight": rng.uniform(0.5, 1.5, samples).astype("float32"),
            "probability": rng.uniform(0.01, 0.1, samples).astype("float32")}


class MovielensModel(tfrs.Model if tfrs else object):
    """The tutorial's model; `options` adds the Retrieval task's keyword arguments."""

    def __init__(self, user_model, movie_model, task, options=False):
        super().__init__()
        self.movie_model = movie_model
        self.user_model = user_model
        self.task = task
        self.options = options

    def compute_loss(self, features, training=False):
        user_embeddings = self.user_model(features["user_id"])
        movie_embeddings = self.movie_model(features["movie_title"])
        if not self.options:
            return self.task(user_embeddings, movie_embeddings)
        # "int": the candidates' ids as the tower's lookup gives them (ids that can be
        # gathered across replicas; strings cannot).
        ids = self.movie_model.layers[0](features["movie_title"]) if self.options == "int" else features["movie_title"]
        return self.task(user_embeddings, movie_embeddings, sample_weight=features["weight"],
                         candidate_sampling_probability=features["probability"], candidate_ids=ids)


def tutorial_model(options=False, regularizer=None, loss=None):
    def tower(vocabulary, seed):
        return k2.Sequential([
            k2.layers.StringLookup(vocabulary=vocabulary, mask_token=None),
            k2.layers.Embedding(len(vocabulary) + 1, 8, embeddings_regularizer=regularizer,
                                embeddings_initializer=k2.initializers.RandomUniform(seed=seed))])

    user_model, movie_model = tower(USERS, 1), tower(MOVIES, 2)
    ids_of = movie_model.layers[0] if options == "int" else tf.identity
    candidates = tf.data.Dataset.from_tensor_slices(MOVIES).batch(16).map(lambda ids: (ids_of(ids), movie_model(ids)))
    task = tfrs.tasks.Retrieval(metrics=tfrs.metrics.FactorizedTopK(candidates=candidates, ks=(1, 5, 10)),
                                remove_accidental_hits=bool(options), loss=loss)
    return MovielensModel(user_model, movie_model, task, options=options)


def train(model, batch, optimizer, epochs=2):
    model.compile(optimizer=optimizer)
    data = tf.data.Dataset.from_tensor_slices(interactions()).batch(batch)
    history = model.fit(data, epochs=epochs, verbose=0)
    return {name: values[-1] for name, values in history.history.items()}


def assert_like_tfrs_large_batch(batch=BATCH, **kwargs):
    expected = tutorial_model(**kwargs)
    expected_logs = train(expected, batch, k2.optimizers.Adagrad(0.1))
    inner = tutorial_model(**kwargs)
    cache = GradientCache(inner, N)
    logs = train(cache, batch, k2.optimizers.Adagrad(0.1))
    assert deltas.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    assert set(logs) == set(expected_logs)
    for name in ("loss", "regularization_loss", "total_loss"):
        np.testing.assert_allclose(logs[name], expected_logs[name], rtol=1e-5, atol=1e-6)
    # Top-k accuracies count hits among the k best scores: a tie between two
    # candidates' scores, broken differently by rounding, can move one hit.
    for name in set(logs) - {"loss", "regularization_loss", "total_loss"}:
        assert abs(logs[name] - expected_logs[name]) <= 2 / len(interactions()["user_id"]), name
    # evaluate() is TFRS's own on the trained model (a tfrs.Model has no call()).
    data = tf.data.Dataset.from_tensor_slices(interactions()).batch(batch)
    evaluated = cache.evaluate(data, return_dict=True, verbose=0)
    expected_evaluated = expected.evaluate(data, return_dict=True, verbose=0)
    assert set(evaluated) == set(expected_evaluated)
    for name, value in expected_evaluated.items():
        np.testing.assert_allclose(evaluated[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    control = tutorial_model(**kwargs)
    train(control, batch // N, GradientAccumulator(k2.optimizers.Adagrad(0.1), N))
    assert deltas.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-3
    assert deltas.max_abs_diff(expected.get_weights(), initial(**kwargs).get_weights()) > 1e-2  # it trained


def initial(**kwargs):
    """The model as training starts: its towers built, its weights as initialized."""
    model = tutorial_model(**kwargs)
    model.compute_loss(interactions(samples=2))
    return model


@pytest.mark.apart   # 44 s; the options test trains this model with the options, the uneven one without
def test_the_tutorial_model_trains_like_tfrs_large_batch():
    assert_like_tfrs_large_batch()


def test_the_retrieval_task_options_are_honoured():
    """sample_weight, candidate_sampling_probability, candidate_ids with
    remove_accidental_hits: each scored on the whole batch."""
    assert_like_tfrs_large_batch(options=True)


def test_uneven_micro_batches_and_a_short_last_batch():
    """Batches of 30 in micro-batches of 8, 8, 8, 6; the epoch's last batch has 12."""
    assert_like_tfrs_large_batch(batch=30)


@pytest.mark.apart   # 28 s; the two-replica tests below add a regularizer and compare its logged loss too
def test_weight_regularization_is_added_and_logged_as_tfrs_does():
    assert_like_tfrs_large_batch(regularizer=k2.regularizers.l2(1e-3))


class TwoTasks(tfrs.Model if tfrs else object):
    def __init__(self):
        super().__init__()
        self.first = tfrs.tasks.Retrieval()
        self.second = tfrs.tasks.Retrieval()


class RankingModel(tfrs.Model if tfrs else object):
    def __init__(self):
        super().__init__()
        self.task = tfrs.tasks.Ranking()


@pytest.mark.parametrize("make, message", [(TwoTasks, "exactly one task"),
                                           (RankingModel, "only tfrs.tasks.Retrieval")])
def test_refuses_what_it_does_not_support(make, message):
    with pytest.raises(ValueError, match=message):
        GradientCache(make(), N)


class ScaledLoss(MovielensModel):
    def compute_loss(self, features, training=False):
        return 2.0 * super().compute_loss(features, training)


def test_refuses_a_compute_loss_that_changes_the_task_loss():
    model = tutorial_model()
    model = ScaledLoss(model.user_model, model.movie_model, model.task)
    cache = GradientCache(model, N)
    cache.compile(optimizer=k2.optimizers.Adagrad(0.1))
    with pytest.raises(ValueError, match="the task's loss as it is"):
        cache.fit(tf.data.Dataset.from_tensor_slices(interactions()).batch(BATCH), verbose=0)


def two_replicas():
    """Two replicas in this process (tests/conftest.py makes 2 logical CPUs);
    ReductionToOneDevice, as two collective-ops strategies in one process collide."""
    return tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"],
                                          cross_device_ops=tf.distribute.ReductionToOneDevice())


def test_under_mirrored_strategy_like_tfrs_under_the_same_strategy():
    """Two replicas, batches of 32: TFRS's own `fit` gives each replica 16 samples,
    scored alone (their own in-batch negatives, the Retrieval loss a SUM over them),
    and tf_keras' optimizer sums the replicas' gradients (the regularization loss,
    added on each replica, counts twice). GradientCache(model, 4) built and compiled
    under the strategy does the same with each replica's 16 in micro-batches of 4:
    the reference is TFRS's own `fit` under the strategy, with the task's options
    and a weight regularizer. Control: GradientCache on one device at the same
    batch, which scores the 32 samples together, lands elsewhere."""
    kwargs = dict(options=True, regularizer=k2.regularizers.l2(1e-3))
    with two_replicas().scope():
        expected = tutorial_model(**kwargs)
        expected_logs = train(expected, BATCH, k2.optimizers.Adagrad(0.1))
    with two_replicas().scope():
        inner = tutorial_model(**kwargs)
        cache = GradientCache(inner, N)
        logs = train(cache, BATCH, k2.optimizers.Adagrad(0.1))
    assert deltas.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    assert set(logs) == set(expected_logs)
    for name in ("loss", "regularization_loss", "total_loss"):
        np.testing.assert_allclose(logs[name], expected_logs[name], rtol=1e-5, atol=1e-6, err_msg=name)
    one_device = tutorial_model(**kwargs)
    train(GradientCache(one_device, N), BATCH, k2.optimizers.Adagrad(0.1))
    assert deltas.max_abs_diff(one_device.get_weights(), expected.get_weights()) > 1e-3


WORKER_KWARGS = dict(options="int")     # tests/keras2/gradient_cache_worker.py, 2 workers
MEAN = "mean"   # the task's loss averaged over the batch (SUM_OVER_BATCH_SIZE), as the demo's module does


@pytest.mark.parametrize("case", ["options-regularizer", MEAN])
def test_gathered_on_two_replicas_like_tfrs_large_batch_on_one_device(case):
    """gather_across_replicas=True on 2 replicas, batches of 32: each replica's task
    scores all 32 (the task's options gathered with their samples; the regularization
    counted once), so the run lands on TFRS's own `fit` on one device at 32, and its
    logged losses and `evaluate` are that run's. With MEAN the task's
    SUM_OVER_BATCH_SIZE loss is the global batch's mean (TFRS's own `fit` refuses it
    under a strategy). Control: TFRS's own `fit` under the same strategy (each
    replica's 16 alone) lands elsewhere."""
    kwargs = (dict(options="int", regularizer=k2.regularizers.l2(1e-3)) if case != MEAN else
              dict(loss=k2.losses.CategoricalCrossentropy(from_logits=True,
                                                          reduction=k2.losses.Reduction.SUM_OVER_BATCH_SIZE)))
    optimizer = (lambda: k2.optimizers.SGD(2.0)) if case == MEAN else (lambda: k2.optimizers.Adagrad(0.1))
    expected = tutorial_model(**kwargs)
    expected_logs = train(expected, BATCH, optimizer())
    with two_replicas().scope():
        inner = tutorial_model(**kwargs)
        cache = GradientCache(inner, N, gather_across_replicas=True)
        logs = train(cache, BATCH, optimizer())
    measured = deltas.max_abs_diff(inner.get_weights(), expected.get_weights())
    print(f"[measured] TFRS ({case}), 2 replicas gathered vs TFRS's one-device large batch: max |dw| = {measured:.1e}")
    assert measured <= TOLERANCE
    assert deltas.max_abs_diff(expected.get_weights(), initial(**kwargs).get_weights()) > 1e-2  # it trained
    for name in ("loss", "regularization_loss", "total_loss"):
        np.testing.assert_allclose(logs[name], expected_logs[name], rtol=1e-5, atol=1e-6, err_msg=name)
    data = tf.data.Dataset.from_tensor_slices(interactions()).batch(BATCH)
    evaluated = cache.evaluate(data, return_dict=True, verbose=0)
    expected_evaluated = expected.evaluate(data, return_dict=True, verbose=0)
    assert set(evaluated) == set(expected_evaluated)
    for name in ("loss", "regularization_loss", "total_loss"):
        np.testing.assert_allclose(evaluated[name], expected_evaluated[name], rtol=1e-5, atol=1e-6, err_msg=name)
    with two_replicas().scope():
        control = tutorial_model(**kwargs)
        if case == MEAN:
            with pytest.raises(ValueError, match="Reduction.SUM"):
                train(control, BATCH, optimizer(), epochs=1)
            return
        train(control, BATCH, optimizer())
    assert deltas.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-3


def test_gathering_refuses_string_candidate_ids_with_a_message():
    with two_replicas().scope():
        cache = GradientCache(tutorial_model(options=True), N, gather_across_replicas=True)
        with pytest.raises(ValueError, match="string tensor, which cannot be gathered"):
            train(cache, BATCH, k2.optimizers.Adagrad(0.1), epochs=1)


def cache_compiled():
    cache = GradientCache(tutorial_model(), N)
    cache.compile(optimizer=k2.optimizers.Adagrad(0.1))
    return cache


def one_epoch(model):
    model.fit(tf.data.Dataset.from_tensor_slices(interactions()).batch(BATCH), epochs=1, verbose=0)
    return model


@pytest.fixture(scope="module")
def two_epochs():
    """Two epochs uninterrupted; one epoch (saved by the tests); and the control:
    that epoch's weights, one more epoch with a fresh optimizer."""
    uninterrupted = one_epoch(one_epoch(cache_compiled()))
    first = one_epoch(cache_compiled())
    fresh = cache_compiled()
    fresh.model.compute_loss(interactions(samples=2))  # builds the towers
    fresh.model.set_weights(first.model.get_weights())
    return uninterrupted, first, one_epoch(fresh)


@pytest.mark.parametrize("how", ["save_weights", "checkpoint", "tfrs_checkpoint"])
def test_saving_and_resuming_continues_like_uninterrupted_training(how, two_epochs, tmp_path):
    """One epoch, saved, restored into a new GradientCache, one more epoch: like two
    epochs uninterrupted (Adagrad's accumulators and iteration count are restored
    with the weights). What TFRS users save (a tfrs.Model has no get_config):
    `save_weights`/`load_weights` in the TF checkpoint format, a
    `tf.train.Checkpoint(model=..., optimizer=...)` of the GradientCache, and one of
    the TFRS model trained by TFRS's own `fit`, resumed under GradientCache. The
    towers and the optimizer's slots are created at the first step, which restores
    them then (deferred restoration). Control: the saved weights with a fresh
    optimizer land elsewhere."""
    uninterrupted, first, fresh = two_epochs
    resumed = cache_compiled()
    path = str(tmp_path / "ckpt")
    if how == "save_weights":
        first.save_weights(path)
        status = resumed.load_weights(path)
    elif how == "checkpoint":
        path = tf.train.Checkpoint(model=first, optimizer=first.optimizer).save(path)
        status = tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(path)
    else:
        tfrs_model = tutorial_model()
        train(tfrs_model, BATCH, k2.optimizers.Adagrad(0.1), epochs=1)
        path = tf.train.Checkpoint(model=tfrs_model, optimizer=tfrs_model.optimizer).save(path)
        status = tf.train.Checkpoint(model=resumed.model, optimizer=resumed.optimizer).restore(path)
    one_epoch(resumed)
    status.assert_consumed()
    assert int(resumed.optimizer.iterations) == int(uninterrupted.optimizer.iterations) == 12
    assert deltas.max_abs_diff(resumed.model.get_weights(), uninterrupted.model.get_weights()) <= TOLERANCE
    assert deltas.max_abs_diff(fresh.model.get_weights(), uninterrupted.model.get_weights()) > 1e-3
