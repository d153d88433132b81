"""`GradientAccumulator(inner, micro_batch_size=b)`: `fit`'s batch is the effective batch,
one update trained as micro-batches inside one step (`accumulator.fit_micro_batches`),
within 1e-5 of Keras' own `fit(batch_size=E)` with the inner optimizer."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, WindowOptions
from tests.accumulator import reference as ref

TOLERANCE = 1e-5
SAMPLES, E, B = 50, 20, 6       # batches of 20, 20, 10; micro-batches of 6: 6+6+6+2 and 6+4 (padded)


def _adam():
    schedule = keras.optimizers.schedules.ExponentialDecay(3e-2, decay_steps=2, decay_rate=0.7)
    return keras.optimizers.Adam(schedule, clipnorm=0.05)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _pair(make_model, make_optimizer, x, y, batch_size=E, micro_batch_size=B, epochs=2, loss="mse",
          jit_compile=False, **fit_kwargs):
    """(the large batch's model, the micro-batched one), both trained by `fit`."""
    models = []
    for optimizer in (make_optimizer(), GradientAccumulator(make_optimizer(), micro_batch_size=micro_batch_size)):
        model = make_model()
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
        models.append(model)
    return models


def _assert_exact(large, micro):
    gap = ref.max_abs_diff(_weights(large), _weights(micro))
    assert gap < TOLERANCE, gap
    # Not the same by accident: the first weights moved far beyond the tolerance.
    assert ref.max_abs_diff(_weights(large), _weights(ref.mlp())) > 100 * TOLERANCE if len(_weights(large)) == 6 \
        else True


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_an_mlp_with_adam_schedule_and_clipnorm_trains_like_the_batch_of_e(jit_compile):
    x, y = ref.regression_data(SAMPLES)
    large, micro = _pair(ref.mlp, _adam, x, y, jit_compile=jit_compile)
    _assert_exact(large, micro)
    # Keras counts updates: 3 batches an epoch, 2 epochs.
    assert int(micro.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 6
    assert micro.optimizer.micro_batch_size == B


def test_the_logged_loss_and_metrics_are_the_large_batchs():
    x, y = ref.regression_data(SAMPLES)
    histories = []
    for optimizer in (_adam(), GradientAccumulator(_adam(), micro_batch_size=B)):
        model = ref.mlp()
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
        histories.append(model.fit(x, y, batch_size=E, epochs=2, shuffle=False, verbose=0).history)
    for name in ("loss", "mae"):
        np.testing.assert_allclose(histories[1][name], histories[0][name], rtol=1e-5, atol=1e-6)


def test_sample_weights_and_a_summed_loss():
    x, y = ref.regression_data(SAMPLES)
    weights = np.random.RandomState(1).uniform(0.0, 2.0, SAMPLES).astype("float32")
    large, micro = _pair(ref.mlp, _adam, x, y, sample_weight=weights)
    _assert_exact(large, micro)
    summed = keras.losses.MeanSquaredError(reduction="sum")
    large, micro = _pair(ref.mlp, lambda: keras.optimizers.SGD(1e-3), x, y, loss=summed, sample_weight=weights)
    _assert_exact(large, micro)


def test_a_per_token_embedding_keeps_the_large_batchs_rows():
    # Adam with clipnorm: the repeated rows go to Keras as the large batch's IndexedSlices.
    x, y = ref.token_data(60)
    for jit_compile in (False, True):
        large, micro = _pair(ref.embedding_model, _adam, x, y, batch_size=24, micro_batch_size=7,
                             jit_compile=jit_compile)
        gap = ref.max_abs_diff(_weights(large), _weights(micro))
        assert gap < TOLERANCE, (jit_compile, gap)
        assert ref.max_abs_diff(_weights(large), _weights(ref.embedding_model())) > 1e-2


def test_a_dataset_batched_at_e_counts_one_update_a_batch():
    x, y = ref.regression_data(SAMPLES)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(E)
    model = ref.mlp()
    model.compile(GradientAccumulator(_adam(), micro_batch_size=B), "mse")
    model.fit(data, epochs=1, verbose=0)
    large = ref.mlp()
    large.compile(_adam(), "mse")
    large.fit(data, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3
    assert ref.max_abs_diff(_weights(large), _weights(model)) < TOLERANCE


def test_a_micro_batch_wrong_by_its_weight_would_show():
    # The test can fail: the large batch's gradient against the micro-batches' plain mean
    # (6, 6, 6, 2 samples weighed alike) differs far beyond the tolerance.
    x, y = ref.regression_data(E)
    model = ref.mlp()
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        whole = tf.reduce_mean(tf.square(model(x) - y))
    grads = tape.gradient(whole, variables)
    means = []
    for start in range(0, E, B):
        with tf.GradientTape() as tape:
            part = tf.reduce_mean(tf.square(model(x[start:start + B]) - y[start:start + B]))
        means.append(tape.gradient(part, variables))
    plain = [tf.add_n(list(g)) / len(means) for g in zip(*means)]
    assert max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(grads, plain)) > 100 * TOLERANCE


@pytest.mark.parametrize("arguments, error, match", [
    ({"micro_batch_size": 0}, ValueError, "`micro_batch_size` must be a positive integer"),
    ({"micro_batch_size": 2.5}, TypeError, "`micro_batch_size` must be a positive integer"),
    ({"micro_batch_size": "auto"}, TypeError, "`micro_batch_size` must be None or a positive integer"),
    ({"micro_batch_size": True}, TypeError, "`micro_batch_size` must be a positive integer"),
    ({"micro_batch_size": 8, "accum_steps": 4}, ValueError, "pass one"),
    ({"micro_batch_size": 8, "schedulable": True}, ValueError, "pass one"),
    ({"micro_batch_size": 8, "accum_steps": "auto", "max_effective_batch_size": 64}, ValueError, "pass one"),
])
def test_bad_options_are_refused(arguments, error, match):
    with pytest.raises(error, match=match):
        GradientAccumulator(keras.optimizers.Adam(), **arguments)
    with pytest.raises(error, match=match):
        WindowOptions(**arguments)


def test_the_option_is_saved_only_where_given():
    assert "micro_batch_size" not in GradientAccumulator(keras.optimizers.Adam(), 4).get_config()
    config = GradientAccumulator(keras.optimizers.Adam(), micro_batch_size=8).get_config()
    assert config["micro_batch_size"] == 8
    assert GradientAccumulator.from_config(config).micro_batch_size == 8


def test_what_this_slice_does_not_take_is_refused_before_training():
    class OwnStep(keras.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    x, y = ref.regression_data(8)
    model = OwnStep(ref.mlp().layers)
    model.compile(GradientAccumulator(keras.optimizers.Adam(), micro_batch_size=4), "mse")
    with pytest.raises(NotImplementedError, match="defines its own `train_step`"):
        model.fit(x, y, batch_size=8, verbose=0)
