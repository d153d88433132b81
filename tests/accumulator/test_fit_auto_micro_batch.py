"""`GradientAccumulator(inner, micro_batch_size="auto")`: the largest micro-batch whose step
fits, found by the run (`accumulator.batch.fit_auto_micro_batch`), through real out-of-memory
errors (no mocks): a text model with a plain `Embedding`, sequences padded per batch, and a
cliff in tokens per micro-step that a later, longer batch crosses mid-run. Each out-of-memory
error costs about 10 s where oneDNN's allocator retries (on by default on AVX-512 CPUs), at
once with TF_ENABLE_ONEDNN_OPTS=0: the tests take two each at most.
"""

import logging

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, WindowOptions
from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import MicroBatchChange, next_micro_batch
from tests.accumulator import memory_cliff
from tests.accumulator import reference as ref

TOLERANCE = 1e-5
VOCABULARY = 50
E = 12
BUDGET = 40         # tokens per micro-step: 12 x 3 fits, 12 x 9 and 4 x 12 do not; 4 x 9, 3 x 12 fit
LONGEST = [3, 9, 12, 3]       # per batch (the last one of 6 samples): the cliff is crossed in batches 1 and 2
SHORTER_LAST = 6


def _rows(longest_per_batch=LONGEST, seed=1, short=3):
    """(token ids, target): E per batch (the last batch `SHORTER_LAST`), each batch's longest
    sequence last (so a step at b < E runs its first micro-batches, then runs out), the others of 1 to
    `short` ids."""
    rng = np.random.default_rng(seed)
    rows = []
    for k, longest in enumerate(longest_per_batch):
        size = SHORTER_LAST if k == len(longest_per_batch) - 1 else E
        for j in range(size):
            length = longest if j == size - 1 else int(rng.integers(1, short + 1))
            ids = rng.integers(1, VOCABULARY, size=length).astype("int32")
            rows.append((ids, np.array([np.tanh(4 * ids.mean() / VOCABULARY - 2)], "float32")))
    return rows


