"""Keras 2: `GradientAccumulator(inner, micro_batch_size=b)` under mixed_float16. Keras 2's
`compile` puts a LossScaleOptimizer around the accumulator; `fit` takes it inside
(`accumulator.keras2.micro_batch_scaling`): one loss scale per update, each micro-batch's
loss scaled by S times its share of the batch's samples (each sample's float16 gradient as in
the large batch), the gradient unscaled once, one finiteness check; an overflow skips the
update and lowers the scale as the large batch's step does."""

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import flavours
from tests import deltas

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")

TOLERANCE = 1e-5
# float16 sums over micro-batches of 5 rows rather than over batches of 20 round differently
# (as the window's own micro-batches do); skipping accumulation lands far beyond this.
FLOAT16_ROUNDING = 3e-3
SAMPLES, E, B = 50, 20, 5


@pytest.fixture
def mixed_policy():
    k2.mixed_precision.set_global_policy("mixed_float16")
    yield
    k2.mixed_precision.set_global_policy("float32")


def _data(samples=SAMPLES, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, 5).astype("float32")
    return x, (x @ rng.randn(5, 1) + 0.1 * rng.randn(samples, 1)).astype("float32")


def _mlp():
    # float16 layers, the output in float32 (as Keras' mixed precision guide has it).
    k2.utils.set_random_seed(0)
    return k2.Sequential([k2.Input((5,)), k2.layers.Dense(8, activation="tanh"), k2.layers.Dense(1, dtype="float32")])


def _sgd():
    return k2.optimizers.SGD(0.05, momentum=0.9)


def _lso(initial_scale=2.0 ** 18):
    # From a scale of 2**18 some updates overflow in float16 (skipped, the scale halved), some
    # only in the large batch's float16 sum over its 20 rows, not in a micro-batch's over 5:
    # the step's range check skips those too, as the large batch's step does.
    return k2.mixed_precision.LossScaleOptimizer(_sgd(), initial_scale=initial_scale)


class _Skipped(k2.callbacks.Callback if k2 is not None else object):
    """Which updates left the weights as they were (skipped by the LossScaleOptimizer, whose
    `iterations` counts them too in Keras 2)."""

    def on_train_begin(self, logs=None):
        self.weights, self.skipped = self.model.get_weights(), []

    def on_train_batch_end(self, batch, logs=None):
        weights = self.model.get_weights()
        self.skipped.append(all(np.array_equal(a, b) for a, b in zip(weights, self.weights)))
        self.weights = weights


def _fit(make_optimizer, batch_size, samples=SAMPLES, epochs=2, strategy=None, jit_compile=False):
    x, y = _data(samples)
    with (strategy or tf.distribute.get_strategy()).scope():
        model = _mlp()
        optimizer = make_optimizer()
        model.compile(optimizer, "mse", jit_compile=jit_compile)
    skipped = _Skipped()
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0,
                        callbacks=[skipped]).history
    history["skipped"] = skipped.skipped
    return model, optimizer, history


def _scale(optimizer):
    held = getattr(optimizer, "loss_scale_optimizer", None) or optimizer
    return float(held.loss_scale.numpy())


