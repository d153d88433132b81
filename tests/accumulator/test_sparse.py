"""Sparse (embedding) gradients: the same weights as Keras' own large batch.

Keras 3 applies an `IndexedSlices` gradient row by row: a row looked up twice
gets g1^2 + g2^2 in Adam's second moment, not (g1 + g2)^2. The large batch's
gradient has one row per lookup, so the window must hand the inner optimizer
those same rows (`accumulator.window.window.WindowRows`). Every reference here is Keras'
own large-batch run (`fit` with the effective batch, or `optimizer.apply` on the
large batch's gradient in a loop), never our own idea of it; the controls show
that summing the rows first (`merge_duplicate_rows=True`, the densified gradient)
lands measurably elsewhere, so each comparison can fail.

Every model compiles with `jit_compile=False` (what Keras' "auto" is on a CPU and
under a strategy): on one GPU "auto" means XLA, where the window cannot keep rows
and refuses them (tested below, with the XLA way out).
"""

import functools

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests import sweeps
from tests.accumulator import reference as ref

LENGTH = ref.TOKENS
MICRO = 8
ACCUM = 4


embedding_model = ref.embedding_model
token_data = ref.token_data


def _fit(model, optimizer, x, y, batch_size, epochs=2, **fit_kwargs):
    model.compile(optimizer=optimizer, loss="mse", jit_compile=False)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0, **fit_kwargs)
    return model


def _builtin_optimizers():
    """Every built-in Keras 3 optimizer class of the installed Keras."""
    found = {}
    for name in dir(keras.optimizers):
        cls = getattr(keras.optimizers, name)
        if (isinstance(cls, type) and issubclass(cls, keras.optimizers.Optimizer)
                and cls not in (keras.optimizers.Optimizer, keras.optimizers.LossScaleOptimizer)):
            found[cls.__name__] = cls
    return found


# Learning rates that move the weights visibly in 16 updates; options on top.
SETTINGS = {
    "SGD": dict(learning_rate=0.5, momentum=0.9, nesterov=True),
    "Adam": dict(learning_rate=1e-2),
    "AdamW": dict(learning_rate=1e-2, weight_decay=0.1),
    "Adamax": dict(learning_rate=1e-2),
    "Nadam": dict(learning_rate=1e-2),
    "RMSprop": dict(learning_rate=1e-2, momentum=0.5),
    "Adagrad": dict(learning_rate=0.1),
    "Adadelta": dict(learning_rate=1.0),
    "Adafactor": dict(learning_rate=0.05),
    "Ftrl": dict(learning_rate=0.1),
    "Lion": dict(learning_rate=1e-3),
    "Lamb": dict(learning_rate=1e-2),
    "Muon": dict(learning_rate=1e-2),
    "ScheduleFreeAdamW": dict(learning_rate=1e-2),
}
# Combinators of other optimizers (each of which is covered), not optimizers of their own.
COMBINATORS = {"MultiOptimizer"}
# Optimizers whose update is linear in the gradient's rows: for them summing
# repeated rows first changes nothing, so they have no control.
LINEAR = {"SGD", "Lion"}


def _optimizer_cases():
    cases = []
    for name, cls in sorted(_builtin_optimizers().items()):
        if name in COMBINATORS:
            continue
        settings = SETTINGS.get(name)
        marks = sweeps.marks(name) if settings is not None else [pytest.mark.skip(
            reason=f"{name}: no learning rate chosen here for a new built-in optimizer; add it to SETTINGS")]
        cases.append(pytest.param(cls, settings or {}, id=name, marks=marks))
    return cases


def test_every_built_in_optimizer_is_covered():
    """A built-in optimizer Keras adds is taken into the sweep below or named here."""
    missing = sorted(set(_builtin_optimizers()) - set(SETTINGS) - COMBINATORS)
    assert not missing, f"add {missing} to SETTINGS"


@functools.lru_cache(maxsize=None)
def _merged_adam():
    """`merge_duplicate_rows=True` with Adam(1e-2) on `token_data()`, without XLA: the same run
    for Adam's control below and the XLA comparison (computed once a module)."""
    x, y = token_data()
    merged = GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM, merge_duplicate_rows=True)
    return _fit(embedding_model(), merged, x, y, MICRO).get_weights()


