"""`find_micro_batch` and `fit_with_out_of_memory_recovery` on a text model with a plain
`Embedding`, through real out-of-memory errors (`memory_cliff.TokenCliff`: tokens per step).

The embedding's gradient is rows (ids and values, `accumulator.rows.window_rows`), and its ids
exist from the forward pass on: a step that runs out of memory after the lookup can stop
with some of the rows' state written. The search must put the rows back whole, and the
recovery's drop must empty them even when the step counted no micro-batch; then both are
exact against Keras' large batch, at a largest micro-batch that is not a power of two.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import (GradientAccumulator, MicroBatchFit, find_micro_batch,
                                                  fit_with_out_of_memory_recovery)
from tfx_gradient_accumulator.accumulator.batch.micro_batch import split
from tests.accumulator import memory_cliff
from tests.accumulator import reference as ref

VOCABULARY = 50
SHORT = 8
BUDGET = 4 * SHORT    # a step runs out from micro-batch x longest sequence = 32 on: 3 x 8 fits, 4 x 8 not


def _inner(name):
    # Adam at 1e-3: Keras' Adam applies the padding id's many rows one by one, and a larger
    # step makes its round-off (not the window) visible above 1e-5.
    return keras.optimizers.Adam(1e-3) if name == "adam" else keras.optimizers.SGD(0.1)


def _rows(longest_per_batch, effective_batch_size, longest_first=True, seed=1):
    """(token ids, target) pairs, E per batch: in batch i one sequence of `longest` ids (the
    batch's first, or its last) and the others of 1 to `SHORT` ids, at random."""
    rng = np.random.default_rng(seed)
    rows = []
    for longest in longest_per_batch:
        for j in range(effective_batch_size):
            is_longest = j == (0 if longest_first else effective_batch_size - 1)
            length = longest if is_longest else int(rng.integers(1, SHORT + 1))
            ids = rng.integers(1, VOCABULARY, size=length).astype("int32")
            rows.append((ids, np.array([np.tanh(4 * ids.mean() / VOCABULARY - 2)], "float32")))
    return rows


def _dataset(rows, effective_batch_size):
    """Batches of E, each padded with id 0 to its own longest sequence (of known size)."""
    data = tf.data.Dataset.from_generator(lambda: iter(rows), output_signature=(
        tf.TensorSpec((None,), tf.int32), tf.TensorSpec((1,), tf.float32)))
    return data.padded_batch(effective_batch_size).apply(
        tf.data.experimental.assert_cardinality(-(-len(rows) // effective_batch_size)))


def _compiled(inner, budget=BUDGET):
    model = memory_cliff.embedding_model(budget, VOCABULARY)
    model.compile(GradientAccumulator(_inner(inner), schedulable=True), "mse")
    return model


def _keras_large_batch(inner, data, epochs=1, **fit_arguments):
    model = memory_cliff.embedding_model(None, VOCABULARY)
    model.compile(_inner(inner), "mse")
    model.fit(data, epochs=epochs, verbose=0, shuffle=False, **fit_arguments)
    return model


def test_the_search_finds_a_largest_micro_batch_that_is_not_a_power_of_two_and_trains_exactly():
    """4 runs out (its step can write the rows' ids before the error, not their values), 3
    fits, in buffers grown for 2 and 4. Training at 3 x 4 then lands on Keras' `fit(batch_size=E)`."""
    e = 12
    x, y = (np.array(a) for a in next(iter(_dataset(_rows([SHORT] * 3, e), e).unbatch().batch(3 * e))))
    model = _compiled("adam")
    found = find_micro_batch(model, x[:e], y[:e], effective_batch_size=e, headroom=0.0, uniform=True)
    assert found.probes == ((1, True), (2, True), (4, False), (3, True))
    assert (found.largest_fitting, found.micro_batch, found.accum_steps) == (3, 3, 4)
    assert model.optimizer.held_micro_batches == 0
    rows = [r for r in model.optimizer.window_rows if r is not None]
    assert all(int(r.count.numpy()) == 0 and r.values.shape[0] == r.indices.shape[0] for r in rows)
    model.fit(x, y, batch_size=found.micro_batch, epochs=2, verbose=0, shuffle=False)
    reference = _keras_large_batch("adam", x, epochs=2, y=y, batch_size=e)
    delta = ref.max_abs_diff(model.get_weights(), reference.get_weights())
    print(f"max |dw| against Keras' fit(batch_size={e}) after the search ({found}): {delta:.3g}")
    assert delta <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == int(reference.optimizer.iterations.numpy()) == 6


# E = 10, the largest micro-batch that fits the first batches 3 (the search above), and
# sequences that grow in batch 2. headroom 0.0: 3 x 4 (3, 3, 3, 1); 12 ids, the longest
# first: the window's first micro-step runs out (nothing counted, the rows' ids written),
# and 2 x 5 fits (not 2 x 8: 8 micro-batches of 2 would be 16 samples). headroom 0.1:
# 2 x 5; 16 ids, the longest last: the window's closing micro-step runs out (4 held), 1 x 10.
@pytest.mark.parametrize("headroom, inner, longest, longest_first, expected", [
    (0.0, "adam", 12, True, [(2, 2, 5, 0)]),
    (0.1, "sgd", 16, False, [(2, 1, 10, 4)]),
], ids=["headroom-0.0-adam-at-the-first-micro-step", "headroom-0.1-sgd-at-the-closing-micro-step"])
def test_the_recovery_through_a_cliff_mid_run_lands_on_keras_large_batch(headroom, inner, longest, longest_first,
                                                                         expected):
    e = 10
    rows = _rows([SHORT, SHORT, longest, longest], e, longest_first)
    model = _compiled(inner)
    # What `find_micro_batch` sets for a largest fitting micro-batch of 3.
    micro_batch, accum_steps = split(e, 3, headroom)
    model.optimizer.set_accum_steps(accum_steps)
    found = MicroBatchFit(micro_batch, accum_steps, e, 3, ())
    run = fit_with_out_of_memory_recovery(model, _dataset(rows, e), found, epochs=2, verbose=0)
    assert [(s.update, s.micro_batch, s.accum_steps, s.dropped) for s in run.switches] == expected
    reference = _keras_large_batch(inner, _dataset(rows, e), epochs=2)
    delta = ref.max_abs_diff(model.get_weights(), reference.get_weights())
    print(f"max |dw| against Keras' batch of {e} after {run.switches}: {delta:.3g}")
    assert delta <= 1e-5
    assert int(model.optimizer.iterations.numpy()) == 8


def _position_model(budget=None, seed=0):
    """keras.io's `TokenAndPositionEmbedding` (its position table looked up once per batch,
    `arange`; its token table once per token) -> a `TokenCliff(budget)` -> mean over time ->
    Dense(1): the lookup kind whose rows the large batch has once per position."""
    from tests.accumulator.test_lookups import TokenAndPositionEmbedding

    keras.utils.set_random_seed(seed)
    ids = keras.Input((None,), dtype="int32")
    embedded = TokenAndPositionEmbedding(20, VOCABULARY, 8)(ids)
    hidden = keras.layers.GlobalAveragePooling1D()(memory_cliff.TokenCliff(budget)([embedded, ids]))
    return keras.Model(ids, keras.layers.Dense(1)(hidden))


def _through_the_cliff(make_model, inner, rows, e, **options):
    """`fit_with_out_of_memory_recovery` from a largest fitting micro-batch of 3 (headroom 0.1),
    through sequences that grow to 16 ids in the third batch: (the model, its switches)."""
    model = make_model(BUDGET)
    model.compile(GradientAccumulator(_inner(inner), schedulable=True, **options), "mse")
    micro_batch, accum_steps = split(e, 3, 0.1)
    model.optimizer.set_accum_steps(accum_steps)
    run = fit_with_out_of_memory_recovery(model, _dataset(rows, e), MicroBatchFit(micro_batch, accum_steps, e, 3, ()),
                                          epochs=2, verbose=0)
    return model, run.switches


def test_the_recovery_is_exact_on_a_position_table_looked_up_once_per_batch():
    """Every lookup kind, the position table's too: its rows summed over the window (one row per
    position, as Keras' large batch has them) across the dropped window and the switch."""
    e = 10
    rows = _rows([SHORT, SHORT, 16, 16], e)
    model, switches = _through_the_cliff(_position_model, "adam", rows, e)
    assert switches, "the sequences of 16 ids must run out of memory at the found micro-batch"
    reference = _position_model()
    reference.compile(_inner("adam"), "mse")
    reference.fit(_dataset(rows, e), epochs=2, verbose=0, shuffle=False)
    delta = ref.max_abs_diff(model.get_weights(), reference.get_weights())
    print(f"max |dw| against Keras' batch of {e} after {switches}: {delta:.3g}")
    assert delta <= 1e-5


@pytest.mark.parametrize("inner", ["sgd", "adam"])
def test_the_recovery_is_exact_with_merged_rows(inner):
    """`merge_duplicate_rows=True` sums the window's rows per id before the inner optimizer,
    so any split of the window gives the same update: the recovery through the cliff lands on
    the same windows trained at one split without one (and, with SGD, where merging changes
    nothing, on Keras' own large batch)."""
    e = 10
    rows = _rows([SHORT, SHORT, 16, 16], e)
    model, switches = _through_the_cliff(memory_cliff.embedding_model, inner, rows, e, merge_duplicate_rows=True)
    assert switches
    same_windows = memory_cliff.embedding_model(None, VOCABULARY)
    same_windows.compile(GradientAccumulator(_inner(inner), accum_steps=2, merge_duplicate_rows=True), "mse")
    same_windows.fit(_dataset(rows, e).unbatch().padded_batch(e // 2), epochs=2, verbose=0, shuffle=False)
    delta = ref.max_abs_diff(model.get_weights(), same_windows.get_weights())
    print(f"{inner}: max |dw| against merged windows of 2 x 5 without a cliff: {delta:.3g}")
    assert delta <= 1e-5
    if inner == "sgd":
        reference = _keras_large_batch(inner, _dataset(rows, e), epochs=2)
        assert ref.max_abs_diff(model.get_weights(), reference.get_weights()) <= 1e-5


def test_the_search_is_exact_on_a_position_table_looked_up_once_per_batch():
    """The search's probes on keras.io's `TokenAndPositionEmbedding` (4 runs out, 3 fits), then
    training at the split found lands on Keras' `fit(batch_size=E)`."""
    e = 12
    x, y = (np.array(a) for a in next(iter(_dataset(_rows([SHORT] * 3, e), e).unbatch().batch(3 * e))))
    model = _position_model(BUDGET)
    model.compile(GradientAccumulator(_inner("adam"), schedulable=True), "mse")
    found = find_micro_batch(model, x[:e], y[:e], effective_batch_size=e, headroom=0.0, uniform=True)
    assert (found.largest_fitting, found.micro_batch, found.accum_steps) == (3, 3, 4)
    model.fit(x, y, batch_size=found.micro_batch, epochs=2, verbose=0, shuffle=False)
    reference = _position_model()
    reference.compile(_inner("adam"), "mse")
    reference.fit(x, y, batch_size=e, epochs=2, verbose=0, shuffle=False)
    delta = ref.max_abs_diff(model.get_weights(), reference.get_weights())
    print(f"max |dw| against Keras' fit(batch_size={e}) after the search ({found}): {delta:.3g}")
    assert delta <= 1e-5
