"""Rows of sparse gradients in the window: their buffers, whether a gradient goes there, their mean.

Sparse gradients (`tf.IndexedSlices`) are kept as rows, not summed, because Keras 3
applies repeated indices row by row (its Adam squares each occurrence). The
window's rows are the large batch's rows, so the inner optimizer makes Keras'
large-batch update; `merge_duplicate_rows=True` sums each index's rows first.
Rows of a lookup made once per batch (`accumulator.rows.lookups`) are summed position
by position instead. Memory follows the ids looked up, not the vocabulary.

Under XLA (`jit_compile=True`, Keras' "auto" on one GPU) a buffer cannot change size
inside the compiled step, nor be sliced by a count known only at run time. There the
row buffers get their room outside the step: the rows of one micro-batch, known when
the step is traced (or, in `fit`, read from its first batch: `accumulator.rows.row_room`),
times the window's length. Micro-batch k's rows are written after the window's
earlier rows, and the close reads the whole buffer, the rows past the window's
count set to zero: the inner optimizer then gets the large batch's rows plus zero
rows, which change nothing (Keras' sparse updates map a zero row to no change). The
room follows the longest window (`set_accum_steps` grows it; XLA compiles the step
again for the new size) and the largest micro-batch traced.
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.rows import lookups
from tfx_gradient_accumulator.accumulator.core import replicas, seam
from tfx_gradient_accumulator.accumulator.core._tf import (
    backing_variable, divide_in_place, local_components, runtime_shape,
)

logger = logging.getLogger(__name__)

# The name scope of the rows' kernels: the exact sparse update's own, which a step's
# kernel count credits beside Keras' (`benchmarks/kernel_count.py`).
ROWS_SCOPE = "window_rows"

XLA_ROWS_MESSAGE = (
    "GradientAccumulator got a sparse gradient (tf.IndexedSlices, from an Embedding or "
    "another gather) for {name} inside an "
    "XLA-compiled step (jit_compile=True; Keras' default jit_compile='auto' turns XLA on "
    "for one GPU) whose number of rows is not known when the step is traced, and no "
    "room was made for them before (in `fit`, the room is read from the first batch of "
    "arrays or of a tf.data.Dataset). XLA cannot compile buffers that change size. "
    "Give the step inputs of static shape (a tf.function input_signature with the batch "
    "size, or a dataset batched with drop_remainder=True), compile with "
    "jit_compile=False, or construct the GradientAccumulator with "
    "merge_duplicate_rows=True to sum each index's rows first (the densified gradient, "
    "Keras' own accumulation, not the large batch's update).")

ROOM_OVERFLOW_MESSAGE = (
    "Under XLA, a micro-batch had more sparse-gradient rows for {name} than the room "
    "made for them ({room} rows per micro-batch, from the first micro-batch seen): "
    "its rows, and those of every window since, were not all applied. Give every "
    "micro-batch the same shape (pad sequences to one length), or compile with "
    "jit_compile=False.")

EAGER_ROWS_MESSAGE = (
    "GradientAccumulator got a sparse gradient in an eager step (no tf.function, or "
    "run_eagerly=True): with no traced program to read, it cannot tell a lookup made "
    "once per batch (a position table's arange) from a lookup per sample, and keeps "
    "every micro-batch's rows apart. A once-per-batch lookup then trains unlike the "
    "large batch with Adam-like optimizers; run the step in a tf.function.")


class WindowRows:
    """The rows of one variable's sparse gradients in the open window.

    Attributes:
        values: ``[capacity, *variable.shape[1:]]``: each row times its
            micro-batch's weight, in the order the micro-batches came.
        indices: ``[capacity]``: the row of the variable each value is for.
        count: how many of the ``capacity`` rows the window holds.

    The buffers grow (to exactly the rows held) only when a micro-batch does not
    fit; after the first full window they are written in place. Replica-local
    under a strategy, like the accumulators.
    """

    def __init__(self, values, indices, count):
        self.values, self.indices, self.count = values, indices, count

    @property
    def variables(self):
        """The three variables: values, indices, count."""
        return [self.values, self.indices, self.count]

    def add(self, grad, weight, once_per_batch, strategy):
        """Replica-local: `weight * grad`'s rows, appended, or summed position by position
        for a lookup made once per batch on one replica. Under XLA, appended in the
        room made for them (`append_rows_in_room`). Under the name scope `ROWS_SCOPE`, as
        every kernel of the rows (`benchmarks/kernel_count.py` tells them by it)."""
        with tf.name_scope(ROWS_SCOPE):
            if once_per_batch and replicas.replicas_in_sync() == 1:
                add_rows_in_place(self.values, self.indices, self.count, grad, weight, strategy)
            elif seam.in_xla_context():
                append_rows_in_room(self.values, self.indices, self.count, grad, weight)
            else:
                append_rows(self.values, self.indices, self.count, grad, weight)

    def reset(self, in_room=False):
        """Empties the rows (their buffers stay). A room (`in_room`, XLA) that
        overflowed stays marked (its count past its capacity) until
        `refuse_overflowed_room` reads it on the host."""
        with tf.name_scope(ROWS_SCOPE):
            self._reset(in_room)

    def _reset(self, in_room):
        """`reset`'s body."""
        if not in_room:
            self.count.assign(0)
            return
        count = backing_variable(self.count).read_value()
        capacity = tf.shape(backing_variable(self.indices), out_type=tf.int64)[0]
        self.count.assign(tf.where(count > capacity, count, tf.zeros([], tf.int64)))

    def even_out(self, strategy):
        """Outside any step: the values and the ids get the same rows (the shorter
        buffer padded with zero rows), as a step that runs to its end leaves them; one
        stopped part-way (out of memory) can leave the values grown and the ids not."""
        with tf.init_scope():
            rows = max(runtime_shape(c)[0] for b in (self.values, self.indices) for c in local_components(b, strategy))
        _make_room(self.values, self.indices, int(rows), strategy)

    def mean(self, variable, weight_sum, count=None, merge=False):
        """The window's rows, from every replica, divided by `weight_sum`, for `variable`.

        The `tf.IndexedSlices` the large batch's gradient would be: one row per
        looked-up occurrence, in the order of the samples (of replica 0's
        samples, then replica 1's, as Keras gathers them), or, with `merge`, one
        row per index. `count`: the rows of a once-per-batch lookup, known when
        traced (for XLA), else None.
        """
        with tf.name_scope(ROWS_SCOPE):
            return self._mean(variable, weight_sum, count, merge)

    def _mean(self, variable, weight_sum, count, merge):
        """`mean`'s body."""
        shape = tf.constant(tuple(variable.shape), tf.int64)
        if replicas.replicas_in_sync() == 1:
            # Divided where they lie (see _tf.divide_in_place): no second copy of the
            # rows next to the buffer while the inner optimizer runs.
            divide_in_place([backing_variable(self.values)], weight_sum)
            if count is None and seam.in_xla_context():
                slices = tf.IndexedSlices(*read_room(self.values, self.indices, self.count), shape)
            else:
                slices = tf.IndexedSlices(*read_rows(self.values, self.indices, self.count, count), shape)
        else:
            slices = replicas.gather_over_replicas(tf.IndexedSlices(
                *read_rows(self.values, self.indices, self.count), shape))
            if count is not None:
                slices = rows_of_replicas_of_the_large_batch(
                    slices, count, replicas.replicas_in_sync(), tuple(variable.shape)[1:])
            slices = tf.IndexedSlices(slices.values / tf.cast(weight_sum, slices.values.dtype),
                                      slices.indices, slices.dense_shape)
        if merge:
            slices = merge_duplicate_rows(slices)
        return tf.IndexedSlices(tf.cast(slices.values, variable.dtype), slices.indices, slices.dense_shape)


