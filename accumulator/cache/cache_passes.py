"""Gradient caching's three passes, for both Keras: what `GradientCache` does in a step.

TensorFlow only, shared by the Keras 3 class (`gradient_cache`) and the Keras 2
one (`keras2.gradient_cache`), so the two cannot drift apart: 1. represent
every micro-batch without a tape; 2. score the whole batch's loss on the
outputs under a tape; 3. send each micro-batch's slice of that gradient back
through the model, one micro-batch's activations at a time.
"""

from __future__ import annotations

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.rows import lookups
from tfx_gradient_accumulator.accumulator.core import _tf, seam


def cached_gradients(forward, x, accum_steps: int, score, variables: list, after_pass_1=None,
                     before_pass_3=None, gather=None) -> tuple:
    """The large batch's gradient of `score` by `variables`, in three passes.

    Args:
        forward: `forward(part)`, the model's training forward on a micro-batch.
        x: the batch's inputs (any structure whose first axis is the samples).
        accum_steps: micro-batches to cut `x` into.
        score: `score(whole) -> (loss, scaled_loss)` on the whole batch's outputs;
            the gradients are those of `scaled_loss` (loss scaling), as given.
        variables: the trainable variables to differentiate.
        after_pass_1: called (no arguments) after pass 1: refusals that need a
            forward traced, variables built by it.
        before_pass_3: called (no arguments) before pass 3: state that pass 3
            must replay.
        gather: `gather(whole) -> across_replicas.GlobalBatch` whose `whole` the loss
            scores instead of this replica's outputs (negatives across replicas):
            the gradient of this replica's rows goes back through its micro-batches,
            and the loss's own variables' gradients, which every replica computes
            whole, count 1/R each, so that the strategy's sum counts them once.

    Returns:
        `(loss, whole, grads)`: the loss, the whole batch's outputs, and one
        gradient per variable (None where it has none; sparse rows as the large
        batch has them).
    """
    micro_batches = [micro_batch(x, k, accum_steps) for k in range(accum_steps)]
    representations = []
    for part in micro_batches:
        part = after(representations[-1:], part)
        representations.append(forward(part))
    if after_pass_1 is not None:
        after_pass_1()
    whole = tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *representations)
    shares = gather(whole) if gather is not None else None
    scored = shares.whole if shares is not None else whole
    with tf.GradientTape(persistent=True) as tape:
        tape.watch(scored)
        loss, scaled = score(scored)
    by_representation = tape.gradient(scaled, scored, unconnected_gradients=tf.UnconnectedGradients.ZERO)
    grads = tape.gradient(scaled, variables)
    del tape
    if shares is not None and shares.replicas > 1:
        by_representation = shares.own(by_representation)
        grads = [_tf.scaled_by(g, 1.0 / shares.replicas) for g in grads]
    if before_pass_3 is not None:
        before_pass_3()
    lookups.note_batch_size(tf.TensorShape(tf.nest.flatten(micro_batches[0])[0].shape)[0],
                            tf.compat.v1.get_default_graph())

    def backpropagate(k):
        # Its forward could run any time; not before the scores, or its activations
        # would wait for them beside pass 1's.
        upstream = micro_batch(by_representation, k, accum_steps)
        part = after([upstream], micro_batch(x, k, accum_steps))
        with tf.GradientTape() as micro_tape:
            outputs = forward(part)
            surrogate = tf.add_n([tf.reduce_sum(o * tf.cast(u, o.dtype)) for o, u in
                                  zip(tf.nest.flatten(outputs), tf.nest.flatten(upstream))])
        return micro_tape.gradient(surrogate, variables)

    grads = [add(from_loss, from_model) for from_loss, from_model in
             zip(grads, summed_over(backpropagate, accum_steps))]
    return loss, whole, grads


def micro_batch(x, k, accum_steps: int):
    """Micro-batch `k` of `x`: micro-batches of ceil(B / accum_steps), in order, the last possibly shorter.

    Args:
        x: a structure whose tensors' first axis follows the samples (the
            inputs, or the representations' gradient).
        k: which micro-batch, an int or a scalar tensor.
        accum_steps: micro-batches in the batch.

    Returns:
        The same structure, each tensor cut to micro-batch `k`'s samples.
    """
    if seam.in_xla_context():
        # XLA compiles slices of a size it knows: the batch as `accum_steps` rows of
        # micro-batches, row k (a batch that `accum_steps` does not divide fails there).
        return tf.nest.map_structure(
            lambda t: tf.gather(tf.reshape(t, tf.concat([[accum_steps, -1], tf.shape(t)[1:]], 0)), k), x)
    size = tf.shape(tf.nest.flatten(x)[0])[0]
    step = (size + accum_steps - 1) // accum_steps
    return tf.nest.map_structure(lambda t: t[k * step:(k + 1) * step], x)


