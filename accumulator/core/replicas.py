"""Replica plumbing: where the window's steps run under `tf.distribute`, and its reductions.

Under a strategy, every micro-step stays on its replica. When a window closes,
the accumulators are reduced across replicas in one batched all-reduce, and the
inner optimizer is handed the *global* window gradient with its own all-reduce
switched off. Clipping and weight decay therefore act on the same gradient as
on one device (stock Keras clips each replica's share before reducing, so its
result depends on how the batch is split). Without a strategy nothing here runs.
"""

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import seam
from tfx_gradient_accumulator.accumulator.core._tf import backing_variable

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


def maximum_over_replicas(value):
    """The element-wise maximum of `value` over the replicas (itself on one replica)."""
    rows = stack_over_replicas(tf.reshape(value, [-1]))
    if rows is None:
        return value
    return tf.reshape(tf.reduce_max(rows, axis=0), tf.shape(value))


def gather_over_replicas(slices):
    """Every replica's `slices` (`tf.IndexedSlices`) concatenated in replica order.

    What Keras' own all-reduce does with the large batch's sparse gradients: a
    sum of `IndexedSlices` across replicas is the concatenation of their rows.
    """
    if replicas_in_sync() == 1:
        return slices
    return tf.distribute.get_replica_context().all_reduce(SUM, slices)


def local_replica_ids(strategy):
    """The global replica id (`replica_id_in_sync_group`) of each local replica, in order."""
    ids = tf.function(lambda: strategy.run(
        lambda: tf.convert_to_tensor(tf.distribute.get_replica_context().replica_id_in_sync_group)),
        autograph=False)()
    return [int(i) for i in strategy.experimental_local_results(ids)]


def refuse_cross_replica_context():
    """Raises unless called in a replica context (or without a strategy)."""
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
        raise ValueError(
            "GradientAccumulator.apply() must be called in a replica context: "
            "inside `strategy.run(...)` or `model.fit`, not directly under "
            "`strategy.scope()`."
        )


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
    context); each result is placed like its destination variable. A value is a variable,
    or what `call_for_each_replica` returns: per-replica values, or with one local replica
    (a worker of `MultiWorkerMirroredStrategy`) a tensor."""
    return distribution.extended.batch_reduce_to(
        SUM, [(v if isinstance(v, (tf.Tensor, tf.distribute.DistributedValues)) else backing_variable(v),
               backing_variable(d)) for v, d in values_and_destinations])


def in_each_replica(distribution, without_reduction, fn, *args):
    """`fn(*args)` in each replica (from cross-replica context), inside the
    context `without_reduction()`; in place without a strategy."""
    if distribution is None:
        return fn(*args)
    with without_reduction():
        return distribution.extended.call_for_each_replica(fn, args=args)