@functools.lru_cache(maxsize=None)
def _uninterrupted_window():
    """Adam(1e-2) over 14 micro-batches, the last window closed: what a resumed run must end at."""
    x, y = token_data(MICRO * 14)
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM, partial_window="carry")
    model = _fit(embedding_model(), optimizer, x, y, MICRO, epochs=1)
    model.optimizer.close_partial_window("apply")
    return model.get_weights()


@pytest.mark.parametrize("cls, settings", _optimizer_cases())
def test_fit_matches_keras_large_batch_for_every_optimizer(cls, settings):
    x, y = token_data()
    expected = _fit(embedding_model(), cls(**settings), x, y, MICRO * ACCUM)
    trained = embedding_model()
    optimizer = GradientAccumulator(cls(**settings), ACCUM)
    _fit(trained, optimizer, x, y, MICRO)
    moved = ref.max_abs_diff(expected.get_weights(), embedding_model().get_weights())
    assert moved > 1e-3, "training must move the weights for the comparison to mean anything"
    assert int(optimizer.iterations.numpy()) == 2 * len(x) // (MICRO * ACCUM)
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-6
    if cls.__name__ not in LINEAR:
        # Control: the densified gradient (rows summed per index) is elsewhere.
        if cls is keras.optimizers.Adam and settings == dict(learning_rate=1e-2):
            merged = _merged_adam()
        else:
            merged = _fit(embedding_model(), GradientAccumulator(cls(**settings), ACCUM, merge_duplicate_rows=True),
                          x, y, MICRO).get_weights()
        assert ref.max_abs_diff(merged, expected.get_weights()) > 1e-5


@pytest.mark.parametrize("options", [
    dict(clipnorm=0.05), dict(global_clipnorm=0.05), dict(use_ema=True, ema_momentum=0.9),
], ids=["clipnorm", "global_clipnorm", "ema"])
def test_clipping_and_ema_act_on_the_large_batch_rows(options):
    # Keras clips an IndexedSlices by the norm of its rows, as they stand.
    x, y = token_data()
    expected = _fit(embedding_model(), keras.optimizers.Adam(1e-2, **options), x, y, MICRO * ACCUM)
    trained = _fit(embedding_model(), GradientAccumulator(keras.optimizers.Adam(1e-2, **options), ACCUM),
                   x, y, MICRO)
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-6


def _custom_loop_cases():
    """Adam's loop in make test; SGD's and AdamW's apart (their fits run in
    test_fit_matches_keras_large_batch_for_every_optimizer, Adam's loop takes the same path)."""
    for case in _optimizer_cases():
        apart = case.id in ("SGD", "AdamW")
        yield pytest.param(*case.values, id=case.id, marks=[*case.marks, *([pytest.mark.apart] * apart)])


# Apart (SGD's and AdamW's loops, 10 s to 15 s each): see _custom_loop_cases.
@pytest.mark.parametrize("cls, settings", _custom_loop_cases())
def test_custom_loop_matches_keras_large_batch_apply(cls, settings):
    """A `tf.function` tape loop: micro-batches through the wrapper, against the
    optimizer given the large batch's own (sparse) gradient. 250 samples: the last
    micro-batch (2 samples) retraces the step in the middle of a window."""
    x, y = token_data(250)
    loss_fn = keras.losses.MeanSquaredError()

    def loop(model, optimizer, batch, weighted):
        @tf.function
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            if weighted:    # the micro-batch's weight: its samples
                optimizer.apply(grads, model.trainable_variables,
                                micro_batch_weight=tf.cast(tf.shape(xb)[0], tf.float32))
            else:
                optimizer.apply(grads, model.trainable_variables)
            return grads

        for start in range(0, len(x), batch):
            grads = step(x[start:start + batch], y[start:start + batch])
        assert isinstance(grads[0], tf.IndexedSlices)
        return model

    expected = loop(embedding_model(), cls(**settings), MICRO * ACCUM, False)
    optimizer = GradientAccumulator(cls(**settings), ACCUM)
    trained = loop(embedding_model(), optimizer, MICRO, True)
    optimizer.close_partial_window()
    assert int(optimizer.iterations.numpy()) == 8
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-6