def summed_over(gradients_of, count: int) -> list:
    """`gradients_of(k)` for k < `count`, added up as the large batch's gradient has them.

    Dense gradients are summed, sparse rows (`tf.IndexedSlices`) concatenated in
    order, except the rows of a lookup made once per batch (`accumulator.rows.lookups`:
    ids that do not depend on the sample), which the large batch has once per id
    position with every sample summed into it: those are summed position by position.
    Micro-batch 0 runs first, alone, to tell which variables get which kind; the
    others run in a `tf.while_loop(parallel_iterations=1)`, which frees each
    iteration's activations before the next.

    Args:
        gradients_of: `gradients_of(k) -> list` of one gradient per variable
            (None where it has none) for micro-batch `k` (an int, then a tensor).
        count: how many micro-batches.

    Returns:
        One summed gradient per variable, None where micro-batch 0 had none.
    """
    first = gradients_of(0)
    shared = {i for i, g in enumerate(first) if isinstance(g, tf.IndexedSlices)
              and lookups.kind_of_rows(g.indices) == lookups.ONCE_PER_BATCH}
    dense = [i for i, g in enumerate(first) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [i for i, g in enumerate(first) if isinstance(g, tf.IndexedSlices) and i not in shared]
    shared = sorted(shared)

    def rows_of(g):
        arrays = [tf.TensorArray(part.dtype, size=count, infer_shape=False,
                                 element_shape=tf.TensorShape([None]).concatenate(part.shape[1:]))
                  for part in (g.values, g.indices)]
        return [arrays[0].write(0, g.values), arrays[1].write(0, g.indices)]

    def add_one(k, totals, rows):
        grads = gradients_of(k)
        return (k + 1, [total + (grads[i] if i in dense else grads[i].values)
                        for total, i in zip(totals, dense + shared)],
                [[values.write(k, grads[i].values), indices.write(k, grads[i].indices)]
                 for (values, indices), i in zip(rows, sparse)])

    _, totals, rows = tf.while_loop(
        lambda k, totals, rows: k < count, add_one,
        (tf.constant(1), [first[i] for i in dense] + [first[i].values for i in shared],
         [rows_of(first[i]) for i in sparse]),
        parallel_iterations=1)
    summed = [None] * len(first)
    for i, total in zip(dense + shared, totals):
        summed[i] = total if i in dense else tf.IndexedSlices(total, first[i].indices, first[i].dense_shape)
    for i, (values, indices) in zip(sparse, rows):
        summed[i] = tf.IndexedSlices(values.concat(), indices.concat(), first[i].dense_shape)
    return summed


def after(dependencies, part):
    """`part`, read only once every tensor in `dependencies` exists.

    Args:
        dependencies: a structure of tensors (or `tf.IndexedSlices`) to wait for.
        part: a structure of tensors.

    Returns:
        `part` through `tf.identity` under control dependencies on them (`part`
        itself when there are none).
    """
    tensors = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tf.nest.flatten(dependencies)]
    if not tensors:
        return part
    with tf.control_dependencies(tensors):
        return tf.nest.map_structure(tf.identity, part)


def add(total, grad):
    """Two gradients of one variable as one.

    Args:
        total: a gradient (a tensor, `tf.IndexedSlices`, or None).
        grad: another gradient of the same variable (likewise).

    Returns:
        Sparse rows concatenated in sample order (the large batch's
        `IndexedSlices`) when both are rows, else their dense sum; the other
        one when one is None.
    """
    if total is None or grad is None:
        return grad if total is None else total
    if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                                tf.concat([total.indices, grad.indices], 0), total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)


def ready_for_update(grads):
    """Control inputs that make an update wait for every gradient.

    The step Keras runs on a dataset of unknown size that has run out then
    makes no update and counts none.

    Args:
        grads: the gradients (tensors, `tf.IndexedSlices` or None).

    Returns:
        A `tf.control_dependencies` context manager.
    """
    return tf.control_dependencies([g.values if isinstance(g, tf.IndexedSlices) else g
                                    for g in grads if g is not None])
