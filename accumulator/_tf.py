"""TensorFlow mechanics of the accumulator: buffers, replica contexts, reductions.

Mechanics only: the window's flow (`AccumulationWindow._update` in
`accumulator.window`) says what happens and when; this module holds how
`tf.distribute` and TensorFlow's buffers make it happen.

Under a strategy, every micro-step stays on its replica. When a window closes,
the accumulators are reduced across replicas in one batched all-reduce, and the
inner optimizer is handed the *global* window gradient with its own all-reduce
switched off. Clipping and weight decay therefore act on the same gradient as
on one device (stock Keras clips each replica's share before reducing, so its
result depends on how the batch is split).
"""

import tensorflow as tf

from tfx_gradient_accumulator.accumulator import seam

SUM = tf.distribute.ReduceOp.SUM

# With XLA-compiled steps on GPUs, tf.distribute drops `merge_call`; Keras'
# optimizers still issue one when they count an update (an ONLY_FIRST_REPLICA
# variable), and fail there (keras-team/keras#17187). A window update, which
# must sit in a `cond`, cannot avoid it either.
NO_MERGE_CALL_MESSAGE = (
    "GradientAccumulator under a multi-replica strategy needs `jit_compile=False` "
    "(XLA-compiled steps on GPUs run without `merge_call`, which Keras' optimizers "
    "need to count updates: keras-team/keras#17187, stock Keras fails there too). "
    "Compile with jit_compile=False, or leave Keras' default jit_compile='auto', "
    "which turns XLA off under a strategy."
)


def executing_eagerly():
    return tf.executing_eagerly()


def backing_variable(variable):
    """The `tf.Variable` behind a Keras 3 variable (`.value`); a Keras 2 one is one."""
    return variable if isinstance(variable, tf.Variable) else variable.value


def add_weighted(accumulator, grad, weight):
    """`accumulator += weight * grad`, for dense and `IndexedSlices` gradients."""
    variable = backing_variable(accumulator)
    weight = tf.cast(weight, variable.dtype)
    if isinstance(grad, tf.IndexedSlices):
        # Dense buffer, sparse update: only the touched rows are written. On the
        # handle, as the dense branch: under a strategy the buffer may be a
        # SyncOnRead variable (Keras 2 makes them so), whose wrapper refuses
        # `scatter_add`, while its replica's handle takes it.
        tf.raw_ops.ResourceScatterAdd(
            resource=variable.handle,
            indices=grad.indices,
            updates=tf.cast(grad.values, variable.dtype) * weight,
        )
    else:
        # In place (acc -= (-weight) * grad): no gradient-sized temporary, so
        # accumulating costs one buffer per variable and nothing more.
        handle = variable.handle
        tf.raw_ops.ResourceApplyGradientDescent(
            var=handle, alpha=-weight, delta=tf.cast(grad, variable.dtype)
        )


def filled(shape, dtype, value=0.0):
    """A tensor of `shape` filled with `value`; a `None` dimension counts 1 (a stand-in buffer)."""
    return tf.fill([1 if d is None else d for d in shape], tf.cast(value, tf.as_dtype(dtype)))


def local_components(variable, strategy):
    """The `tf.Variable`s on this machine behind `variable` (one per local replica)."""
    return strategy.experimental_local_results(backing_variable(variable))


def runtime_shape(component):
    """The shape `component` (a `tf.Variable`) holds now: its static shape may leave a dimension open."""
    return tuple(int(d) for d in tf.shape(component))


def is_filled(variable, shape, strategy):
    """Whether the buffer `variable` has its full `shape` (asked outside the graph)."""
    with tf.init_scope():
        return all(runtime_shape(c) == tuple(shape) for c in local_components(variable, strategy))


def fill_to(variable, shape, strategy, value=0.0):
    """Gives a stand-in buffer its full `shape`, filled with `value`, outside the graph.

    Called while a step is traced (`tf.init_scope` runs it at once, eagerly), so
    the filled buffer is what the traced step reads and writes. Components that
    already have it (restored from a checkpoint) are left as they are.
    """
    with tf.init_scope():
        for component in local_components(variable, strategy):
            if runtime_shape(component) != tuple(shape):
                component.assign(filled(shape, component.dtype, value), read_value=False)


def append_rows(values, indices, count, grad, weight):
    """Appends `weight * grad`'s rows (a `tf.IndexedSlices`) to a variable's window rows.

    The rows go where the window's last ones end, written in place while the
    buffers have room; buffers too small are replaced by ones holding exactly the
    rows so far, so they grow during the first window and then stay the size of
    the largest window. Memory follows the ids looked up, not the vocabulary.
    """
    values, indices, count = backing_variable(values), backing_variable(indices), backing_variable(count)
    new_values = tf.cast(grad.values, values.dtype) * tf.cast(weight, values.dtype)
    new_indices = tf.cast(tf.reshape(grad.indices, [-1]), tf.int64)
    start = count.read_value()
    end = start + tf.shape(new_indices, out_type=tf.int64)[0]

    def grow():
        values.assign(tf.concat([values[:start], new_values], 0), read_value=False)
        indices.assign(tf.concat([indices[:start], new_indices], 0), read_value=False)

    def write():
        for buffer, new in ((values, new_values), (indices, new_indices)):
            tf.raw_ops.ResourceStridedSliceAssign(
                ref=buffer.handle, begin=tf.reshape(start, [1]), end=tf.reshape(end, [1]),
                strides=tf.ones([1], tf.int64), value=new)

    capacity = tf.shape(indices, out_type=tf.int64)[0]
    tf.cond(end > capacity, grow, write)
    count.assign(end, read_value=False)