def keeps_rows(state, index, grad, dense_is_exact, across_replicas):
    """Whether a sparse gradient `grad` for variable `index` goes to its row buffers.

    Rows of a lookup made once per batch (`accumulator.rows.lookups`, decided here
    from the traced program and remembered, for eager steps, in
    `state.notes.once_per_batch`) are summed position by position in buffers of a
    size fixed when the step is traced: kept everywhere, XLA included. Rows
    per sample are kept under XLA (`jit_compile=True`) in a room made outside
    the step (`has_room`), where the rows' count is known when the step is
    traced or was read from `fit`'s first batch (`accumulator.rows.row_room`).

    Not where the buffers cannot be used: under XLA without a known room, or
    where `across_replicas` is False (a class whose checkpoints would read
    replica 0's rows alone) under several replicas. There a sparse gradient is
    summed densely, which makes the same update where repeated rows are summed
    anyway (`dense_is_exact`: `merge_duplicate_rows=True`, or an inner
    optimizer that sums them itself; under XLA also chosen before a room, since
    XLA cannot merge rows); otherwise it is refused.

    Args:
        state: the window's `WindowState` (reads `saved.rows`, `variables`; notes
            `once_per_batch`, `warned_eager_rows` in `notes`).
        index: the variable's index in `state.variables`.
        grad: its `tf.IndexedSlices` gradient.
        dense_is_exact: whether summing the rows densely makes the same update.
        across_replicas: whether rows are kept under several replicas.

    Returns:
        True for the row buffers, False for the dense buffer.

    Raises:
        ValueError: under XLA, where neither rows nor a dense sum is exact.
    """
    if state.saved.rows[index] is None:
        return False
    notes, kind = state.notes, lookups.kind_of_rows(grad.indices)
    if kind == lookups.ONCE_PER_BATCH:
        notes.once_per_batch[index] = grad.indices.shape.num_elements()
    elif kind == lookups.PER_SAMPLE:
        notes.once_per_batch.pop(index, None)
    elif index not in notes.once_per_batch and not notes.warned_eager_rows:
        notes.warned_eager_rows = True
        logger.warning(EAGER_ROWS_MESSAGE)
    xla = seam.in_xla_context()
    if index in notes.once_per_batch:
        if not xla or notes.once_per_batch[index] is not None:
            return True
    elif not xla:
        if replicas.replicas_in_sync() == 1 or across_replicas:
            return True
    elif not dense_is_exact and replicas.replicas_in_sync() == 1 and has_room(state, index, grad):
        return True
    if dense_is_exact:
        return False
    variable = state.variables[index]
    raise ValueError(XLA_ROWS_MESSAGE.format(name=getattr(variable, "path", None) or variable.name))


