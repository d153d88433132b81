"""TensorFlow mechanics of the window's dense buffers: fill, add, divide, refill.

Mechanics only: the window's flow (`AccumulationWindow._update` in
`accumulator.window`) says what happens and when; this module holds how
TensorFlow's buffers make it happen, in place and without temporaries. Rows of
sparse gradients are `accumulator.window_rows`, replicas `accumulator.replicas`.
"""

import tensorflow as tf


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

    The new contents are made by `Empty`, which TensorFlow marks stateful so
    that Grappler never folds it: a `tf.fill` of constants is folded into a
    graph constant, and a graph constant stays allocated for as long as the
    traced function lives (DEVELOPERS.md, "Grappler folds a tf.fill"). Each
    refill allocates the new buffer before the old one is released; chained,
    at most one variable's worth of overlap exists at a time. `after` (reads
    of the variables the update wrote) holds the refills until the inner
    optimizer has used the window's means, whose buffers they replace.
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


def assign_add_after(variable, delta, after):
    """`variable += delta`, once the tensors `after` exist."""
    values = [a.values if isinstance(a, tf.IndexedSlices) else a for a in after]
    with tf.control_dependencies([tf.convert_to_tensor(v) for v in values]):
        variable.assign_add(delta)


