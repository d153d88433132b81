"""`GradientAccumulator(inner, micro_batch_size=b)`: `fit`'s batch is the effective batch,
one update trained as micro-batches inside one step (`accumulator.batch.fit_micro_batches`),
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


def _metrics_honour_a_mask_alone():
    """Whether Keras' metrics leave out masked rows without sample weights (Keras 3.8 does
    not: it applies an output's mask to `metrics=` only with sample weights, which
    `compile`'s unweighted metrics never get), so a padded micro-batch's rows stay out."""
    from tfx_gradient_accumulator.accumulator.core import seam

    y_pred = tf.constant([[1.0], [5.0]])
    seam.set_keras_mask(y_pred, tf.constant([True, False]))
    metric = keras.metrics.MeanAbsoluteError()
    metric.update_state(tf.zeros((2, 1)), y_pred)
    return float(metric.result()) == 1.0


def _compare_histories(large, micro):
    """The logged loss and weighted metrics always; unweighted ones where Keras keeps the
    padding out of them."""
    names = list(large) if _metrics_honour_a_mask_alone() else ["loss"] + [n for n in large if "weighted" in n]
    for name in names:
        np.testing.assert_allclose(micro[name], large[name], rtol=1e-5, atol=1e-6, err_msg=name)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _pair(make_model, make_optimizer, x, y, batch_size=E, micro_batch_size=B, epochs=2, loss="mse",
          jit_compile=False, metrics=None, **fit_kwargs):
    """(the large batch's model, the micro-batched one), both trained by `fit`."""
    models = []
    for optimizer in (make_optimizer(), GradientAccumulator(make_optimizer(), micro_batch_size=micro_batch_size)):
        model = make_model()
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile, metrics=metrics)
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
    assert micro.jit_compile is jit_compile
    _assert_exact(large, micro)
    # Keras counts updates: 3 batches an epoch, 2 epochs.
    assert int(micro.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 6
    assert micro.optimizer.micro_batch_size == B


def test_the_logged_loss_and_metrics_are_the_large_batchs():
    x, y = ref.regression_data(SAMPLES)
    histories = []
    for optimizer in (_adam(), GradientAccumulator(_adam(), micro_batch_size=B)):
        model = ref.mlp()
        model.compile(optimizer=optimizer, loss="mse", metrics=["mae"],
                      weighted_metrics=[keras.metrics.MeanAbsoluteError(name="weighted_mae")])
        histories.append(model.fit(x, y, batch_size=E, epochs=2, shuffle=False, verbose=0).history)
    assert set(histories[0]) == {"loss", "mae", "weighted_mae"}
    _compare_histories(histories[0], histories[1])


def test_sample_weights_and_a_summed_loss():
    x, y = ref.regression_data(SAMPLES)
    weights = np.random.RandomState(1).uniform(0.0, 2.0, SAMPLES).astype("float32")
    large, micro = _pair(ref.mlp, _adam, x, y, sample_weight=weights)
    _assert_exact(large, micro)
    summed = keras.losses.MeanSquaredError(reduction="sum")
    large, micro = _pair(ref.mlp, lambda: keras.optimizers.SGD(1e-3), x, y, loss=summed, sample_weight=weights,
                         epochs=1)
    _assert_exact(large, micro)


def test_weight_decay_ema_and_a_global_clipnorm_act_once_an_update():
    x, y = ref.regression_data(SAMPLES)

    def adamw():
        return keras.optimizers.AdamW(2e-2, weight_decay=0.1, global_clipnorm=0.05, use_ema=True,
                                      ema_overwrite_frequency=2)

    large, micro = _pair(ref.mlp, adamw, x, y, epochs=1)
    _assert_exact(large, micro)


def _sequence_model(mask_zero):
    # A loss per token; with mask_zero, outputs that carry a mask: the padding's mask joins it.
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((ref.TOKENS,), dtype="int32"),
                             keras.layers.Embedding(ref.VOCAB, 8, mask_zero=mask_zero),
                             keras.layers.Dense(5)])


@pytest.mark.parametrize("mask_zero", [False, True], ids=["unmasked", "masked"])
def test_a_loss_per_token_with_and_without_a_mask_of_its_own(mask_zero):
    x, _ = ref.token_data(30)
    x[:, 7:] = np.where(np.arange(30)[:, None] % 3 == 0, 0, x[:, 7:])     # some sequences end early
    y = np.random.RandomState(2).randint(0, 5, size=x.shape).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    large, micro = _pair(lambda: _sequence_model(mask_zero), _adam, x, y, batch_size=16, micro_batch_size=5, epochs=1,
                         loss=loss, metrics=["sparse_categorical_accuracy"])
    gap = ref.max_abs_diff(_weights(large), _weights(micro))
    assert gap < TOLERANCE, gap
    _compare_histories(large.history.history, micro.history.history)


def test_a_per_token_embedding_keeps_the_large_batchs_rows():
    # Adam with clipnorm: the repeated rows go to Keras as the large batch's IndexedSlices.
    x, y = ref.token_data(60)
    for jit_compile in (False, True):
        large, micro = _pair(ref.embedding_model, _adam, x, y, batch_size=24, micro_batch_size=7, epochs=1,
                             jit_compile=jit_compile)
        gap = ref.max_abs_diff(_weights(large), _weights(micro))
        assert gap < TOLERANCE, (jit_compile, gap)
        assert ref.max_abs_diff(_weights(large), _weights(ref.embedding_model())) > 1e-2