def has_room(state, index, grad):
    """Whether variable `index`'s rows have room under XLA, made now (outside the step)
    when `grad`'s rows are known as the step is traced: the room is the rows of the
    largest micro-batch traced (or read from `fit`'s first batch) times the window."""
    rows = grad.indices.shape.num_elements()
    if rows is not None:
        note_room(state, index, rows)
    if index not in state.notes.row_room:
        return False
    with tf.init_scope():
        window = backing_variable(state.saved.accum_steps).numpy()
    # A window built while this step is traced is not initialized yet (it reads as an
    # empty array): its length is then the one it was built with.
    grow_rooms(state, window if window.shape == () else state.built_accum_steps, [index])
    return True


def note_room(state, index, rows):
    """Variable `index`'s room holds at least `rows` rows per micro-batch (rooms only grow)."""
    state.notes.row_room[index] = max(int(rows), state.notes.row_room.get(index, 0))


def grow_rooms(state, window, indices=None):
    """Outside any step: room for `window` micro-batches in the row buffers that have
    a room (`state.notes.row_room`; `indices`: only these). Rooms only grow, keeping the
    rows they hold: a step compiled for the old size is compiled again."""
    room = state.notes.row_room
    for index in room if indices is None else indices:
        rows = state.saved.rows[index]
        _make_room(rows.values, rows.indices, room[index] * max(int(window), 1), state.strategy)


def refuse_overflowed_room(state):
    """Raises where a micro-batch under XLA had more rows than its room (read on the host).

    Raises:
        RuntimeError: naming the variable, the room, and what to do.
    """
    for index, room in state.notes.row_room.items():
        rows = state.saved.rows[index]
        count = int(backing_variable(rows.count).numpy())
        if count > int(runtime_shape(backing_variable(rows.indices))[0]):
            variable = state.variables[index]
            raise RuntimeError(ROOM_OVERFLOW_MESSAGE.format(
                name=getattr(variable, "path", None) or variable.name, room=room))


