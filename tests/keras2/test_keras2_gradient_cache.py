"""GradientCache on Keras 2: losses that couple the batch train like Keras 2's own large batch.

Reference: the same model (same class, same initial weights) trained by Keras 2's
own `fit` at the large batch. Each exactness test has a control that lands
elsewhere (plain accumulation of micro-batches, each with its own negatives), so
the comparison can fail.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, GradientCache
from tfx_gradient_accumulator.accumulator.cache import contrastive
from tfx_gradient_accumulator.accumulator.core import flavours, seam
from tests import deltas

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")

BATCH, N = 64, 4
TOLERANCE = 1e-5
USERS, ITEMS = 40, 60


def _two_tower_class():
    class TwoTower(k2.Model):
        """Retrieval with in-batch negatives, as a Keras 2 user writes it."""

        def __init__(self, users=USERS, regularizer=None, dim=8, **kwargs):
            super().__init__(**kwargs)
            self.users = users
            self.query = k2.Sequential([k2.layers.Embedding(users, 16),
                                        k2.layers.Dense(dim, kernel_regularizer=regularizer)])
            self.candidate = k2.Sequential([k2.layers.Embedding(ITEMS, 16), k2.layers.Dense(dim, use_bias=False)])

        def call(self, inputs):
            return {"query": self.query(inputs["user"]), "candidate": self.candidate(inputs["item"])}

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
            loss = contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])
            return loss + tf.add_n(self.losses) if self.losses else loss

    return TwoTower


TwoTower = _two_tower_class() if k2 is not None else None


def interactions(samples=256, users=USERS, seed=0):
    rng = np.random.RandomState(seed)
    user = rng.randint(0, users, samples)
    return {"user": user.astype("int32"), "item": ((user * 7 + rng.randint(0, 5, samples)) % ITEMS).astype("int32")}


def built(seed=0, **kwargs):
    k2.utils.set_random_seed(seed)
    model = TwoTower(**kwargs)
    model(interactions(2, users=kwargs.get("users", USERS)))
    return model


def large_batch(make_optimizer, data, epochs=2, make=built, **compile_kwargs):
    model = make()
    model.compile(optimizer=make_optimizer(), **compile_kwargs)
    model.fit(data, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return model


def cached(make_optimizer, data, epochs=2, make=built, gather=False, **compile_kwargs):
    inner = make()
    model = GradientCache(inner, N, gather_across_replicas=gather)
    model.compile(optimizer=make_optimizer(), **compile_kwargs)
    model.fit(data, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0)
    return inner


def accumulated(make_optimizer, data, epochs=2, make=built, **compile_kwargs):
    """The control: micro-batches of BATCH / N, each with its own negatives only."""
    model = make()
    model.compile(optimizer=GradientAccumulator(make_optimizer(), N), **compile_kwargs)
    model.fit(data, batch_size=BATCH // N, epochs=epochs, shuffle=False, verbose=0)
    return model


def assert_exact_and_control_is_not(make_optimizer, data, make=built, **compile_kwargs):
    expected = large_batch(make_optimizer, data, make=make, **compile_kwargs)
    inner = cached(make_optimizer, data, make=make, **compile_kwargs)
    assert isinstance(inner, k2.Model)
    assert deltas.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    control = accumulated(make_optimizer, data, make=make, **compile_kwargs)
    assert deltas.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-3
    assert deltas.max_abs_diff(expected.get_weights(), make().get_weights()) > 1e-2     # it trained


def test_the_one_name_gives_the_keras2_class():
    model = GradientCache(built(), N)
    assert isinstance(model, k2.Model) and model.accum_steps == N
    with pytest.raises(ValueError, match="accum_steps"):
        GradientCache(built(), 0)
    # Negatives across replicas: a model with its own compute_loss, as for Keras 3.
    assert GradientCache(built(), N, gather_across_replicas=True).gather_across_replicas is True
    assert GradientCache(built(), N).gather_across_replicas is False
    with pytest.raises(ValueError, match="needs the model's own `compute_loss`.*Keras 2 scales"):
        GradientCache(_functional(), N, gather_across_replicas=True)
    with pytest.raises(TypeError, match="gather_across_replicas` must be True or False"):
        GradientCache(built(), N, gather_across_replicas="yes")


@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_matches_keras2_large_batch_and_plain_accumulation_does_not(optimizer):
    make = {"adam": lambda: k2.optimizers.Adam(1e-2), "sgd": lambda: k2.optimizers.SGD(2.0)}[optimizer]
    assert_exact_and_control_is_not(make, interactions())


def test_weight_regularization_counts_once_on_the_whole_batch():
    assert_exact_and_control_is_not(lambda: k2.optimizers.Adam(1e-2), interactions(),
                                    make=lambda: built(regularizer=k2.regularizers.L2(1e-2)))


def test_repeated_ids_update_their_rows_as_keras2_does():
    # 4 users over 256 samples: every row of the query table repeats in every micro-batch.
    assert_exact_and_control_is_not(lambda: k2.optimizers.SGD(0.5), interactions(users=4),
                                    make=lambda: built(users=4))


def _scores_model(seed=0):
    """A functional model with no `compute_loss`: the compiled loss scores its output."""
    k2.utils.set_random_seed(seed)
    user, item = k2.Input((), dtype="int32", name="user"), k2.Input((), dtype="int32", name="item")
    query = k2.layers.Dense(8)(k2.layers.Embedding(USERS, 16)(user))
    candidate = k2.layers.Dense(8, use_bias=False)(k2.layers.Embedding(ITEMS, 16)(item))
    return k2.Model({"user": user, "item": item}, k2.layers.Concatenate()([query, candidate]))


def in_batch_softmax_loss(y_true, y_pred):
    """Each sample's cross-entropy against every candidate of its batch (per sample)."""
    query, candidate = tf.split(y_pred, 2, axis=1)
    logits = tf.matmul(query, candidate, transpose_b=True)
    return tf.nn.sparse_softmax_cross_entropy_with_logits(tf.range(tf.shape(logits)[0]), logits)


