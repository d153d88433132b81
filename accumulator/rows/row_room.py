"""Room for sparse gradients' rows under XLA, read from `fit`'s first batch before its step compiles.

Under XLA (`jit_compile=True`, Keras' "auto" on one GPU) the window keeps a sparse
gradient's rows in a buffer whose size is fixed outside the compiled step
(`window_rows.has_room`): the rows of one micro-batch times the window's length. A
custom loop traced with inputs of static shape gives that count as it is traced;
`fit` feeds its step from a dataset whose batch axis is unknown (the last batch may
be smaller), so the count is not known there. `make_room_before_fit` reads it the
way Keras itself reads the first batch to build a model (`_symbolic_build`): it
takes the first batch of the arrays or the `tf.data.Dataset` given to `fit`, traces
(does not run) the model's gradients for a batch of that shape, and makes the room
for each variable whose gradient is a per-sample sparse gradient. Nothing runs: the
weights, the optimizer's state, the random state and the data stay as they were.
A later micro-batch with more rows (longer sequences) is reported on the host
(`window_rows.refuse_overflowed_room`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.rows import lookups

# `fit`'s default batch size, when the arrays are batched by `fit` and none is given.
FIT_DEFAULT_BATCH_SIZE = 32


def make_room_before_fit(model, optimizer, fit_arguments) -> dict:
    """Makes room under XLA for the rows of `model`'s per-sample sparse gradients.

    Args:
        model: a built Keras 3 model compiled with `jit_compile=True`.
        optimizer: its `GradientAccumulator` (built here if it is not yet).
        fit_arguments: {name: value} of the `fit` call (`x`, `y`, `batch_size`, ...).

    Returns:
        {variable path: rows of one micro-batch} for the variables given a room; empty
        where the first batch cannot be read without consuming it (a generator, a
        `PyDataset`) or the model is not built: the step's own trace then decides.
    """
    batch = _first_batch(fit_arguments)
    if batch is None or not model.built:
        return {}
    specs = tf.nest.map_structure(lambda t: tf.TensorSpec(t.shape, t.dtype), batch)
    rows = _per_sample_rows(model, specs)
    if not rows:
        return {}
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    return optimizer.make_row_room(rows)


def _first_batch(fit_arguments):
    """The first batch `fit` will see, as tensors of their static shapes, or None."""
    x = fit_arguments.get("x")
    if isinstance(x, tf.data.Dataset):
        for element in x.take(1):
            return element if isinstance(element, tuple) else (element,)
        return None
    arrays = (x, fit_arguments.get("y"), fit_arguments.get("sample_weight"))
    leaves = [leaf for leaf in tf.nest.flatten(arrays) if leaf is not None]
    if not leaves or not all(isinstance(leaf, (np.ndarray, tf.Tensor)) for leaf in leaves):
        return None
    size = fit_arguments.get("batch_size") or FIT_DEFAULT_BATCH_SIZE
    first = tf.nest.map_structure(lambda a: None if a is None else tf.convert_to_tensor(a[:size]), arrays)
    return tuple(part for part in first if part is not None) if first[2] is None else first


def _per_sample_rows(model, specs):
    """(variable, rows) of the per-sample sparse gradients of one step on a batch of `specs`, read from a trace of the step's
    gradients (never run)."""
    found = []

    def gradients(*batch):
        x, y, sample_weight = (tuple(batch) + (None, None))[:3]
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        variables = model.trainable_variables
        for variable, grad in zip(variables, tape.gradient(loss, variables)):
            if isinstance(grad, tf.IndexedSlices) and lookups.kind_of_rows(grad.indices) == lookups.PER_SAMPLE:
                rows = grad.indices.shape.num_elements()
                if rows is not None:
                    found.append((variable, rows))
        return loss

    tf.function(gradients, autograph=False).get_concrete_function(*specs)
    return found

