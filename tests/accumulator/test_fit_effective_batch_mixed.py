"""`micro_batch_size` under mixed_float16 with `compile`'s defaults (Keras wraps the optimizer
in a LossScaleOptimizer; the accumulator takes the loss scaling inside it): one loss scale
per update, each micro-batch's loss scaled by S times its share of the batch's samples (each
sample's float16 gradient as in the large batch), the gradient unscaled once, one
finiteness check; an overflow skips the update and lowers the scale as the large batch's
step does."""

import keras
import pytest

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref

TOLERANCE = 1e-5
# float16 sums over micro-batches of 5 rows rather than over batches of 20 round differently
# (as the window's own micro-batches do: test_mixed_precision.py); skipping accumulation
# lands far beyond this.
FLOAT16_ROUNDING = 3e-3
SAMPLES, E, B = 50, 20, 5


def _sgd():
    return keras.optimizers.SGD(0.05, momentum=0.9)


def _updates(optimizer):
    """The inner optimizer's update count (Keras 3.8's LossScaleOptimizer counts its own)."""
    return int(getattr(optimizer, "inner_optimizer", optimizer).iterations.numpy())


def _fit(optimizer, batch_size, jit_compile=False, auto_scale_loss=True, epochs=2):
    x, y = ref.regression_data(SAMPLES)
    model = ref.mlp()
    model.compile(optimizer, "mse", jit_compile=jit_compile, auto_scale_loss=auto_scale_loss)
    history = model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0).history
    return model, history


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_mixed_float16_under_compiles_defaults_is_the_large_batch(mixed_policy, jit_compile):
    large, large_history = _fit(_sgd(), E, jit_compile)
    micro, micro_history = _fit(GradientAccumulator(_sgd(), micro_batch_size=B), E, jit_compile)
    assert micro.layers[0].compute_dtype == "float16"
    assert isinstance(large.optimizer, keras.optimizers.LossScaleOptimizer)
    assert micro.optimizer.loss_scale_optimizer is not None       # taken inside
    assert int(micro.optimizer.iterations.numpy()) == _updates(large.optimizer) == 6
    assert float(micro.optimizer.dynamic_scale.numpy()) == float(large.optimizer.dynamic_scale.numpy())
    gap = ref.max_abs_diff(large.get_weights(), micro.get_weights())
    assert gap <= FLOAT16_ROUNDING
    assert max(abs(a - b) for a, b in zip(large_history["loss"], micro_history["loss"])) <= FLOAT16_ROUNDING
    # Exact where the float16 sums are the same: the window's micro-batches of 5 (N = 4).
    window, _ = _fit(GradientAccumulator(_sgd(), 4), B, jit_compile)
    assert ref.max_abs_diff(window.get_weights(), micro.get_weights()) < TOLERANCE
    # The test can fail: the plain micro-batch is far off.
    if jit_compile:
        return
    small, _ = _fit(_sgd(), B)
    assert ref.max_abs_diff(large.get_weights(), small.get_weights()) > 30 * FLOAT16_ROUNDING


def test_an_overflow_skips_the_update_and_lowers_the_scale_as_the_large_batch(mixed_policy):
    # From a scale of 2**20 the first updates overflow in float16: skipped, the scale
    # halved each time, until it fits; then the updates train.
    def lso():
        return keras.optimizers.LossScaleOptimizer(_sgd(), initial_scale=2.0 ** 20)

    large, _ = _fit(lso(), E, auto_scale_loss=False, epochs=3)
    micro, _ = _fit(GradientAccumulator(lso(), micro_batch_size=B), E, auto_scale_loss=False, epochs=3)
    skipped = 9 - _updates(large.optimizer)
    assert 0 < skipped < 9, skipped
    assert int(micro.optimizer.iterations.numpy()) == _updates(large.optimizer)
    assert float(micro.optimizer.dynamic_scale.numpy()) == float(large.optimizer.dynamic_scale.numpy()) \
        == 2.0 ** 20 / 2 ** skipped
    assert ref.max_abs_diff(large.get_weights(), micro.get_weights()) <= FLOAT16_ROUNDING
    window, _ = _fit(GradientAccumulator(lso(), 4), B, auto_scale_loss=False, epochs=3)
    assert ref.max_abs_diff(window.get_weights(), micro.get_weights()) < TOLERANCE


def test_mixed_float16_under_a_mirrored_strategy(mixed_policy):
    # Uneven replicas (batches of 20, 20, 5), micro-batches of 8 (4 a replica).
    import tensorflow as tf

    from tests.accumulator.test_fit_effective_batch_distributed import _mirrored

    x, y = ref.regression_data(45)

    def trained(make_optimizer, strategy):
        with strategy.scope():
            model = ref.mlp()
            model.compile(make_optimizer(), "mse")
        model.fit(x, y, batch_size=E, epochs=2, shuffle=False, verbose=0)
        return model

    large = trained(_sgd, tf.distribute.get_strategy())
    micro = trained(lambda: GradientAccumulator(_sgd(), micro_batch_size=8), _mirrored())
    assert int(micro.optimizer.iterations.numpy()) == _updates(large.optimizer) == 6
    assert float(micro.optimizer.dynamic_scale.numpy()) == float(large.optimizer.dynamic_scale.numpy())
    assert ref.max_abs_diff(large.get_weights(), micro.get_weights()) <= FLOAT16_ROUNDING