def _dataset(rows):
    """Batches of E, each padded with id 0 to its own longest sequence (of known count: on a
    dataset of unknown size Keras' own Adam run lands 1e-4 away from both fixed and "auto"
    micro-batches in its second epoch, which agree with each other)."""
    data = tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=(
        tf.TensorSpec((None,), tf.int32), tf.TensorSpec((1,), tf.float32)))
    return data.padded_batch(E).apply(tf.data.experimental.assert_cardinality(-(-len(rows) // E)))


class PaddedTokenCliff(keras.layers.Layer):
    """`[embedded, ids] -> embedded`, the identity, whose step needs 4 TiB once the micro-batch's
    rows times its padded length reach `budget`: static shapes, so it compiles under XLA (where
    the whole program's memory is refused at launch). The big tensor is filled with sum(x),
    updated in one place and sorted (XLA folds a reduction of a plain fill away), and what is
    added is its last element minus sum(x): exactly 0.0, without a gradient. No cliff with
    `budget=None`."""

    def __init__(self, budget=None, **kwargs):
        super().__init__(**kwargs)
        self.budget = budget

    def call(self, inputs):
        embedded, ids = inputs
        cost = tf.shape(ids, out_type=tf.int64)[0] * tf.shape(ids, out_type=tf.int64)[1]
        fits = tf.constant(True) if self.budget is None else cost < self.budget
        shape = tf.where(fits, tf.stack([cost, tf.constant(1, tf.int64)]), tf.constant([2 ** 20, 2 ** 20], tf.int64))
        total = tf.reduce_sum(embedded)
        big = tf.tensor_scatter_nd_update(tf.fill(shape, total), [[0, 0]], tf.reshape(total, [1]))
        # No gradient through the sort (its gradient's indices overflow XLA's at 2^40 elements).
        return embedded + tf.stop_gradient(tf.sort(big, axis=0)[-1, -1] - total)


def _static_model(budget=None, seed=0):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32")
    embedded = keras.layers.Embedding(VOCABULARY, 16)(ids)
    hidden = keras.layers.GlobalAveragePooling1D()(PaddedTokenCliff(budget)([embedded, ids]))
    return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Dense(8, activation="tanh")(hidden)))


def _adam():
    # Adam at 1e-3: Keras applies the padding id's many rows one by one (as in
    # test_micro_batch_embedding), and a larger step makes that round-off visible above 1e-5.
    return keras.optimizers.Adam(1e-3)


def _pair(make_model, jit_compile, epochs=2):
    """(Keras' own fit at E with the inner optimizer, "auto" on the model with the cliff), and
    their histories."""
    data = _dataset(_rows())
    large = make_model(None)
    large.compile(_adam(), "mse", metrics=["mae"], jit_compile=jit_compile)
    large_history = large.fit(data, epochs=epochs, verbose=0, shuffle=False).history
    auto = make_model(BUDGET)
    auto.compile(GradientAccumulator(_adam(), micro_batch_size="auto"), "mse", metrics=["mae"],
                 jit_compile=jit_compile)
    assert auto.optimizer.micro_batch_size is None      # before the first batch
    auto_history = auto.fit(data, epochs=epochs, verbose=0, shuffle=False).history
    return large, auto, large_history, auto_history


def _assert_exact(large, auto):
    delta = ref.max_abs_diff(large.get_weights(), auto.get_weights())
    print(f"max |dw| against Keras' fit(batch_size={E}): {delta:.3g}")
    assert delta <= TOLERANCE
    # Not the same by accident: training moved the weights far beyond the tolerance.
    assert ref.max_abs_diff(large.get_weights(), _static_model().get_weights()) > 100 * TOLERANCE


EXPECTED_CHANGES = [
    # batch 1 (9 tokens a row) runs out at 12; 12 x 3 tokens fit, so 4 (36 tokens) is taken at once
    {"update": 1, "micro_batch": 4, "previous_micro_batch": 12, "effective_batch": E, "out_of_memory_errors": 1,
     "epoch": 0},
    # batch 2 (12 a row) runs out at 4 in its third micro-batch; 3 (36 tokens) fits
    {"update": 2, "micro_batch": 3, "previous_micro_batch": 4, "effective_batch": E, "out_of_memory_errors": 1,
     "epoch": 0},
]


def _assert_changes(optimizer):
    assert optimizer.micro_batch_size == 3
    records = [change.as_record() for change in optimizer.micro_batch_changes]
    assert all(isinstance(c, MicroBatchChange) for c in optimizer.micro_batch_changes)
    assert [{k: v for k, v in r.items() if k != "seconds_lost"} for r in records] == EXPECTED_CHANGES
    assert all(r["seconds_lost"] >= 0.0 for r in records)
    assert sum(r["out_of_memory_errors"] for r in records) == 2      # few: each may cost ~10 s


def test_a_cliff_crossed_mid_run_in_later_micro_batches_trains_exactly_like_keras_large_batch(caplog):
    """The data-dependent cliff (`memory_cliff.TokenCliff`: tokens of each micro-batch's own
    longest sequence), the longest sequence last: at b = 4 the step trains two micro-batches
    (metrics and the loss tracker updated) before the third runs out; they are put back, so
    the logged loss and metrics are the large batch's too."""
    with caplog.at_level(logging.WARNING, logger="tfx_gradient_accumulator"):
        large, auto, large_history, auto_history = _pair(
            lambda budget: memory_cliff.embedding_model(budget, VOCABULARY), jit_compile=False)
    _assert_exact(large, auto)
    _assert_changes(auto.optimizer)
    assert int(auto.optimizer.iterations.numpy()) == int(large.optimizer.iterations.numpy()) == 8
    for name in ("loss", "mae"):
        np.testing.assert_allclose(auto_history[name], large_history[name], rtol=1e-5, atol=1e-6, err_msg=name)
    logged = [r.getMessage() for r in caplog.records if "micro_batch_size='auto'" in r.getMessage()]
    assert len(logged) == 2 and "micro-batch 12 of 12" in logged[0] and "micro-batch 4 (3 per update)" in logged[0]


def test_under_xla_the_same_cliff_is_taken_the_same_way_and_exactly():
    """`jit_compile=True`: one XLA program per micro-batch size and batch shape, whose memory
    is refused at launch (nothing of the step runs)."""
    large, auto, large_history, auto_history = _pair(_static_model, jit_compile=True)
    assert auto.jit_compile is True
    _assert_exact(large, auto)
    _assert_changes(auto.optimizer)
    np.testing.assert_allclose(auto_history["loss"], large_history["loss"], rtol=1e-5, atol=1e-6)


def _normalised_model(budget, seed=0):
    """Embedding -> BatchNormalization -> Dropout -> TokenCliff -> mean -> Dense: a failed
    step's micro-batches move the moving statistics and the dropout's seed state."""
    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32")
    embedded = keras.layers.Embedding(VOCABULARY, 8)(ids)
    hidden = keras.layers.Dropout(0.2)(keras.layers.BatchNormalization()(embedded))
    hidden = keras.layers.GlobalAveragePooling1D()(memory_cliff.TokenCliff(budget)([hidden, ids]))
    return keras.Model(ids, keras.layers.Dense(1)(hidden))


def test_a_failed_steps_moving_statistics_and_random_draws_are_put_back():
    """The first batch runs out whole (12 x 6 tokens; no step has fit: b halves to 6), the
    second in its second micro-batch at 6 (its first moved the moving statistics and drew its
    dropout), then 4 fits. Keras' large batch has other statistics here, so the reference is
    the same model trained at 6 for batch 0 and at 4 from then on (SGD: no optimizer state to
    carry between its two fits): "auto" lands on it, moving statistics and all."""
    data = _dataset(_rows([6, 9, 6], short=6))
    auto = _normalised_model(BUDGET)
    auto.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size="auto"), "mse")
    auto.fit(data, epochs=1, verbose=0, shuffle=False)
    assert [(c.previous_micro_batch, c.micro_batch) for c in auto.optimizer.micro_batch_changes] == [(12, 6), (6, 4)]
    reference = _normalised_model(BUDGET)
    for size, part in ((6, data.take(1)), (4, data.skip(1))):
        reference.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size=size), "mse")
        reference.fit(part, epochs=1, verbose=0, shuffle=False)
    delta = ref.max_abs_diff(reference.get_weights(), auto.get_weights())
    assert delta <= 1e-6, delta
    moving = [v for v in auto.non_trainable_variables if "moving_mean" in v.path]
    start = _normalised_model(BUDGET)
    start_moving = [v for v in start.non_trainable_variables if "moving_mean" in v.path]
    assert ref.max_abs_diff([np.array(moving[0])], [np.array(start_moving[0])]) > 1e-3