def append_rows(values, indices, count, grad, weight):
    """Appends `weight * grad`'s rows (a `tf.IndexedSlices`) to a variable's window rows.

    The rows go where the window's last ones end, written in place while the
    buffers have room; buffers too small are replaced by ones holding exactly the
    rows so far, so they grow during the first window and then stay the size of
    the largest window. Memory follows the ids looked up, not the vocabulary.

    The writes run one after another: the values (which wait for the backward pass),
    then the ids (known from the forward pass on), then the count. A step that fails
    part-way (out of memory) leaves at most values that the count does not cover, never
    ids without their values nor a count past the rows written. So the values' buffer is
    never shorter than the ids' (a grow writes the values first; `_make_room` and
    `even_out` make them equal), and the ids' buffer is the room: where the values' is
    longer, a grow cuts it back, a write stays inside it.
    """
    values, indices, count = backing_variable(values), backing_variable(indices), backing_variable(count)
    new_values = tf.cast(grad.values, values.dtype) * tf.cast(weight, values.dtype)
    new_indices = tf.cast(tf.reshape(grad.indices, [-1]), tf.int64)
    start = count.read_value()
    end = start + tf.shape(new_indices, out_type=tf.int64)[0]

    def grow():
        grown = values.assign(tf.concat([values[:start], new_values], 0), read_value=False)
        with tf.control_dependencies([grown]):
            grown = indices.assign(tf.concat([indices[:start], new_indices], 0), read_value=False)
        with tf.control_dependencies([grown]):
            count.assign(end, read_value=False)

    def write():
        written = _write_rows(values, start, end, new_values)
        with tf.control_dependencies([written]):
            written = _write_rows(indices, start, end, new_indices)
        with tf.control_dependencies([written]):
            count.assign(end, read_value=False)

    capacity = tf.shape(indices, out_type=tf.int64)[0]
    tf.cond(end > capacity, grow, write)


def _write_rows(buffer, start, end, rows):
    """`buffer[start:end] = rows`, in the buffer's own memory (one kernel)."""
    return tf.raw_ops.ResourceStridedSliceAssign(
        ref=buffer.handle, begin=tf.reshape(start, [1]), end=tf.reshape(end, [1]),
        strides=tf.ones([1], tf.int64), value=rows)


def append_rows_in_room(values, indices, count, grad, weight):
    """Under XLA: writes `weight * grad`'s rows after the window's rows, in the room
    made for them outside the step (sizes fixed when compiled, the offset read on the
    device). A micro-batch that does not fit writes nothing and marks the count past
    the capacity (`refuse_overflowed_room` reports it on the host)."""
    values, indices, count = backing_variable(values), backing_variable(indices), backing_variable(count)
    new_values = tf.cast(grad.values, values.dtype) * tf.cast(weight, values.dtype)
    new_indices = tf.cast(tf.reshape(grad.indices, [-1]), tf.int64)
    start = count.read_value()
    end = start + tf.shape(new_indices, out_type=tf.int64)[0]
    capacity = tf.shape(indices, out_type=tf.int64)[0]

    def write():
        positions = tf.range(start, end)[:, None]
        tf.raw_ops.ResourceScatterNdUpdate(ref=values.handle, indices=positions, updates=new_values)
        tf.raw_ops.ResourceScatterNdUpdate(ref=indices.handle, indices=positions, updates=new_indices)
        return end

    count.assign(tf.cond(end <= capacity, write, lambda: tf.maximum(start, capacity + 1)), read_value=False)


def add_rows_in_place(values, indices, count, grad, weight, strategy):
    """Adds `weight * grad`'s rows to a variable's window rows position by position.

    For a lookup made once per batch (`accumulator.rows.lookups`): every micro-batch
    looks up the same ids, and the large batch has one row per id position with
    all its samples summed into it. The window's first micro-batch writes its
    rows, the others add theirs to them. With the row count known when the
    step is traced, the buffers get exactly that room then (outside the graph),
    so the step holds no buffer that changes size: XLA compiles it.
    """
    values, indices, count = backing_variable(values), backing_variable(indices), backing_variable(count)
    new_values = tf.cast(grad.values, values.dtype) * tf.cast(weight, values.dtype)
    new_indices = tf.cast(tf.reshape(grad.indices, [-1]), tf.int64)
    rows = new_indices.shape[0]
    if rows is not None:
        _make_room(values, indices, rows, strategy)
    held = count.read_value()
    n = tf.shape(new_indices, out_type=tf.int64)[0] if rows is None else tf.constant(rows, tf.int64)
    if rows is None:
        # Room for the rows: grown (in the graph) when the ids' count is known only at run time.
        def grow():
            # The values first, the ids after them (the room is read from the ids): a step
            # that runs out of memory before its gradient leaves the ids' buffer as it was.
            grown = values.assign(tf.concat([values[:held], tf.zeros_like(new_values)[held:]], 0), read_value=False)
            with tf.control_dependencies([grown]):
                indices.assign(tf.concat([indices[:held], tf.zeros_like(new_indices)[held:]], 0), read_value=False)
        tf.cond(tf.shape(indices, out_type=tf.int64)[0] < n, grow, lambda: None)
        tf.debugging.assert_equal(
            tf.logical_or(tf.equal(held, 0), tf.equal(held, n)), True,
            message="a lookup made once per batch looked up a different number of ids "
                    "in two micro-batches of one window")
    total = tf.where(held > 0, values[:n] + new_values, new_values)
    # One after another, as `append_rows`: no count over rows a failed step did not write.
    written = _write_rows(values, tf.zeros([], tf.int64), n, total)
    with tf.control_dependencies([written]):
        written = _write_rows(indices, tf.zeros([], tf.int64), n, new_indices)
    with tf.control_dependencies([written]):
        count.assign(n, read_value=False)