def _gap(a, b):
    return deltas.max_abs_diff(a.get_weights(), b.get_weights())


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_mixed_float16_under_compiles_defaults_is_the_large_batch(mixed_policy, jit_compile):
    large, _, large_history = _fit(_sgd, E, jit_compile=jit_compile)
    micro, given, micro_history = _fit(lambda: GradientAccumulator(_sgd(), micro_batch_size=B), E,
                                       jit_compile=jit_compile)
    assert micro.layers[0].compute_dtype == "float16"
    assert isinstance(large.optimizer, k2.mixed_precision.LossScaleOptimizer)
    assert micro.optimizer is given and given.loss_scale_optimizer is not None     # taken inside
    assert int(micro.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 6
    assert _scale(micro.optimizer) == _scale(large.optimizer)
    assert _gap(large, micro) <= FLOAT16_ROUNDING
    np.testing.assert_allclose(micro_history["loss"], large_history["loss"], atol=FLOAT16_ROUNDING)
    assert not any(micro_history["skipped"])
    # Exact where the float16 sums are the same: the window's micro-batches of 5 (N = 4).
    window, _, _ = _fit(lambda: GradientAccumulator(k2.mixed_precision.LossScaleOptimizer(_sgd()), 4), B,
                        jit_compile=jit_compile)
    assert _gap(window, micro) < TOLERANCE
    # The test can fail: the plain micro-batch is far off.
    if not jit_compile:
        small, _, _ = _fit(_sgd, B)
        assert _gap(large, small) > 30 * FLOAT16_ROUNDING


def test_an_overflow_skips_the_update_and_lowers_the_scale_as_the_large_batch(mixed_policy):
    large, _, large_history = _fit(_lso, E, epochs=3)
    micro, _, micro_history = _fit(lambda: GradientAccumulator(_lso(), micro_batch_size=B), E, epochs=3)
    skipped = sum(large_history["skipped"])
    assert 0 < skipped < 9, large_history["skipped"]
    assert micro_history["skipped"] == large_history["skipped"]
    assert int(micro.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 9
    assert _scale(micro.optimizer) == _scale(large.optimizer) == 2.0 ** 18 / 2 ** skipped
    assert _gap(large, micro) <= FLOAT16_ROUNDING


def test_mixed_float16_under_a_mirrored_strategy(mixed_policy):
    # Uneven replicas (batches of 20, 20, 5), micro-batches of 8 (4 a replica); compile's own
    # LossScaleOptimizer, and one whose first updates overflow.
    from tests.keras2.test_fit_effective_batch_keras2_distributed import _mirrored

    large, _, _ = _fit(_sgd, E, samples=45)
    micro, _, _ = _fit(lambda: GradientAccumulator(_sgd(), micro_batch_size=8), E, samples=45,
                       strategy=_mirrored())
    assert int(micro.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 6
    assert _scale(micro.optimizer) == _scale(large.optimizer)
    assert _gap(large, micro) <= FLOAT16_ROUNDING
    # From 2**20 the first epoch's updates overflow in every replica's float16 too. (At a scale
    # on the edge a replica's float16 sum over its share can overflow where the large batch's,
    # its signs cancelling, does not, and the other way round: not tested here.)
    large, _, large_history = _fit(lambda: _lso(2.0 ** 20), E, samples=45, epochs=3)
    micro, _, micro_history = _fit(lambda: GradientAccumulator(_lso(2.0 ** 20), micro_batch_size=8), E,
                                   samples=45, epochs=3, strategy=_mirrored())
    assert 0 < sum(large_history["skipped"]) < 9
    assert micro_history["skipped"] == large_history["skipped"]
    assert _scale(micro.optimizer) == _scale(large.optimizer) == 2.0 ** 20 / 2 ** sum(large_history["skipped"])
    assert _gap(large, micro) <= FLOAT16_ROUNDING


def test_a_saved_model_loads_with_the_scaling_inside(mixed_policy, tmp_path):
    micro, _, _ = _fit(lambda: GradientAccumulator(_sgd(), micro_batch_size=B), E, epochs=1)
    micro.save(tmp_path / "model.keras")
    loaded = k2.models.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.micro_batch_size == B and loaded.optimizer.loss_scale_optimizer is not None
    x, y = _data()
    for trained in (micro, loaded):
        trained.fit(x, y, batch_size=E, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 6
    assert _scale(loaded.optimizer) == _scale(micro.optimizer)
    assert _gap(micro, loaded) < TOLERANCE


def test_an_accumulator_built_without_loss_scaling_is_refused_before_training(mixed_policy):
    x, y = _data(8)
    model = _mlp()
    optimizer = GradientAccumulator(_sgd(), micro_batch_size=4)
    optimizer.build(model.trainable_variables)
    before = model.get_weights()
    with pytest.raises(ValueError, match="built without loss scaling"):
        model.compile(optimizer, "mse")           # the compile hook; `fit` refuses it too
    with pytest.raises(ValueError, match="built without loss scaling"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert deltas.max_abs_diff(before, model.get_weights()) == 0.0


@pytest.mark.apart
def test_mixed_float16_on_two_workers(mixed_policy, tmp_path):
    # MultiWorkerMirroredStrategy, 2 processes, compile's defaults: 3 batches of 64 and one of
    # 18 (9 a worker), micro-batches of 16 (8 a worker). Apart: the same step as
    # test_mixed_float16_under_a_mirrored_strategy, another strategy (`make test-apart`).
    from tests.accumulator.multiworker import run_cluster
    from tests.keras2.fit_effective_batch_keras2_worker import optimizer

    samples, batch, micro = 210, 64, 16
    codes, output, result = run_cluster(tmp_path / "out", "--samples", samples, "--batch", batch, "--micro", micro,
                                        "--mixed", module="tests.keras2.fit_effective_batch_keras2_worker",
                                        timeout=180)
    assert codes == [0, 0], output[-3000:]
    weights, iterations = result
    large, _, _ = _fit(lambda: optimizer(k2), batch, samples=samples, epochs=1)
    assert iterations == int(large.optimizer.iterations.numpy()) == 4
    assert float(np.load(f"{tmp_path / 'out'}.0.npz")["scale"]) == _scale(large.optimizer)
    assert deltas.max_abs_diff(weights, large.get_weights()) <= FLOAT16_ROUNDING


def test_compile_takes_the_scaling_inside_so_train_on_batch_splits_too(mixed_policy):
    """Keras 2's `compile` puts a LossScaleOptimizer around the accumulator; the compile hook takes
    it inside at once, so `train_on_batch` (no `fit` hook) trains the batch in micro-batches too."""
    x, y = _data(E)
    model, given = _mlp(), GradientAccumulator(_sgd(), micro_batch_size=B)
    model.compile(given, "mse")
    assert model.optimizer is given and given.loss_scale_optimizer is not None
    model.train_on_batch(x, y)
    assert int(given.iterations.numpy()) == 1
    split, _, _ = _fit(lambda: GradientAccumulator(_sgd(), micro_batch_size=B), E, samples=E, epochs=1)
    assert _gap(split, model) < TOLERANCE             # fit's micro-batches, one loss scale
    large, _, _ = _fit(_sgd, E, samples=E, epochs=1)
    assert _scale(given) == _scale(large.optimizer)
    assert _gap(large, model) <= FLOAT16_ROUNDING