def test_the_compiled_loss_when_the_model_has_no_compute_loss():
    data = interactions()
    labeled = tf.data.Dataset.from_tensor_slices((data, np.zeros(256, "float32")))

    def fit(model, batch, optimizer):
        model.compile(optimizer=optimizer, loss=in_batch_softmax_loss)
        history = model.fit(labeled.batch(batch), epochs=2, verbose=0)
        return history.history["loss"]

    expected = _scores_model()
    expected_loss = fit(expected, BATCH, k2.optimizers.Adam(1e-2))
    inner = _scores_model()
    loss = fit(GradientCache(inner, N), BATCH, k2.optimizers.Adam(1e-2))
    assert deltas.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    np.testing.assert_allclose(loss, expected_loss, rtol=1e-5)
    control = _scores_model()
    fit(control, BATCH // N, GradientAccumulator(k2.optimizers.Adam(1e-2), N))
    assert deltas.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-3


def test_mixed_float16_scales_the_loss_as_keras2_does():
    # SGD: its step is the gradient, so float16's rounding of partial sums (micro-batch
    # sums are rounded where the large batch rounds one sum) stays below the tolerance;
    # Adam divides it by the gradient's size, and lands about 2e-3 off, as on Keras 3.
    make = lambda: k2.optimizers.SGD(1.0)   # noqa: E731
    k2.mixed_precision.set_global_policy("mixed_float16")
    try:
        expected = large_batch(make, interactions())
        inner = cached(make, interactions())
        assert inner.query.layers[1].compute_dtype == "float16"
        assert deltas.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
        wrapper = GradientCache(built(), N)
        wrapper.compile(optimizer=make())
        assert isinstance(wrapper.optimizer, k2.mixed_precision.LossScaleOptimizer)
        control = accumulated(lambda: k2.mixed_precision.LossScaleOptimizer(make()), interactions())
        assert deltas.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-3
    finally:
        k2.mixed_precision.set_global_policy("float32")


def test_two_mirrored_replicas_train_like_keras2_large_batch_under_the_same_strategy():
    # Reduced on one device: collective ops of several strategies in one process (the
    # whole suite's) can collide on their instance keys.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    data = interactions()

    def under_strategy(run):
        with strategy.scope():
            return run(lambda: k2.optimizers.SGD(0.5), data)

    expected = under_strategy(large_batch)
    inner = under_strategy(cached)
    assert deltas.max_abs_diff(inner.get_weights(), expected.get_weights()) <= TOLERANCE
    # Control: one device, whose loss sees all 64 negatives where each replica sees its 32.
    control = large_batch(lambda: k2.optimizers.SGD(0.5), data)
    assert deltas.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-3


def test_two_mirrored_replicas_gathered_train_like_keras2_large_batch_on_one_device():
    """gather_across_replicas=True on 2 replicas: every replica scores the global batch
    of 64 (each sample meets 63 negatives), so the run lands on tf_keras' own large
    batch on one device. Control: tf_keras' own large batch under the same strategy
    (each replica's 32 alone, their losses summed by the strategy) lands elsewhere."""
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    data = interactions()
    make = lambda: k2.optimizers.Adam(1e-2)
    make_regularized = lambda: built(regularizer=k2.regularizers.L2(1e-2))   # counts once, as on one device
    expected = large_batch(make, data, make=make_regularized)
    with strategy.scope():
        inner = cached(make, data, make=make_regularized, gather=True)
    measured = deltas.max_abs_diff(inner.get_weights(), expected.get_weights())
    print(f"[measured] Keras 2, 2 replicas gathered vs tf_keras' one-device large batch: max |dw| = {measured:.1e}")
    assert measured <= TOLERANCE
    with strategy.scope():
        control = large_batch(make, data, make=make_regularized)
    assert deltas.max_abs_diff(control.get_weights(), expected.get_weights()) > 1e-3
    assert deltas.max_abs_diff(expected.get_weights(), make_regularized().get_weights()) > 1e-2   # it trained


def test_gathering_is_saved_with_the_model():
    model = GradientCache(built(), N, gather_across_replicas=True)
    again = type(model).from_config(model.get_config(), custom_objects={"TwoTower": TwoTower})
    assert (again.gather_across_replicas, again.accum_steps) == (True, N)


def test_saved_and_loaded_it_resumes_like_the_uninterrupted_large_batch(tmp_path):
    data = interactions()
    expected = large_batch(lambda: k2.optimizers.Adam(1e-2), data, epochs=2)
    model = GradientCache(built(), N)
    model.compile(optimizer=k2.optimizers.Adam(1e-2))
    model.fit(data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = str(tmp_path / "cache.keras")
    model.save(path)
    loaded = k2.models.load_model(path, custom_objects={"TwoTower": TwoTower})
    assert type(loaded) is type(model) and loaded.accum_steps == N
    loaded.fit(data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert deltas.max_abs_diff(loaded.model.get_weights(), expected.get_weights()) <= TOLERANCE
    # Control: a fresh optimizer (Adam's moments lost) resumes elsewhere.
    fresh = k2.models.load_model(path, custom_objects={"TwoTower": TwoTower}, compile=False)
    fresh.compile(optimizer=k2.optimizers.Adam(1e-2))
    fresh.fit(data, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    assert deltas.max_abs_diff(fresh.model.get_weights(), expected.get_weights()) > 1e-3


def _functional(*middle, add_loss=False):
    inputs = k2.Input((4,))
    hidden = k2.layers.Dense(8)(inputs)
    for layer in middle:
        hidden = layer(hidden)
    model = k2.Model(inputs, k2.layers.Dense(4)(hidden))
    if add_loss:
        model.add_loss(tf.reduce_mean(hidden))
    return model


@pytest.mark.parametrize("model, message", [
    (lambda: _functional(k2.layers.BatchNormalization()), "BatchNormalization"),
    (lambda: _functional(k2.layers.Dropout(0.1)), "Dropout.*cannot replay"),
    (lambda: _functional(k2.layers.Dense(8, activity_regularizer="l2")), "activity_regularizer"),
    (lambda: _functional(add_loss=True), "adds losses while it runs"),
], ids=["batch_norm", "dropout", "activity_regularizer", "add_loss"])
def test_refuses_what_would_not_be_exact_before_training(model, message):
    inner = model()
    before = [w.copy() for w in inner.get_weights()]
    wrapper = GradientCache(inner, N)
    wrapper.compile(optimizer=k2.optimizers.SGD(0.1), loss="mse")
    x = np.random.RandomState(0).normal(size=(16, 4)).astype("float32")
    with pytest.raises(ValueError, match=message):
        wrapper.fit(x, x, batch_size=16, verbose=0)
    assert deltas.max_abs_diff(inner.get_weights(), before) == 0.0


def test_the_private_keras2_name_it_needs_exists():
    assert [str(name) for name, _ in seam.missing_private_names() if name.keras2] == []


def test_refuses_a_model_of_no_keras():
    with pytest.raises(TypeError, match="`model`"):
        GradientCache(object(), N)