def test_uneven_micro_batches_partial_windows_and_sample_weights():
    # 250 samples: the last window holds 26 samples in micro-batches of 8, 8, 8, 2.
    x, y = token_data(250)
    sample_weight = np.random.RandomState(1).uniform(0.2, 2.0, size=len(x)).astype("float32")
    expected = _fit(embedding_model(), keras.optimizers.Adam(1e-2), x, y, MICRO * ACCUM,
                    sample_weight=sample_weight)
    trained = _fit(embedding_model(), GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM), x, y, MICRO,
                   sample_weight=sample_weight)
    assert int(trained.optimizer.iterations.numpy()) == 2 * 8
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-6


def test_merge_duplicate_rows_is_the_densified_gradient_step():
    """With `merge_duplicate_rows=True`, Adam follows the gradient of the loss:
    a hand-written large-batch loop that densifies the embedding gradient."""
    x, y = token_data()
    model, reference = embedding_model(), keras.optimizers.Adam(1e-2)
    loss_fn = keras.losses.MeanSquaredError()
    for _ in range(2):
        for start in range(0, len(x), MICRO * ACCUM):
            with tf.GradientTape() as tape:
                loss = loss_fn(y[start:start + MICRO * ACCUM], model(x[start:start + MICRO * ACCUM]))
            grads = [tf.convert_to_tensor(g) for g in tape.gradient(loss, model.trainable_variables)]
            reference.apply(grads, model.trainable_variables)
    trained = _fit(embedding_model(), GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM,
                                                          merge_duplicate_rows=True), x, y, MICRO)
    assert ref.max_abs_diff(trained.get_weights(), model.get_weights()) <= 1e-6


def test_window_state_follows_the_rows_looked_up_not_the_vocabulary():
    """The wrapper's own state for an embedding table is its window's rows."""

    def own_state_bytes(vocab):
        x, y = token_data(MICRO * 3, vocab=vocab)
        model = embedding_model(vocab)
        optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM, partial_window="carry")
        _fit(model, optimizer, x, y, MICRO, epochs=1)          # 3 micro-batches held, window open
        assert int(optimizer.micro_step.numpy()) == 3
        table = optimizer.accumulators[0]
        assert int(tf.size(table)) == 8, "a one-row stand-in, no dense buffer for a table with sparse gradients"
        rows = optimizer.window_rows[0]
        assert int(rows.count.numpy()) == 3 * MICRO * LENGTH
        inner = {id(v) for v in optimizer.inner_optimizer.variables}
        return sum(v.numpy().nbytes for v in optimizer.variables if id(v) not in inner)

    small, large = own_state_bytes(100), own_state_bytes(100_000)
    assert large == small
    rows_bytes = 3 * MICRO * LENGTH * (8 * 4 + 8)      # float32 values and int64 indices
    assert rows_bytes <= small <= rows_bytes + 1024     # the rows, and a few scalars and stand-ins


def test_resume_mid_window_from_a_keras_file(tmp_path):
    x, y = token_data(MICRO * 14)
    first = MICRO * 6                   # stop 2 micro-batches into the second window
    make = lambda: GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM, partial_window="carry")
    uninterrupted = _uninterrupted_window()

    model = _fit(embedding_model(), make(), x[:first], y[:first], MICRO, epochs=1)
    assert int(model.optimizer.window_rows[0].count.numpy()) == 2 * MICRO * LENGTH
    model.save(tmp_path / "model.keras")
    restored = keras.models.load_model(tmp_path / "model.keras")
    assert int(restored.optimizer.micro_step.numpy()) == 2
    held = 2 * MICRO * LENGTH
    np.testing.assert_array_equal(restored.optimizer.window_rows[0].values.numpy()[:held],
                                  model.optimizer.window_rows[0].values.numpy()[:held])
    restored.fit(x[first:], y[first:], batch_size=MICRO, shuffle=False, verbose=0)
    restored.optimizer.close_partial_window("apply")
    assert ref.max_abs_diff(restored.get_weights(), uninterrupted) <= 1e-6


