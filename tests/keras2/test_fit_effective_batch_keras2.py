"""Keras 2: `GradientAccumulator(inner, micro_batch_size=b)`, `fit`'s batch as the effective
batch, one update trained as micro-batches inside one step (`accumulator.keras2.fit_micro_batches`),
within 1e-5 of Keras 2's own `fit(batch_size=E)` with the inner optimizer.

Keras 2's optimizers merge an embedding's repeated rows before applying them; the large
batch they are compared with is Keras 2's own, as it is.
"""

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, WindowOptions
from tfx_gradient_accumulator.accumulator.core import flavours
from tests import deltas

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)")

TOLERANCE = 1e-5
SAMPLES, E, B = 50, 20, 6       # batches of 20, 20, 10; micro-batches of 6: 6+6+6+2 and 6+4 (padded)
VOCAB, TOKENS = 40, 8


def _data(samples=SAMPLES, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, 5).astype("float32")
    y = (x @ rng.randn(5, 1) + 0.1 * rng.randn(samples, 1)).astype("float32")
    return x, y


def _mlp(regularized=False):
    k2.utils.set_random_seed(0)
    regularizer = k2.regularizers.L2(1e-2) if regularized else None
    return k2.Sequential([k2.Input((5,)), k2.layers.Dense(8, activation="tanh", kernel_regularizer=regularizer),
                          k2.layers.Dense(1)])


def _tokens(samples, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randint(1, VOCAB, size=(samples, TOKENS)).astype("int32")
    x[:, :3] = rng.randint(1, 4, size=(samples, 3))        # ids repeated within and across samples
    return x, rng.randn(samples, 1).astype("float32")


def _embedding_model():
    k2.utils.set_random_seed(0)
    return k2.Sequential([k2.Input((TOKENS,), dtype="int32"), k2.layers.Embedding(VOCAB, 6),
                          k2.layers.GlobalAveragePooling1D(), k2.layers.Dense(1)])


def _adam():
    schedule = k2.optimizers.schedules.ExponentialDecay(3e-2, decay_steps=2, decay_rate=0.7)
    return k2.optimizers.Adam(schedule, clipnorm=0.05)


def _weights(model):
    return [np.array(w) for w in model.get_weights()]


def _pair(make_model, make_optimizer, x, y, batch_size=E, micro_batch_size=B, epochs=2, loss="mse",
          jit_compile=False, metrics=None, weighted_metrics=None, **fit_kwargs):
    """(the large batch's model, the micro-batched one), both trained by `fit` (`weighted_metrics`:
    a function that makes them, each model its own)."""
    models = []
    for optimizer in (make_optimizer(), GradientAccumulator(make_optimizer(), micro_batch_size=micro_batch_size)):
        model = make_model()
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile, metrics=metrics,
                      weighted_metrics=weighted_metrics() if weighted_metrics else None)
        model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
        models.append(model)
    return models


def _assert_exact(large, micro, start):
    gap = deltas.max_abs_diff(_weights(large), _weights(micro))
    assert gap < TOLERANCE, gap
    # Not the same by accident: the weights moved far beyond the tolerance.
    assert deltas.max_abs_diff(_weights(large), _weights(start)) > 100 * TOLERANCE


