"""Negatives across replicas: every replica scores the whole global batch.

Under a `tf.distribute` strategy each replica holds its share of the batch. Keras'
own large batch scores each share alone, and so does `GradientCache` by default:
with R replicas, each sample meets the negatives of its share, 1/R of the global
batch's. `GradientCache(..., gather_across_replicas=True)` gathers the shares'
representations (and the inputs, targets and sample weights the loss reads) into
the global batch, in replica order, on every replica; every replica computes the
same global loss, and keeps the gradient of its own rows only, which it sends back
through its own micro-batches. The strategy's sum of the replicas' parameter
gradients is then the global batch's gradient on one device.

How: one all-reduce of the share sizes, then an all-reduce (sum) of blocks, each
replica's share zero-padded to the longest and placed at its replica's index:
shares may differ in size, even be empty (a last batch smaller than the replicas).
An all-gather would do the same with less traffic, but it does not run inside
Keras' train step under `MultiWorkerMirroredStrategy` here.
"""

import tensorflow as tf

SUM = tf.distribute.ReduceOp.SUM


class GlobalBatch:
    """The global batch, gathered from every replica's share, and the way back.

    `whole` is the gathered structure (same structure as given, every tensor's
    first axis now the global batch's samples, replica 0's first); `own(grads)`
    takes this replica's rows out of a gradient by `whole`; `replicas` is R.
    Without a strategy (one replica) nothing is gathered.
    """

    def __init__(self, shares):
        context = tf.distribute.get_replica_context()
        self.replicas = context.num_replicas_in_sync if context is not None else 1
        if self.replicas == 1:
            self.whole, self._offset, self._count = shares, 0, None
            return
        flat = tf.nest.flatten(shares)
        for tensor in flat:
            _refuse_what_cannot_be_summed(tensor)
        self._count = tf.shape(flat[0])[0]
        here = tf.one_hot(context.replica_id_in_sync_group, self.replicas, dtype=tf.int32)
        counts = context.all_reduce(SUM, here * self._count)
        longest = tf.reduce_max(counts)
        self._offset = tf.reduce_sum(counts * tf.cast(tf.range(self.replicas) < context.replica_id_in_sync_group,
                                                      tf.int32))
        # One all-reduce per tensor: a batched one refuses tensors some of which sit
        # on the host (integer ids) and some on the replica's device.
        blocks = [context.all_reduce(SUM, _block(t, here, longest, self.replicas)) for t in flat]
        filled = tf.sequence_mask(counts, longest)
        whole = [tf.cast(tf.boolean_mask(b, filled), t.dtype) for b, t in zip(blocks, flat)]
        self.whole = tf.nest.pack_sequence_as(shares, whole)

    def own(self, grads):
        """This replica's rows of `grads` (a structure like `whole`)."""
        if self._count is None:
            return grads
        return tf.nest.map_structure(lambda g: g[self._offset:self._offset + self._count], grads)


def _block(tensor, here, longest, replicas):
    """`tensor` padded to `longest` samples, at index `here` of R such blocks (zeros elsewhere)."""
    summable = tf.cast(tensor, tf.int32) if tensor.dtype == tf.bool else tensor
    padded = tf.pad(summable, [[0, longest - tf.shape(summable)[0]]] + [[0, 0]] * (summable.shape.rank - 1))
    placed = tf.reshape(tf.cast(here, summable.dtype), [replicas] + [1] * summable.shape.rank)
    return placed * padded[tf.newaxis]


def _refuse_what_cannot_be_summed(tensor):
    if isinstance(tensor, (tf.SparseTensor, tf.RaggedTensor)):
        raise ValueError(
            "GradientCache(gather_across_replicas=True): the batch holds a "
            f"{type(tensor).__name__}; gathering the global batch needs dense tensors. "
            "Densify it in the input pipeline (or in the model, after its first layer), "
            "or use gather_across_replicas=False.")
    if tensor.dtype == tf.string or tensor.shape.rank is None:
        raise ValueError(
            "GradientCache(gather_across_replicas=True): the batch holds a "
            f"{'string' if tensor.dtype == tf.string else 'rank-unknown'} tensor, which cannot be "
            "gathered across replicas. Map strings to ids in the input pipeline (e.g. "
            "StringLookup in a tf.data map), or use gather_across_replicas=False.")