def test_noise_scale_sees_the_window_gradient_with_rows_summed():
    # SGD: the rows and the merged runs keep identical weights, so their
    # noise-scale estimates must agree (both square the densified gradient).
    x, y = token_data()

    def noise_scale(merge):
        optimizer = GradientAccumulator(keras.optimizers.SGD(0.1), ACCUM, measure_noise_scale=True,
                                        merge_duplicate_rows=merge)
        _fit(embedding_model(), optimizer, x, y, MICRO)
        return optimizer.noise_scale

    rows, merged = noise_scale(False), noise_scale(True)
    assert np.isfinite(rows)
    assert rows == pytest.approx(merged, rel=1e-5)


def test_mixed_float16_follows_the_large_batch():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = token_data()
        lso = lambda: keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam(1e-2))

        def fit(optimizer, batch):
            model = embedding_model()
            model.compile(optimizer=optimizer, loss="mse", auto_scale_loss=False, jit_compile=False)
            model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
            return model

        expected = fit(lso(), MICRO * ACCUM)
        accumulated = fit(GradientAccumulator(lso(), ACCUM), MICRO)
        merged = fit(GradientAccumulator(lso(), ACCUM, merge_duplicate_rows=True), MICRO)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    # float16 activations round differently over 8 and 32 samples; summing
    # the rows first lands many times further away.
    diff = ref.max_abs_diff(accumulated.get_weights(), expected.get_weights())
    assert diff <= 2e-3
    assert ref.max_abs_diff(merged.get_weights(), expected.get_weights()) > 5 * diff


def test_xla_compiles_merged_rows_exactly():
    """Under jit_compile=True the row buffers cannot change size: with
    `merge_duplicate_rows=True` the rows are summed per index in a dense buffer,
    which gives the same weights as the uncompiled merged run."""
    x, y = token_data()
    make = lambda: GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM, merge_duplicate_rows=True)
    merged = _merged_adam()
    model = embedding_model()
    model.compile(make(), "mse", jit_compile=True)
    model.fit(x, y, batch_size=MICRO, epochs=2, shuffle=False, verbose=0)
    assert ref.max_abs_diff(model.get_weights(), merged) <= 1e-6


def test_xla_refuses_rows_whose_room_it_cannot_know():
    """A custom step compiled for any batch size (an input_signature of unknown batch):
    the rows' count is known neither when traced nor from a first batch."""
    model = embedding_model()
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM)
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function(jit_compile=True, input_signature=[tf.TensorSpec([None, ref.TOKENS], tf.int32),
                                                    tf.TensorSpec([None, 1], tf.float32)])
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)

    x, y = token_data(MICRO)
    with pytest.raises(ValueError, match="not known when the step is traced.*jit_compile=False"):
        step(x, y)
    assert model.get_weights()[0].tolist() == embedding_model().get_weights()[0].tolist()


def test_mirrored_replicas_match_keras_large_batch_under_the_same_strategy():
    devices = ["/cpu:0", "/cpu:1"]
    x, y = token_data()

    def fit(make_optimizer, batch):
        strategy = tf.distribute.MirroredStrategy(devices, cross_device_ops=tf.distribute.ReductionToOneDevice())
        with strategy.scope():
            model = embedding_model()
            model.compile(make_optimizer(), "mse", jit_compile=False)
        model.fit(x, y, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        return model

    expected = fit(lambda: keras.optimizers.Adam(1e-2), MICRO * ACCUM)
    trained = fit(lambda: GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM), MICRO)
    merged = fit(lambda: GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM, merge_duplicate_rows=True), MICRO)
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-6
    assert ref.max_abs_diff(merged.get_weights(), expected.get_weights()) > 1e-4


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned vector per position: a gather of one table row per token,
    the same rows for every sample (the most repeated ids of all)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def build(self, input_shape):
        self.table = self.add_weight(shape=(input_shape[1], input_shape[2]), name="positions")

    def call(self, x):
        positions = keras.ops.broadcast_to(keras.ops.arange(keras.ops.shape(x)[1]), keras.ops.shape(x)[:2])
        return x + keras.ops.take(self.table, positions, axis=0)


SEQUENCE, TRANSFORMER_VOCAB, WIDTH = 12, 30, 16