def _make_room(values, indices, rows, strategy):
    """Gives row buffers room for `rows` rows, outside the graph, keeping the rows they hold.

    A buffer made while the step is traced is not initialized yet (it reads as
    an empty vector); it gets its room here and keeps it, since a variable
    assigned before the function runs is not initialized again.
    """
    with tf.init_scope():
        for buffer in [c for b in (values, indices) for c in local_components(b, strategy)]:
            rest = tuple(buffer.shape[1:])
            current = runtime_shape(buffer)
            if len(current) == 1 + len(rest) and current[0] >= rows:
                continue
            held = buffer[:rows] if len(current) == 1 + len(rest) else tf.zeros((0,) + rest, buffer.dtype)
            padding = tf.zeros((rows - int(held.shape[0]),) + rest, buffer.dtype)
            buffer.assign(tf.concat([held, padding], 0), read_value=False)


def read_rows(values, indices, count, static_count=None):
    """The window's rows: the first `count` of the buffers (all of them: no copy).

    `static_count`: the count, when the step knows it as it is traced (rows of a
    lookup made once per batch): a slice of static size, which XLA compiles.
    """
    count = backing_variable(count).read_value() if static_count is None else static_count
    return backing_variable(values)[:count], backing_variable(indices)[:count]


def read_room(values, indices, count):
    """Under XLA: the whole room, the rows past `count` read as zero rows of index 0
    (static size; a zero row changes nothing in Keras' sparse updates)."""
    values, indices = backing_variable(values), backing_variable(indices)
    held = tf.range(tf.shape(indices, out_type=tf.int64)[0]) < backing_variable(count).read_value()
    rows = tf.reshape(held, [-1] + [1] * (values.shape.rank - 1))
    return (tf.where(rows, values.read_value(), tf.zeros([], values.dtype)),
            tf.where(held, indices.read_value(), tf.zeros([], tf.int64)))


def rows_of_replicas_of_the_large_batch(slices, rows_per_lookup, replicas, row_shape):
    """A once-per-batch lookup's rows of a window, as Keras' large batch has them
    under `replicas` replicas (`tf.IndexedSlices`, gathered replica after replica).

    Each replica held its share of each micro-batch: one lookup's rows per
    micro-batch. Keras' large batch gives each replica one contiguous share of
    the batch, one lookup there, so it has `replicas` sets of rows, each summed
    over the samples of one share. Micro-batch k's share on replica r is chunk
    k * replicas + r of the batch, and lies in the large batch's share
    chunk // K (K micro-batches in the window): the chunks are summed so.
    """
    rest = list(row_shape)
    values = tf.reshape(slices.values, [replicas, -1, rows_per_lookup] + rest)
    held = tf.shape(values)[1]
    perm = [1, 0] + list(range(2, 3 + len(rest)))
    chunks = tf.reshape(tf.transpose(values, perm), [-1, rows_per_lookup] + rest)
    shares = tf.math.unsorted_segment_sum(chunks, tf.range(held * replicas) // held, replicas)
    indices = tf.tile(slices.indices[:rows_per_lookup], [replicas])
    return tf.IndexedSlices(tf.reshape(shares, [-1] + rest), indices, slices.dense_shape)


def merge_duplicate_rows(slices):
    """`slices` with the rows of each index summed: one row per index."""
    unique, positions = tf.unique(slices.indices)
    summed = tf.math.unsorted_segment_sum(slices.values, positions, tf.size(unique))
    return tf.IndexedSlices(summed, unique, slices.dense_shape)


def add_rows(dense, slices):
    """`dense + slices`, as a dense tensor."""
    return tf.tensor_scatter_nd_add(dense, slices.indices[:, None], tf.cast(slices.values, dense.dtype))
