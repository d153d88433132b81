"""Exact over the effective batch: uneven micro-batches, sample weights, masks."""

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref


def _adam():
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5), clipnorm=0.5)


def test_100_samples_in_batches_of_32_equal_one_step_on_all_100():
    # Micro-batches of 32, 32, 32, 4: the mean of micro-batch means would
    # weigh the last 4 samples 8 times too much.
    x, y = ref.regression_data(100)
    expected = ref.fit_large_batch(ref.mlp(), _adam(), x, y, 100)
    model = ref.mlp()
    optimizer = GradientAccumulator(_adam(), 4)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert int(optimizer.iterations.numpy()) == 1
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_sample_weights_follow_the_losss_reduction():
    x, y = ref.regression_data(100)
    w = np.random.RandomState(3).uniform(0, 3, size=(100,)).astype("float32")
    for reduction in ("sum_over_batch_size", "mean_with_sample_weight"):
        loss = keras.losses.MeanSquaredError(reduction=reduction)
        expected = ref.mlp()
        expected.compile(optimizer=_adam(), loss=loss)
        expected.fit(x, y, sample_weight=w, batch_size=100, shuffle=False, verbose=0)
        model = ref.mlp()
        model.compile(optimizer=GradientAccumulator(_adam(), 4), loss=loss)
        model.fit(x, y, sample_weight=w, batch_size=32, shuffle=False, verbose=0)
        assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6, reduction


def _masked_sequence_model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((7,), dtype="int32"),
        keras.layers.Embedding(20, 4, mask_zero=True),
        keras.layers.SimpleRNN(6, return_sequences=True),
        keras.layers.Dense(3),
    ])


def _sgd():
    # Linear in the gradient: Keras' Adam treats repeated embedding rows of
    # IndexedSlices inexactly in its own large-batch run (see test_api.py).
    return keras.optimizers.SGD(0.5, momentum=0.9, clipnorm=1.0)


def test_masked_sequences_weigh_their_unmasked_steps():
    rng = np.random.RandomState(0)
    lengths = rng.randint(1, 8, size=100)
    x = np.zeros((100, 7), "int32")
    for i, n in enumerate(lengths):
        x[i, :n] = rng.randint(1, 20, size=n)
    y = rng.randint(0, 3, size=(100, 7)).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    expected = _masked_sequence_model()
    # jit_compile=False: Keras' "auto" is XLA on one GPU, where the window refuses
    # the embedding's sparse rows (tests/accumulator/test_sparse.py).
    expected.compile(optimizer=_sgd(), loss=loss, jit_compile=False)
    expected.fit(x, y, batch_size=100, shuffle=False, verbose=0)
    model = _masked_sequence_model()
    model.compile(optimizer=GradientAccumulator(_sgd(), 4), loss=loss, jit_compile=False)
    model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


def test_custom_loop_passes_the_weight_explicitly():
    x, y = ref.regression_data(100)
    expected = ref.fit_large_batch(ref.mlp(), _adam(), x, y, 100)
    model = ref.mlp()
    optimizer = GradientAccumulator(_adam(), 4)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables),
                                  micro_batch_weight=tf.cast(tf.shape(xb)[0], tf.float32))

    for start in range(0, 100, 32):
        step(x[start:start + 32], y[start:start + 32])
    assert int(optimizer.iterations.numpy()) == 1
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6
