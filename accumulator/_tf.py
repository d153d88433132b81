"""TensorFlow-specific mechanics of the accumulator: buffers and replica contexts.

Kept apart from the update rule in `optimizer.py` so that the rule reads as
maths and this module holds what `tf.distribute` demands of it.
"""

import tensorflow as tf
from keras import ops


def executing_eagerly():
    return tf.executing_eagerly()


def add_weighted(accumulator, grad, weight):
    """`accumulator += weight * grad`, for dense and `IndexedSlices` gradients."""
    variable = accumulator.value
    weight = tf.cast(weight, variable.dtype)
    if isinstance(grad, tf.IndexedSlices):
        # Dense buffer, sparse update: only the touched rows are written.
        variable.scatter_add(
            tf.IndexedSlices(
                tf.cast(grad.values, variable.dtype) * weight,
                grad.indices,
                grad.dense_shape,
            )
        )
    else:
        variable.assign_add(tf.cast(grad, variable.dtype) * weight)


def apply_in_context(optimizer, grads, indices, weight=1.0):
    """One micro-step: accumulate locally, and close the window when it is full.

    With a strategy that needs `merge_call` (MirroredStrategy, multi-worker),
    the window test runs in cross-replica context and the window is applied in
    each replica through `call_for_each_replica`, so the inner optimizer's own
    `merge_call` and all-reduce run outside any replica-context `cond`.
    """
    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context():
        raise ValueError(
            "GradientAccumulator.apply() must be called in a replica context: "
            "inside `strategy.run(...)` or `model.fit`, not directly under "
            "`strategy.scope()`."
        )
    with_grads = {i for g, i in zip(grads, indices) if g is not None}
    optimizer._accumulate(grads, indices, weight)

    def step(apply_window):
        optimizer._micro_step.assign_add(1)

        def close():
            apply_window(with_grads | optimizer._seen_in_window)
            optimizer._micro_step.assign(0)
            optimizer._seen_in_window = set()

        ops.cond(optimizer._window_is_full(), close, lambda: None)

    if tf.__internal__.distribute.strategy_supports_no_merge_call():
        step(optimizer._apply_window)
    else:
        tf.distribute.get_replica_context().merge_call(
            lambda distribution: step(
                lambda used: distribution.extended.call_for_each_replica(
                    optimizer._apply_window, args=(used,)
                )
            )
        )