def small_transformer(seed=0):
    """Token and position embeddings, a padding mask, one attention block, a token classifier."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((SEQUENCE,), dtype="int32")
    x = keras.layers.Embedding(TRANSFORMER_VOCAB, WIDTH, mask_zero=True)(tokens)
    x = PositionEmbedding()(x)
    # No projection biases: the key bias gets an exactly-zero gradient (softmax ignores
    # a shift shared by all keys), whose rounding noise Adam would blow up to ~1e-6.
    attended = keras.layers.MultiHeadAttention(num_heads=2, key_dim=8, use_bias=False)(x, x)
    x = keras.layers.LayerNormalization()(x + attended)
    # relu, not gelu: gelu's near-zero (not zero) gradients of nearly dead units
    # carry rounding noise that Adam's normalization blows up to ~1e-6, whatever
    # the batching (measured: gelu 1.1e-6 on one kernel entry, relu 6e-8).
    hidden = keras.layers.Dense(32, activation="relu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(WIDTH)(hidden))
    return keras.Model(tokens, keras.layers.Dense(TRANSFORMER_VOCAB)(x))


def padded_sentences(samples, seed=0):
    rng = np.random.RandomState(seed)
    lengths = rng.randint(3, SEQUENCE + 1, size=samples)
    x = np.zeros((samples, SEQUENCE), "int32")
    for i, n in enumerate(lengths):
        x[i, :n] = rng.randint(1, TRANSFORMER_VOCAB, size=n)
    y = np.roll(x, -1, axis=1)                 # next token
    weights = (x > 0).astype("float32")        # one weight per real token
    return x, y, weights


def test_small_transformer_with_adamw_exclusions_matches_keras_large_batch():
    x, y, token_weights = padded_sentences(160)

    def adamw():
        optimizer = keras.optimizers.AdamW(3e-3, weight_decay=0.05)
        optimizer.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
        return optimizer

    def fit(optimizer, batch):
        model = small_transformer()
        model.compile(optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=False)
        model.fit(x, y, sample_weight=token_weights, batch_size=batch, epochs=2, shuffle=False, verbose=0)
        return model

    expected = fit(adamw(), MICRO * ACCUM)
    accumulator = GradientAccumulator(keras.optimizers.AdamW(3e-3, weight_decay=0.05), ACCUM)
    accumulator.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    trained = fit(accumulator, MICRO)
    assert int(accumulator.iterations.numpy()) == 10
    assert ref.max_abs_diff(expected.get_weights(), small_transformer().get_weights()) > 1e-3
    assert ref.max_abs_diff(trained.get_weights(), expected.get_weights()) <= 1e-6
    merged = GradientAccumulator(keras.optimizers.AdamW(3e-3, weight_decay=0.05), ACCUM, merge_duplicate_rows=True)
    merged.exclude_from_weight_decay(var_names=["bias", "gamma", "beta"])
    assert ref.max_abs_diff(fit(merged, MICRO).get_weights(), expected.get_weights()) > 1e-5


def test_window_saved_under_two_replicas_resumes_on_one_device(tmp_path):
    """Both replicas' rows go into the file (a checkpoint read of the variables
    would see replica 0's alone) and the resumed run ends like an uninterrupted one."""
    x, y = token_data(MICRO * 14)
    first = MICRO * 6                   # 2 micro-batches into the second window
    make = lambda: GradientAccumulator(keras.optimizers.Adam(1e-2), ACCUM, partial_window="carry")
    uninterrupted = _uninterrupted_window()

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        model = embedding_model()
        model.compile(make(), "mse", jit_compile=False)
    model.fit(x[:first], y[:first], batch_size=MICRO, shuffle=False, verbose=0)
    counts = strategy.experimental_local_results(model.optimizer.window_rows[0].count.value)
    assert [int(c) for c in counts] == [MICRO * LENGTH, MICRO * LENGTH]    # 2 x 4 samples each
    model.save(tmp_path / "model.keras")

    restored = keras.models.load_model(tmp_path / "model.keras")
    assert int(restored.optimizer.window_rows[0].count.numpy()) == 2 * MICRO * LENGTH
    restored.fit(x[first:], y[first:], batch_size=MICRO, shuffle=False, verbose=0)
    restored.optimizer.close_partial_window("apply")
    assert ref.max_abs_diff(restored.get_weights(), uninterrupted) <= 1e-6