def add_rows_in_place(values, indices, count, grad, weight, strategy):
    """Adds `weight * grad`'s rows to a variable's window rows position by position.

    For a lookup made once per batch (`accumulator.lookups`): every micro-batch
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
            for buffer, new in ((values, new_values), (indices, new_indices)):
                buffer.assign(tf.concat([buffer[:held], tf.zeros_like(new)[held:]], 0), read_value=False)
        tf.cond(tf.shape(indices, out_type=tf.int64)[0] < n, grow, lambda: None)
        tf.debugging.assert_equal(
            tf.logical_or(tf.equal(held, 0), tf.equal(held, n)), True,
            message="a lookup made once per batch looked up a different number of ids "
                    "in two micro-batches of one window")
    total = tf.where(held > 0, values[:n] + new_values, new_values)
    for buffer, new in ((values, total), (indices, new_indices)):
        tf.raw_ops.ResourceStridedSliceAssign(
            ref=buffer.handle, begin=tf.zeros([1], tf.int64), end=tf.reshape(n, [1]),
            strides=tf.ones([1], tf.int64), value=new)
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


def rows_of_every_replica(buffers, strategy):
    """Each `(values, indices, count)`'s window rows of every replica, concatenated in
    replica order, as NumPy pairs.

    Eagerly, across replicas (for saving), in one traced function. Each replica
    sends at least one row, marked valid or not, so no collective sees an empty tensor.
    """
    if strategy.num_replicas_in_sync == 1:
        return [tuple(part.numpy() for part in read_rows(*b)) for b in buffers]

    def local():
        sent = []
        for values, indices, count in buffers:
            held = backing_variable(count).read_value()
            size = tf.maximum(held, 1)
            valid = tf.cast(tf.range(size) < held, tf.int32)     # collectives take no bool
            sent.append((backing_variable(values)[:size], backing_variable(indices)[:size], valid))
        return sent

    gathered = tf.function(lambda: tf.nest.map_structure(
        lambda part: strategy.gather(part, axis=0), strategy.run(local)), autograph=False)()
    return [(values.numpy()[valid.numpy() == 1], indices.numpy()[valid.numpy() == 1])
            for values, indices, valid in gathered]


def local_replica_ids(strategy):
    """The global replica id (`replica_id_in_sync_group`) of each local replica, in order."""
    ids = tf.function(lambda: strategy.run(
        lambda: tf.convert_to_tensor(tf.distribute.get_replica_context().replica_id_in_sync_group)),
        autograph=False)()
    return [int(i) for i in strategy.experimental_local_results(ids)]


def place_rows_on_first_replica(values, indices, count, saved_values, saved_indices, strategy, replica_ids):
    """Restores saved window rows: all of them on replica 0, none on the others.

    At the window's close the replicas' rows are gathered in replica order, so
    replica 0 holding every row hands the update the same rows in the same order.
    `replica_ids` are `local_replica_ids(strategy)`.
    """
    held = len(saved_indices)
    for replica_id, v, i, c in zip(replica_ids, *(local_components(x, strategy)
                                                  for x in (values, indices, count))):
        first = replica_id == 0 and held > 0
        v.assign(saved_values[:held] if first else filled((None,) + runtime_shape(v)[1:], v.dtype),
                 read_value=False)
        i.assign(saved_indices if first else filled((None,), i.dtype), read_value=False)
        c.assign(held if first else 0, read_value=False)


def gather_over_replicas(slices):
    """Every replica's `slices` (`tf.IndexedSlices`) concatenated in replica order.

    What Keras' own all-reduce does with the large batch's sparse gradients: a
    sum of `IndexedSlices` across replicas is the concatenation of their rows.
    """
    if replicas_in_sync() == 1:
        return slices
    return tf.distribute.get_replica_context().all_reduce(SUM, slices)


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


def divide_in_place(totals, divisor):
    """The window's means: each of `totals` divided by `divisor`.

    A total held in a local buffer (a `tf.Variable`: no strategy) is divided
    where it lies, and its new value is returned: dividing into fresh tensors
    would hold a second gradient-sized copy of every variable at once, next
    to the buffers, while the inner optimizer runs. TensorFlow has no in-place
    scaling of a dense variable (`v.assign(v / d)` makes one temporary of
    `v`'s size), so the divisions run one after another: at most one such
    temporary exists at a time, the largest variable's. Totals that are
    already tensors (the all-reduced sums under a strategy) are divided as
    tensors; TensorFlow reuses a tensor's buffer for the quotient when
    nothing else holds it.
    """
    means, previous = [], []
    for total in totals:
        if isinstance(total, tf.Variable):
            with tf.control_dependencies(previous):
                op = total.assign(total / tf.cast(divisor, total.dtype), read_value=False)
            previous = [op] if op is not None else []
            # Automatic control dependencies order this read after the division.
            means.append(total.value())
        else:
            means.append(total / tf.cast(divisor, total.dtype))
    return means


def fill_one_after_another(variables, values, after=()):
    """`variable[...] = value` for each pair, one after another, after `after`.

    The new contents are made by `Empty`, which TensorFlow marks stateful so
    that Grappler never folds it: a `tf.fill` of constants is folded into a
    graph constant, and a graph constant stays allocated for as long as the
    traced function lives (measured on a 96 MB model: up to 144 MB held
    between steps, which `Empty` brings to 0). Each refill allocates the new
    buffer before the old one is released; chained, at most one variable's
    worth of overlap exists at a time. `after` (reads of the variables the
    update wrote) holds the refills until the inner optimizer has used the
    window's means, whose buffers they replace.
    """
    previous = [a for a in after if a is not None]
    for variable, value in zip(variables, values):
        variable = backing_variable(variable)
        with tf.control_dependencies(previous):
            shape = tuple(variable.shape) if variable.shape.is_fully_defined() else tf.shape(variable)
            contents = tf.raw_ops.Empty(shape=shape, dtype=variable.dtype, init=True)
            if value != 0:
                contents = contents + tf.constant(value, variable.dtype)
            op = variable.assign(contents, read_value=False)
        previous = [op] if op is not None else []


def keep_maximum(accumulator, grad):
    """`accumulator = max(accumulator, grad)` (for `overwrite_with_gradient` variables)."""
    variable = backing_variable(accumulator)
    variable.assign(tf.maximum(variable, tf.cast(tf.convert_to_tensor(grad), variable.dtype)))


def maximum_over_replicas(value):
    """The element-wise maximum of `value` over the replicas (itself on one replica)."""
    rows = stack_over_replicas(tf.reshape(value, [-1]))
    if rows is None:
        return value
    return tf.reshape(tf.reduce_max(rows, axis=0), tf.shape(value))


def replicas_in_sync():
    """The replicas whose gradients one all-reduce sums (1 without a strategy)."""
    if not tf.distribute.has_strategy():
        return 1
    context = tf.distribute.get_replica_context()
    return 1 if context is None else context.num_replicas_in_sync


def stack_over_replicas(vector):
    """`[replicas, n]`: every replica's 1-D `vector`, or None without several replicas.

    One all-reduce of one-hot rows, so it works wherever a replica context
    does (MirroredStrategy, multi-worker, with or without merge_call).
    """
    if not tf.distribute.has_strategy():
        return None
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    rows = tf.one_hot(context.replica_id_in_sync_group, context.num_replicas_in_sync, dtype=vector.dtype)
    return context.all_reduce(SUM, rows[:, None] * vector[None, :])


# ------------------------------------------------- where the window's steps run
def refuse_cross_replica_context():
    """Raises unless called in a replica context (or without a strategy)."""
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
        raise ValueError(
            "GradientAccumulator.apply() must be called in a replica context: "
            "inside `strategy.run(...)` or `model.fit`, not directly under "
            "`strategy.scope()`."
        )


def assign_add_after(variable, delta, after):
    """`variable += delta`, once the tensors `after` exist."""
    values = [a.values if isinstance(a, tf.IndexedSlices) else a for a in after]
    with tf.control_dependencies([tf.convert_to_tensor(v) for v in values]):
        variable.assign_add(delta)


def in_cross_replica_context(fn):
    """`fn(distribution)`: in cross-replica context, through `merge_call`, under a
    strategy that has it (MirroredStrategy, multi-worker); `fn(None)` in place
    without a strategy. Refuses replica contexts without `merge_call` (XLA)."""
    if not tf.distribute.has_strategy():
        return fn(None)
    if seam.replica_context_lacks_merge_call() or seam.in_xla_context():
        raise NotImplementedError(NO_MERGE_CALL_MESSAGE)
    return tf.distribute.get_replica_context().merge_call(fn)


def sum_over_replicas(distribution, values_and_destinations):
    """Each value summed over the replicas, in one batched all-reduce (cross-replica
    context); each result is placed like its destination variable."""
    return distribution.extended.batch_reduce_to(
        SUM, [(backing_variable(v), backing_variable(d)) for v, d in values_and_destinations])


def in_each_replica(distribution, without_reduction, fn, *args):
    """`fn(*args)` in each replica (from cross-replica context), inside the
    context `without_reduction()`; in place without a strategy."""
    if distribution is None:
        return fn(*args)
    with without_reduction():
        return distribution.extended.call_for_each_replica(fn, args=args)