class UpdateCliffSGD(keras.optimizers.SGD):
    """SGD whose update of its first variable (from its second update on) needs 4 TiB: an error
    inside the inner update (one allocation: each costs ~10 s where the allocator retries)."""

    def update_step(self, gradient, variable, learning_rate):
        self.__dict__.setdefault("cliff_variable", variable.name)       # the first one traced
        cliff = variable.name == self.cliff_variable
        elements = tf.where(tf.logical_and(self.iterations >= 1, cliff), tf.constant(2 ** 40, tf.int64),
                            tf.constant(1, tf.int64))
        total = tf.reduce_sum(gradient)
        zero = tf.reduce_max(tf.fill(tf.reshape(elements, [1]), total)) - total
        super().update_step(gradient + zero, variable, learning_rate)


def test_an_error_inside_the_inner_update_stops_with_a_clear_error():
    x, y = ref.regression_data(40)
    model = ref.mlp()
    model.compile(GradientAccumulator(UpdateCliffSGD(0.1), micro_batch_size="auto"), "mse")
    with pytest.raises(RuntimeError, match="inside the inner optimizer's update, which stopped half-way"):
        model.fit(x, y, batch_size=20, epochs=1, verbose=0, shuffle=False)
    assert model.optimizer.micro_batch_size == 20 and model.optimizer.micro_batch_changes == []