def _compare_histories(large, micro):
    assert set(large) == set(micro)
    for name in large:
        np.testing.assert_allclose(micro[name], large[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_an_mlp_with_adam_schedule_and_clipnorm_trains_like_the_batch_of_e(jit_compile):
    x, y = _data()
    large, micro = _pair(_mlp, _adam, x, y, jit_compile=jit_compile)
    _assert_exact(large, micro, _mlp())
    # Keras counts updates: 3 batches an epoch, 2 epochs.
    assert int(micro.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 6
    assert micro.optimizer.micro_batch_size == B
    assert isinstance(micro.optimizer.micro_batch_size, int)


def test_the_logged_loss_and_metrics_are_the_large_batchs():
    # The padding is out of the logged loss (Keras 2's compiled loss logs each call, weighed by
    # its rows: the step logs the update's loss once) and out of the weighted and unweighted metrics.
    x, y = _data()
    large, micro = _pair(_mlp, _adam, x, y, metrics=["mae"],
                         weighted_metrics=lambda: [k2.metrics.MeanAbsoluteError(name="weighted_mae")])
    histories = large.history.history, micro.history.history
    assert set(histories[0]) == {"loss", "mae", "weighted_mae"}
    _compare_histories(*histories)


def test_sample_weights_and_a_summed_loss():
    x, y = _data()
    weights = np.random.RandomState(1).uniform(0.0, 2.0, SAMPLES).astype("float32")
    large, micro = _pair(_mlp, _adam, x, y, sample_weight=weights, weighted_metrics=lambda: ["mae"])
    _assert_exact(large, micro, _mlp())
    _compare_histories(large.history.history, micro.history.history)
    summed = k2.losses.MeanSquaredError(reduction="sum")
    large, micro = _pair(_mlp, lambda: k2.optimizers.SGD(1e-3), x, y, loss=summed, sample_weight=weights,
                         epochs=1)
    _assert_exact(large, micro, _mlp())
    _compare_histories(large.history.history, micro.history.history)


def test_a_weight_regularizer_counts_once_an_update():
    # Keras 2's compute_loss adds the model's losses to each micro-batch's; weighed by D_i and
    # divided by their sum, they count once, as in the large batch.
    x, y = _data()
    large, micro = _pair(lambda: _mlp(regularized=True), _adam, x, y)
    _assert_exact(large, micro, _mlp(regularized=True))
    _compare_histories(large.history.history, micro.history.history)


def _two_outputs():
    k2.utils.set_random_seed(0)
    inputs = k2.Input((5,))
    hidden = k2.layers.Dense(8, activation="tanh")(inputs)
    return k2.Model(inputs, [k2.layers.Dense(1, name="a")(hidden), k2.layers.Dense(3, name="b")(hidden)])


def test_two_outputs_and_their_logged_losses():
    x, y = _data()
    targets = [y, np.random.RandomState(3).randn(SAMPLES, 3).astype("float32")]
    # SGD: with Adam here, Keras 2's own large batch with its samples permuted in each batch
    # lands 2e-5 from itself (float32's rounding, amplified by a small second moment).
    large, micro = _pair(_two_outputs, lambda: k2.optimizers.SGD(5e-2, momentum=0.9), x, targets,
                         loss=["mse", "mae"])
    _assert_exact(large, micro, _two_outputs())
    assert set(large.history.history) == {"loss", "a_loss", "b_loss"}
    _compare_histories(large.history.history, micro.history.history)


class _Subclassed(k2.Model):
    def __init__(self):
        super().__init__()
        self.hidden, self.out = k2.layers.Dense(8, activation="tanh"), k2.layers.Dense(1)

    def call(self, x):
        return self.out(self.hidden(x))


def _subclassed():
    k2.utils.set_random_seed(0)
    return _Subclassed()


def test_a_subclassed_model_built_by_its_first_step():
    # Its variables do not exist until fit's first step calls it: the step builds it first.
    x, y = _data()
    large, micro = _pair(_subclassed, _adam, x, y)
    assert int(micro.optimizer.iterations.numpy()) == 6
    start = _subclassed()
    start(x[:1])
    _assert_exact(large, micro, start)


def test_weight_decay_ema_and_a_global_clipnorm_act_once_an_update():
    x, y = _data()

    def adamw():
        return k2.optimizers.AdamW(2e-2, weight_decay=0.1, global_clipnorm=0.05, use_ema=True,
                                   ema_momentum=0.5, ema_overwrite_frequency=2)

    large, micro = _pair(_mlp, adamw, x, y, epochs=1)
    _assert_exact(large, micro, _mlp())


def _sequence_model(mask_zero):
    # A loss per token; with mask_zero, outputs that carry a mask: the padding's mask joins it.
    k2.utils.set_random_seed(0)
    return k2.Sequential([k2.Input((TOKENS,), dtype="int32"), k2.layers.Embedding(VOCAB, 8, mask_zero=mask_zero),
                          k2.layers.Dense(5)])


@pytest.mark.parametrize("mask_zero", [False, True], ids=["unmasked", "masked"])
def test_a_loss_per_token_with_and_without_a_mask_of_its_own(mask_zero):
    x, _ = _tokens(30)
    x[:, 5:] = np.where(np.arange(30)[:, None] % 3 == 0, 0, x[:, 5:])     # some sequences end early
    y = np.random.RandomState(2).randint(0, 5, size=x.shape).astype("int32")
    loss = k2.losses.SparseCategoricalCrossentropy(from_logits=True)
    large, micro = _pair(lambda: _sequence_model(mask_zero), _adam, x, y, batch_size=16, micro_batch_size=5,
                         epochs=1, loss=loss, metrics=["sparse_categorical_accuracy"])
    _assert_exact(large, micro, _sequence_model(mask_zero))
    _compare_histories(large.history.history, micro.history.history)


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_an_embedding_trains_like_keras2s_large_batch(jit_compile):
    # Adam with clipnorm; Keras 2 merges the repeated rows of the large batch's IndexedSlices,
    # and of the micro-batches' rows concatenated (the padding's rows zeros) alike.
    x, y = _tokens(60)
    large, micro = _pair(_embedding_model, _adam, x, y, batch_size=24, micro_batch_size=7, epochs=1,
                         jit_compile=jit_compile)
    _assert_exact(large, micro, _embedding_model())
    assert int(micro.optimizer.iterations.numpy()) == 3


def _text_model():
    class TokenAndPositionEmbedding(k2.layers.Layer):     # keras.io's, in tf.keras
        def __init__(self):
            super().__init__()
            self.token_emb = k2.layers.Embedding(input_dim=VOCAB, output_dim=8)
            self.pos_emb = k2.layers.Embedding(input_dim=TOKENS, output_dim=8)

        def call(self, x):
            return self.token_emb(x) + self.pos_emb(tf.range(start=0, limit=tf.shape(x)[-1], delta=1))

    k2.utils.set_random_seed(0)
    inputs = k2.Input((TOKENS,), dtype="int32")
    hidden = k2.layers.GlobalAveragePooling1D()(TokenAndPositionEmbedding()(inputs))
    return k2.Model(inputs, k2.layers.Dense(1)(hidden))


def test_a_table_looked_up_once_per_batch_has_its_rows_once():
    x, y = _tokens(60)
    large, micro = _pair(_text_model, _adam, x, y, batch_size=24, micro_batch_size=7, epochs=1)
    _assert_exact(large, micro, _text_model())


def test_a_dataset_batched_at_e_counts_one_update_a_batch():
    x, y = _data()
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(E)
    large, micro = _pair(_mlp, _adam, data, None, batch_size=None, epochs=1)
    assert int(micro.optimizer.iterations.numpy()) == 3
    _assert_exact(large, micro, _mlp())


def test_a_micro_batch_larger_than_the_batch_is_one_padded_micro_batch():
    x, y = _data()
    large, micro = _pair(_mlp, _adam, x, y, micro_batch_size=32, epochs=1)
    _assert_exact(large, micro, _mlp())


def test_the_padding_would_show_if_it_were_trained():
    # The test can fail: the micro-batches' padding (the batch's first samples again) trained
    # as real rows moves the weights far beyond the tolerance from the large batch.
    x, y = _data(E)
    model = _mlp()
    variables = model.trainable_variables
    with tf.GradientTape() as tape:
        whole = tf.reduce_mean(tf.square(model(x) - y))
    padded = np.concatenate([x, x[:24 - E]]), np.concatenate([y, y[:24 - E]])      # 4 micro-batches of 6
    grads = tape.gradient(whole, variables)
    with tf.GradientTape() as tape:
        with_padding = tf.reduce_mean(tf.square(model(padded[0]) - padded[1]))
    wrong = tape.gradient(with_padding, variables)
    assert max(float(tf.reduce_max(tf.abs(a - b))) for a, b in zip(grads, wrong)) > 100 * TOLERANCE


def test_the_micro_batches_are_a_loop_in_one_traced_step(monkeypatch):
    # 2 epochs of batches 20, 20, 10: 20 micro-batches trained, the micro-step traced once per
    # trace of the step (its outputs give the gradients' kinds, the loop's body calls it), never
    # per micro-batch.
    from tfx_gradient_accumulator.accumulator.keras2 import fit_micro_batches

    traced, steps = [], []
    original, original_step = fit_micro_batches._micro_step, fit_micro_batches.train_step
    monkeypatch.setattr(fit_micro_batches, "_micro_step", lambda *a, **k: traced.append(1) or original(*a, **k))
    monkeypatch.setattr(fit_micro_batches, "train_step", lambda *a: steps.append(1) or original_step(*a))
    x, y = _data()
    model = _mlp()
    model.compile(GradientAccumulator(_adam(), micro_batch_size=B), "mse")
    model.fit(x, y, batch_size=E, epochs=2, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert 2 <= len(traced) <= 4 and len(traced) == len(steps), (len(traced), len(steps))


@pytest.mark.parametrize("arguments, error, match", [
    ({"micro_batch_size": 0}, ValueError, "`micro_batch_size` must be a positive integer"),
    ({"micro_batch_size": 2.5}, TypeError, "`micro_batch_size` must be a positive integer"),
    ({"micro_batch_size": True}, TypeError, "`micro_batch_size` must be a positive integer"),
    ({"micro_batch_size": 8, "accum_steps": 4}, ValueError, "pass one"),
    ({"micro_batch_size": 8, "schedulable": True}, ValueError, "pass one"),
])
def test_bad_options_are_refused(arguments, error, match):
    with pytest.raises(error, match=match):
        GradientAccumulator(k2.optimizers.Adam(), **arguments)
    with pytest.raises(error, match=match):
        WindowOptions(**arguments)


def test_the_option_is_saved_and_restored():
    assert "micro_batch_size" not in GradientAccumulator(k2.optimizers.Adam(), 4).get_config()
    optimizer = GradientAccumulator(k2.optimizers.Adam(), micro_batch_size=8)
    config = optimizer.get_config()
    assert config["micro_batch_size"] == 8
    assert type(optimizer).from_config(config).micro_batch_size == 8
    assert GradientAccumulator(k2.optimizers.Adam(), options=WindowOptions(micro_batch_size=3)).micro_batch_size == 3


def test_what_it_does_not_take_is_refused_before_training():
    class OwnStep(k2.Sequential):
        def train_step(self, data):
            return super().train_step(data)

    x, y = _data(8)
    model = OwnStep(_mlp().layers)
    model.compile(GradientAccumulator(k2.optimizers.Adam(), micro_batch_size=4), "mse")
    with pytest.raises(NotImplementedError, match="defines its own `train_step`"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 0
    # Several replicas and loss scaling are taken: test_fit_effective_batch_keras2_distributed.py
    # and test_fit_effective_batch_keras2_mixed.py (their refusals too).


def test_a_saved_model_loads_with_its_micro_batch_size_and_trains_on_alike(tmp_path):
    x, y = _data()
    model = _mlp()
    model.compile(GradientAccumulator(_adam(), micro_batch_size=B), "mse")
    model.fit(x, y, batch_size=E, epochs=1, shuffle=False, verbose=0)
    model.save(tmp_path / "model.keras")
    loaded = k2.models.load_model(tmp_path / "model.keras")
    assert loaded.optimizer.micro_batch_size == B
    for trained in (model, loaded):
        trained.fit(x, y, batch_size=E, epochs=1, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations.numpy()) == 6
    assert deltas.max_abs_diff(_weights(model), _weights(loaded)) < TOLERANCE