def test_a_table_looked_up_once_per_batch_has_its_rows_once():
    # keras.io's token and position embedding: the position table's rows are summed over
    # the micro-batches (kept apart, Adam's clipnorm sees other rows: 3e-2 off).
    from tests.accumulator.test_lookups import text_data, text_model

    x, y = text_data(60)
    large, micro = _pair(text_model, _adam, x, y, batch_size=24, micro_batch_size=7, epochs=1)
    gap = ref.max_abs_diff(_weights(large), _weights(micro))
    assert gap < TOLERANCE, gap


def test_a_dataset_batched_at_e_counts_one_update_a_batch():
    x, y = ref.regression_data(SAMPLES)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(E)
    model = ref.mlp()
    model.compile(GradientAccumulator(_adam(), micro_batch_size=B), "mse")
    model.fit(data, epochs=1, verbose=0, shuffle=False)
    large = ref.mlp()
    large.compile(_adam(), "mse")
    large.fit(data, epochs=1, verbose=0, shuffle=False)
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
    ({"micro_batch_size": "largest"}, ValueError, "`micro_batch_size` must be None, a positive integer .* or 'auto'"),
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


def test_the_micro_batches_are_a_loop_in_one_traced_step(monkeypatch):
    # 2 epochs of batches 20, 20, 10: 20 micro-batches trained, the micro-step traced once
    # per trace of the step (its outputs give the gradients' kinds, the loop's body calls it),
    # never per micro-batch; and the step traced once (the optimizer built before `fit` traces
    # it: a first trace that made variables would be traced again).
    from tfx_gradient_accumulator.accumulator.batch import fit_micro_batches

    traced, steps = [], []
    original, original_step = fit_micro_batches._micro_step, fit_micro_batches.train_step
    monkeypatch.setattr(fit_micro_batches, "_micro_step", lambda *a, **k: traced.append(1) or original(*a, **k))
    monkeypatch.setattr(fit_micro_batches, "train_step", lambda *a: steps.append(1) or original_step(*a))
    x, y = ref.regression_data(SAMPLES)
    model = ref.mlp()
    model.compile(GradientAccumulator(_adam(), micro_batch_size=B), "mse")
    model.fit(x, y, batch_size=E, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert len(traced) == len(steps) == 1, (len(traced), len(steps))


def test_a_micro_batch_larger_than_the_batch_is_one_padded_micro_batch():
    x, y = ref.regression_data(SAMPLES)
    large, micro = _pair(ref.mlp, _adam, x, y, micro_batch_size=32, epochs=1)
    _assert_exact(large, micro)


def _two_outputs():
    keras.utils.set_random_seed(0)
    features, targets = (a.shape[1] for a in ref.regression_data(1))
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(8, activation="relu")(inputs)
    return keras.Model(inputs, {"output_a": keras.layers.Dense(targets, name="output_a")(hidden),
                                "output_b": keras.layers.Dense(1, activation="sigmoid", name="output_b")(hidden)})


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_each_outputs_loss_is_logged_as_the_large_batchs(jit_compile):
    # Keras logs `output_a_loss`, `output_b_loss` (3.8 and 3.15), each weighed by its
    # batch's rows where they are static, else 1 a batch (arrays after the shorter last
    # batch): the padded micro-batch's rows would weigh it wrong.
    x, y = ref.regression_data(SAMPLES)
    labels = {"output_a": y, "output_b": (np.random.RandomState(3).rand(SAMPLES, 1) > 0.5).astype("float32")}
    histories, models = [], []
    for optimizer in (_adam(), GradientAccumulator(_adam(), micro_batch_size=B)):
        model = _two_outputs()
        model.compile(optimizer, loss={"output_a": "mse", "output_b": "binary_crossentropy"},
                      loss_weights={"output_a": 1.0, "output_b": 0.5}, jit_compile=jit_compile)
        histories.append(model.fit(x, labels, batch_size=E, epochs=2, shuffle=False, verbose=0).history)
        models.append(model)
    assert {"loss", "output_a_loss", "output_b_loss"} <= set(histories[0])
    assert set(histories[1]) == set(histories[0])
    for name in histories[0]:
        np.testing.assert_allclose(histories[1][name], histories[0][name], rtol=1e-5, atol=1e-6, err_msg=name)
    assert ref.max_abs_diff(_weights(models[0]), _weights(models[1])) < TOLERANCE


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_merge_duplicate_rows_merges_as_the_window_does(jit_compile):
    # Each id's rows summed before Adam (its clipnorm then sees one row per id): the
    # window's own accum_steps path with the option, micro-batches of 6 in windows of 4.
    x, y = ref.token_data(60)

    def trained(optimizer, batch_size):
        model = ref.embedding_model()
        model.compile(optimizer, "mse", jit_compile=jit_compile)
        model.fit(x, y, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
        return model

    window = trained(GradientAccumulator(_adam(), 4, merge_duplicate_rows=True), 6)
    micro = trained(GradientAccumulator(_adam(), micro_batch_size=6, merge_duplicate_rows=True), 24)
    assert ref.max_abs_diff(_weights(window), _weights(micro)) < TOLERANCE
    # The test can fail: Keras' large batch keeps the repeated rows.
    assert ref.max_abs_diff(_weights(trained(_adam(), 24)), _weights(micro)) > 100 * TOLERANCE