def test_steps_per_execution_above_one_is_refused_at_fit():
    x, y = ref.regression_data(20)
    model = ref.mlp()
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.1), micro_batch_size="auto"), "mse",
                  steps_per_execution=2)
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)


@pytest.mark.parametrize("value, error, match", [
    ("largest", ValueError, "must be None, a positive integer .* or 'auto'"),
    ("", ValueError, "must be None, a positive integer .* or 'auto'"),
    (0, ValueError, "`micro_batch_size` must be a positive integer"),
    (2.5, TypeError, "`micro_batch_size` must be a positive integer"),
    (True, TypeError, "`micro_batch_size` must be a positive integer"),
])
def test_bad_values_are_refused_before_anything_is_built(value, error, match):
    with pytest.raises(error, match=match):
        GradientAccumulator(keras.optimizers.Adam(), micro_batch_size=value)
    with pytest.raises(error, match=match):
        WindowOptions(micro_batch_size=value)


def test_auto_is_kept_in_the_config_and_with_accum_steps_refused():
    optimizer = GradientAccumulator(keras.optimizers.Adam(), micro_batch_size="auto")
    assert optimizer.get_config()["micro_batch_size"] == "auto"
    assert optimizer.micro_batch_size is None and optimizer.micro_batch_changes == []
    with pytest.raises(ValueError, match="pass one"):
        GradientAccumulator(keras.optimizers.Adam(), accum_steps=4, micro_batch_size="auto")


@pytest.mark.parametrize("failed, effective, per_sample, fit, expected", [
    (1024, 1024, 1, None, 512),          # nothing fit yet: N doubles
    (512, 1024, 1, None, 256),
    (300, 300, 1, None, 150),
    (150, 300, 1, None, 75),
    (12, 12, 9, 36, 4),                  # 4 x 9 = 36 tokens fit; 6 x 9 would not
    (4, 12, 12, 36, 3),
    (256, 1024, 100, 25600, 205),        # the same shape failing again (the allocator's state): next even split
    (256, 1024, 150, 25600, 147),        # 1.5 times longer: 1024 / 7 (171 x 150 = 25650 is over)
    (12, 12, 100, 36, 1),                # nothing predicted to fit: one sample
])
def test_the_next_micro_batch_is_an_even_split_predicted_to_fit(failed, effective, per_sample, fit, expected):
    chosen = next_micro_batch(failed, effective, per_sample, fit)
    assert chosen == expected
    assert chosen < failed
    assert chosen == -(-effective // -(-effective // chosen))       # ceil(E / N) for some N


def test_a_later_fit_at_a_larger_batch_splits_the_larger_batch():
    """A second `fit` at a larger batch_size: E is the larger batch (the splits are of it, the
    records name it), b stays the one that fit, and both fits land on Keras' own."""
    from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import state_of

    x, y = ref.regression_data(48)
    models = []
    for optimizer in (keras.optimizers.Adam(1e-2), GradientAccumulator(keras.optimizers.Adam(1e-2),
                                                                       micro_batch_size="auto")):
        model = memory_cliff.mlp(cliff=None if not isinstance(optimizer, GradientAccumulator) else 12)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
        model.fit(x, y, batch_size=24, epochs=1, shuffle=False, verbose=0)
        models.append(model)
    large, auto = models
    state = state_of(auto.optimizer)
    assert (state.effective_batch, auto.optimizer.micro_batch_size) == (24, 8)
    assert ref.max_abs_diff(large.get_weights(), auto.get_weights()) < 1e-5
