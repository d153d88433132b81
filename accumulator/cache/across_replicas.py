"""Negatives across replicas: every replica scores the whole global batch.

`GlobalBatch` gathers the replicas' shares for `GradientCache(...,
gather_across_replicas=True)` and takes each replica's rows back out of the
global loss's gradient (DEVELOPERS.md, "Design notes by module", says how).
"""

from __future__ import annotations

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core.options import CacheOptions

SUM = tf.distribute.ReduceOp.SUM


class GlobalBatch:
    """The global batch, gathered from every replica's share, and the way back.

    Made in a replica context. Shares may differ in size, even be empty (a last
    batch smaller than the replicas): they are summed as zero-padded blocks.

    Attributes:
        whole: the gathered structure (same structure as given, every tensor's
            first axis now the global batch's samples, replica 0's first).
        replicas: R, the replicas in sync (1: nothing is gathered).

    Args:
        shares: this replica's batch: a structure of dense tensors whose first
            axis is the samples.

    Raises:
        ValueError: a share holds a `tf.SparseTensor`, a `tf.RaggedTensor`, a
            string tensor or a tensor of unknown rank, which cannot be summed.
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
        """This replica's rows of a gradient by `whole`.

        Args:
            grads: a structure like `whole` (the global loss's gradient by it).

        Returns:
            The same structure holding only this replica's rows (`grads` itself
            on one replica).
        """
        if self._count is None:
            return grads
        return tf.nest.map_structure(lambda g: g[self._offset:self._offset + self._count], grads)


def global_batch(representations, scored: dict):
    """The global batch of this replica's representations and of what the loss reads beside them.

    Args:
        representations: this replica's outputs (any structure of dense tensors).
        scored: what the loss reads beside them, by name ({"x", "y",
            "sample_weight"} for a Keras model; the task's other arguments for a
            TensorFlow Recommenders one), None where not given.

    Returns:
        `(shares, scored)`: the `GlobalBatch` (`shares.whole["whole"]`: the
        representations), and `scored` with the given ones replaced by the global
        batch's.
    """
    given = {name: value for name, value in scored.items() if value is not None}
    shares = GlobalBatch({"whole": representations, **given})
    return shares, {**scored, **{name: shares.whole[name] for name in given}}


def gathering(scored: dict):
    """The `gather` of `cache_passes.cached_gradients` for a `GradientCache` (both Keras): it
    gathers the representations and what the loss reads beside them (`scored`, replaced
    there by the global batch's) and returns them as `Scored`."""
    def gather(whole):
        shares, gathered = global_batch(whole, scored)
        scored.update(gathered)
        return Scored(shares.whole["whole"], shares)
    return gather


class Scored:
    """What `cache_passes.cached_gradients`' `gather` returns: the gathered
    representations (`whole`), with the way back to this replica's rows (`own`)
    and the replica count (`replicas`)."""

    def __init__(self, whole, shares: GlobalBatch):
        self.whole, self.own, self.replicas = whole, shares.own, shares.replicas


def _block(tensor, here, longest, replicas):
    """`tensor` padded to `longest` samples, at index `here` of R such blocks (zeros elsewhere)."""
    summable = tf.cast(tensor, tf.int32) if tensor.dtype == tf.bool else tensor
    padded = tf.pad(summable, [[0, longest - tf.shape(summable)[0]]] + [[0, 0]] * (summable.shape.rank - 1))
    placed = tf.reshape(tf.cast(here, summable.dtype), [replicas] + [1] * summable.shape.rank)
    return placed * padded[tf.newaxis]


def _refuse_what_cannot_be_summed(tensor):
    """Raises for a tensor that an all-reduce of blocks cannot carry."""
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


def refuse_gathering_with_a_compiled_loss(model, gather_across_replicas: bool, base_model: type, keras_name: str,
                                          scores_the_batch_itself: bool = False) -> bool:
    """`gather_across_replicas`, checked for either Keras' `GradientCache`: True needs a loss
    that scores the batch it is given (the model's own `compute_loss`, not `base_model`'s,
    or `scores_the_batch_itself`), since Keras scales a compiled loss per replica."""
    CacheOptions(gather_across_replicas=gather_across_replicas)      # a bool
    if (gather_across_replicas and not scores_the_batch_itself
            and type(model).compute_loss is base_model.compute_loss):
        raise ValueError(
            "GradientCache(gather_across_replicas=True) needs the model's own `compute_loss` "
            f"(`{type(model).__name__}` has none): {keras_name} scales a compiled loss per replica, "
            "for the replica's share. Override compute_loss(x, y, y_pred, sample_weight) to "
            "return the loss of the batch it is given, as on one device, or use "
            "gather_across_replicas=False.")
    return gather_across_replicas
