"""The wrapper's contract: validation, pass-through, where state changes, odd gradients."""

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref


@pytest.mark.parametrize(
    "bad, error",
    [(0, ValueError), (-2, ValueError), (2.5, TypeError), (4.0, TypeError),
     (True, TypeError), ("4", TypeError), (None, TypeError)],
)
def test_bad_accum_steps_is_refused_at_construction(bad, error):
    with pytest.raises(error, match="accum_steps"):
        GradientAccumulator(keras.optimizers.SGD(), accum_steps=bad)


@pytest.mark.parametrize("bad", [object(), keras.losses.MeanSquaredError(), 0.1, None])
def test_non_optimizer_is_refused(bad):
    with pytest.raises(TypeError, match="optimizer"):
        GradientAccumulator(bad, accum_steps=2)


def test_optimizer_by_name():
    assert isinstance(GradientAccumulator("adam", 2).inner_optimizer, keras.optimizers.Adam)
    with pytest.raises(ValueError, match="optimizer"):
        GradientAccumulator("no-such-optimizer", 2)


def test_wrapper_refuses_per_update_options_and_unknown_arguments():
    with pytest.raises(ValueError, match="clipnorm"):
        GradientAccumulator(keras.optimizers.SGD(), 2, clipnorm=1.0)
    with pytest.raises(ValueError, match="accum_stpes"):
        GradientAccumulator(keras.optimizers.SGD(), 2, accum_stpes=3)
    with pytest.raises(TypeError, match="GradientAccumulator"):
        GradientAccumulator(GradientAccumulator(keras.optimizers.SGD(), 2), 2)


def _embedding_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(50, 4),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(1),
    ])


def _token_data(samples=256, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randint(0, 50, size=(samples, 5)).astype("int32")
    y = (x.mean(axis=1, keepdims=True) / 50.0).astype("float32")
    return x, y


def test_accum_steps_one_is_bit_for_bit_pass_through():
    for build, (x, y) in [(ref.mlp, ref.regression_data(256)), (_embedding_model, _token_data())]:
        plain = build()
        plain.compile(keras.optimizers.Adam(1e-2, clipnorm=0.5), "mse")
        plain.fit(x, y, batch_size=16, shuffle=False, verbose=0)

        wrapped = build()
        wrapped.compile(GradientAccumulator(keras.optimizers.Adam(1e-2, clipnorm=0.5), 1), "mse")
        wrapped.fit(x, y, batch_size=16, shuffle=False, verbose=0)

        for a, b in zip(plain.get_weights(), wrapped.get_weights()):
            np.testing.assert_array_equal(a, b)
        assert int(wrapped.optimizer.iterations.numpy()) == 16
        assert wrapped.optimizer.accumulators == []      # no buffers held


def test_inner_state_changes_only_at_window_boundaries():
    model = ref.mlp()
    inner = keras.optimizers.Adam(1e-2, use_ema=True)
    optimizer = GradientAccumulator(inner, accum_steps=3)
    optimizer.build(model.trainable_variables)
    x, y = ref.regression_data(48)
    loss_fn = keras.losses.MeanSquaredError()

    def snapshot():
        return [v.numpy().copy() for v in model.trainable_variables + inner.variables]

    before = snapshot()
    for i in range(6):
        with tf.GradientTape() as tape:
            loss = loss_fn(y[i * 8:(i + 1) * 8], model(x[i * 8:(i + 1) * 8]))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        after = snapshot()
        if (i + 1) % 3:
            # Mid-window: weights, Adam moments, EMA and iterations untouched.
            assert all(np.array_equal(a, b) for a, b in zip(before, after))
            assert int(optimizer.micro_step.numpy()) == (i + 1) % 3
        else:
            assert not all(np.array_equal(a, b) for a, b in zip(before, after))
            assert int(optimizer.micro_step.numpy()) == 0
            assert all(not np.any(a.numpy()) for a in optimizer.accumulators)
        assert int(optimizer.iterations.numpy()) == (i + 1) // 3
        before = after


def test_none_gradients_leave_unused_variables_alone():
    """A variable without gradient gets no update (no decay, no moments), as with the big batch."""
    keras.utils.set_random_seed(0)
    used = keras.Variable(np.ones((3,), "float32"), name="used")
    unused = keras.Variable(np.ones((3,), "float32"), name="unused")
    variables = [used, unused]

    ref_used = keras.Variable(np.ones((3,), "float32"))
    ref_unused = keras.Variable(np.ones((3,), "float32"))
    reference = keras.optimizers.AdamW(0.1, weight_decay=0.5)

    optimizer = GradientAccumulator(keras.optimizers.AdamW(0.1, weight_decay=0.5), accum_steps=2)
    grads = [tf.constant([1.0, 2.0, 3.0]), tf.constant([-1.0, 0.5, 4.0])]
    for _ in range(3):
        for g in grads:
            optimizer.apply([g, None], variables)
        reference.apply([(grads[0] + grads[1]) / 2, None], [ref_used, ref_unused])

    np.testing.assert_allclose(used.numpy(), ref_used.numpy(), atol=1e-6)
    np.testing.assert_array_equal(unused.numpy(), np.ones(3))
    assert int(optimizer.iterations.numpy()) == 3


def test_indexed_slices_in_a_custom_loop_match_dense_sum():
    table = keras.Variable(np.zeros((6, 2), "float32"))
    optimizer = GradientAccumulator(keras.optimizers.SGD(1.0), accum_steps=2)
    first = tf.IndexedSlices(tf.constant([[1.0, 1.0], [2.0, 2.0]]), tf.constant([0, 3]), tf.constant([6, 2]))
    second = tf.IndexedSlices(tf.constant([[4.0, 4.0]]), tf.constant([3]), tf.constant([6, 2]))
    optimizer.apply([first], [table])
    optimizer.apply([second], [table])
    expected = np.zeros((6, 2), "float32")
    expected[0] -= 0.5
    expected[3] -= 3.0
    np.testing.assert_allclose(table.numpy(), expected)


def test_ema_is_updated_once_per_window():
    x, y = ref.regression_data(512)
    make = lambda: keras.optimizers.Adam(1e-2, use_ema=True, ema_momentum=0.9)
    expected = ref.fit_large_batch(ref.mlp(), make(), x, y, 32)
    model = ref.mlp()
    model.compile(GradientAccumulator(make(), 4), "mse")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_learning_rate_and_iterations_are_the_inner_optimizers():
    inner = keras.optimizers.SGD(0.1)
    optimizer = GradientAccumulator(inner, 2)
    optimizer.learning_rate = 0.05
    assert float(inner.learning_rate.numpy()) == pytest.approx(0.05)
    assert optimizer.iterations is inner.iterations


def test_config_round_trip():
    optimizer = GradientAccumulator(keras.optimizers.AdamW(3e-3, weight_decay=0.1, clipnorm=1.0), 6, name="acc")
    clone = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert isinstance(clone, GradientAccumulator)
    assert clone.accum_steps == 6 and clone.name == "acc"
    assert clone.inner_optimizer.get_config() == optimizer.inner_optimizer.get_config()


def test_find_micro_batch_is_public():
    import tfx_gradient_accumulator
    from tfx_gradient_accumulator import accumulator
    from tfx_gradient_accumulator.accumulator.batch import micro_batch

    for name in ("find_micro_batch", "MicroBatchFit"):
        assert name in accumulator.__all__
        assert getattr(tfx_gradient_accumulator, name) is getattr(accumulator, name) is getattr(micro_batch, name)
