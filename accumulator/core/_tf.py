"""TensorFlow mechanics of the window's dense buffers: fill, add, divide, refill.

Mechanics only: the window's flow (`AccumulationWindow._update` in
`accumulator.window.window`) says what happens and when; this module holds how
TensorFlow's buffers make it happen, in place and without temporaries. Rows of
sparse gradients are `accumulator.rows.window_rows`, replicas `accumulator.core.replicas`.
"""

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import seam


def current_graph():
    """The graph being traced, or None eagerly: what a weight handed to the window is noted with."""
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


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

    The quotient handed back is the tensor assigned, not a second read of the
    variable: a resource variable's assignment adopts the tensor's buffer
    (copy-on-write: whoever writes to the variable next copies it first), so
    the buffer and the mean are one allocation, and the close runs one kernel a
    variable fewer.
    """
    means, previous = [], []
    for total in totals:
        if isinstance(total, tf.Variable):
            with tf.control_dependencies(previous):
                quotient = total / tf.cast(divisor, total.dtype)
                op = total.assign(quotient, read_value=False)
            previous = [op] if op is not None else []
            means.append(quotient)
        else:
            means.append(total / tf.cast(divisor, total.dtype))
    return means


def fill_one_after_another(variables, values, after=()):
    """`variable[...] = value` for each pair, one after another, after `after`.

    Where a traced step runs its kernels one by one (no XLA), each buffer is
    overwritten where it lies, one kernel a variable (`ResourceStridedSliceAssign`
    of the value over the whole buffer): no new buffer is allocated, and a
    non-finite sum is overwritten like any other. Elsewhere (eagerly, under XLA,
    whose slice assignment does not broadcast, and in cross-replica context,
    where a replica-local buffer has no one handle) the new contents are made
    by `Empty` and assigned: `Empty` is marked stateful so that Grappler never
    folds it, while a `tf.fill` of constants is folded into a graph constant,
    allocated for as long as the traced function lives (DEVELOPERS.md,
    "Grappler folds a tf.fill"); each refill allocates the new buffer before the
    old one is released, so chained, at most one variable's worth of overlap
    exists at a time. `after` (reads of the variables the update wrote) holds
    the refills until the inner optimizer has used the window's means, whose
    buffers they replace (or, in place, overwrite: a buffer whose mean is still
    held would be copied first).
    """
    previous = [a for a in after if a is not None]
    in_place = not tf.executing_eagerly() and not seam.in_xla_context() and not (
        tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context())
    for variable, value in zip(variables, values):
        variable = backing_variable(variable)
        with tf.control_dependencies(previous):
            if in_place and variable.shape.rank:
                op = overwrite_in_place(variable, value)
            else:
                shape = tuple(variable.shape) if variable.shape.is_fully_defined() else tf.shape(variable)
                contents = tf.raw_ops.Empty(shape=shape, dtype=variable.dtype, init=True)
                if value != 0:
                    contents = contents + tf.constant(value, variable.dtype)
                op = variable.assign(contents, read_value=False)
        previous = [op] if op is not None else []


def overwrite_in_place(variable, value):
    """Every element of `variable` (a `tf.Variable` of rank >= 1) set to `value`, in its own
    buffer: one kernel, no allocation (the value broadcast over a slice of the whole
    buffer). Not under XLA, whose slice assignment does not broadcast."""
    return tf.raw_ops.ResourceStridedSliceAssign(
        ref=variable.handle, begin=[0], end=[0], strides=[1], value=tf.constant(value, variable.dtype),
        begin_mask=1, end_mask=1)


def keep_maximum(accumulator, grad):
    """`accumulator = max(accumulator, grad)` (for `overwrite_with_gradient` variables)."""
    variable = backing_variable(accumulator)
    variable.assign(tf.maximum(variable, tf.cast(tf.convert_to_tensor(grad), variable.dtype)))


def assign_add_after(variable, delta, after):
    """`variable += delta`, once the tensors `after` exist: on the `tf.Variable` itself, one
    kernel (a Keras 3 variable's own `assign_add` reads, adds and assigns: three)."""
    values = [a.values if isinstance(a, tf.IndexedSlices) else a for a in after]
    with tf.control_dependencies([tf.convert_to_tensor(v) for v in values]):
        backing_variable(variable).assign_add(delta, read_value=False)


def scaled_by(grad, factor):
    """`grad` times `factor`.

    Args:
        grad: a gradient: a tensor, `tf.IndexedSlices` (its values are scaled) or None.
        factor: a Python number or a scalar tensor, cast to the gradient's dtype.

    Returns:
        The scaled gradient, of `grad`'s kind (None stays None).
    """
    if grad is None:
        return None
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values * tf.cast(factor, grad.values.dtype), grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)
