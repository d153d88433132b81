"""Which sparse gradients come from a lookup made once per batch, read from the program.

An embedding looked up with ids that do not depend on the sample (position tables) is
looked up once per batch; a window must sum such rows, not keep them apart. Decided per
gradient from the traced program, never from the ids' values; eagerly, unknown (None).
"""

import logging
import threading

import tensorflow as tf

logger = logging.getLogger(__name__)

ONCE_PER_BATCH = "once-per-batch rows"
PER_SAMPLE = "rows"

# Ops whose output depends on their input's shape only, never on its values.
_SHAPE_ONLY = frozenset({"Shape", "ShapeN", "Size", "Rank", "VariableShape", "TensorListLength"})
# A walk that long is not a lookup's ids: decide "per sample" (the safe answer).
_MAX_OPS = 5000
# Ops that only read a variable: an integer variable nothing else touches in the step
# (a layer's stored `position_ids`) is a constant of the step.
_READS = frozenset({"ReadVariableOp", "VariableShape"})


class _Noted(threading.local):
    # Per thread: MirroredStrategy traces each replica's step in its own thread.
    def __init__(self):
        self.batch_size = None
        self.graph = None


_noted = _Noted()


def note_batch_size(size, graph):
    """The static size of the micro-batch whose step `graph` traces (None: unknown).

    Noted where the batch is seen (`accumulator.window.weighting`, `GradientCache`): ids
    with a leading axis of that size are one lookup per sample.
    """
    _noted.batch_size, _noted.graph = size, graph


def kind_of_rows(indices):
    """`ONCE_PER_BATCH`, `PER_SAMPLE`, or None when `indices` are not symbolic (eager).

    `indices` is a sparse gradient's `IndexedSlices.indices` inside a traced
    function; the walk follows the backward pass's reshapes to the forward
    lookups' ids, and from there to what they are computed from. A table looked
    up more than once in the step (an encoder called on anchors, then on
    positives) gets one gradient whose indices concatenate every lookup's: each
    lookup is judged on its own, and the rows are once per batch only when every
    lookup is. BERT's token-type ids (zeros shaped like the batch) stay per
    sample however often the encoder runs; a position table looked up by both
    calls stays once per batch.
    """
    if not _is_symbolic(indices):
        return None
    batch_size = _noted.batch_size if _noted.graph is indices.graph else None
    once = [_shaped_once_per_batch(ids, batch_size) and _from_constants_and_shapes(ids)
            for ids in _forward_ids(indices)]
    if any(once) and not all(once):
        logger.warning(
            "A table is looked up both once per batch and per sample in one step (%s): all its rows are "
            "kept apart, so its once-per-batch rows reach the optimizer once per micro-batch, where Keras' "
            "large batch has them once. Optimizers that read rows one by one (Adam, RMSprop, clipping) then "
            "differ from the large batch; use separate tables, or check_exact to see by how much.",
            indices.op.name)
    return ONCE_PER_BATCH if all(once) else PER_SAMPLE


def _forward_ids(indices):
    """The ids of each forward lookup (a list): a gather's gradient flattens them
    (`Reshape`); where TensorFlow adds up the gradients of several lookups of one
    table it casts their indices to one integer type and concatenates them on axis 0."""
    op = indices.op
    while op.type in ("Reshape", "Identity", "Cast") and op.inputs[0].dtype.is_integer:
        indices, op = op.inputs[0], op.inputs[0].op
    if op.type == "ConcatV2" and tf.get_static_value(op.inputs[-1]) == 0:
        return [ids for part in op.inputs[:-1] for ids in _forward_ids(part)]
    return [indices]


def _shaped_once_per_batch(ids, batch_size=None):
    """Whether `ids` are shaped like one lookup for the batch, not one per sample.

    Ids whose leading axis is the micro-batch's (``(b, L)``: positions broadcast
    to every sample *before* the lookup, or token type ids of zeros) are one
    lookup per sample: the large batch keeps their rows apart. Keras gives a
    batch of static size its size as a Python number, so the program cannot
    tell a batch axis from a constant one; the shape tells. With the
    micro-batch's size noted (`note_batch_size`), any leading axis of another
    size is once per batch (T5's relative-position buckets, ``(L, L)``), and
    one of the same size is when it is carried from a `Range` (the same buckets
    with micro-batches of L samples; see `_leading_axis_counts_positions`);
    without it, a scalar, a vector or a leading axis of 1 (``(1, L)``).
    """
    shape = ids.shape
    if shape.rank is None:
        return False
    if shape.rank == 0:
        return True
    if batch_size is not None:
        if shape[0] is None:
            return False
        return shape[0] != batch_size or _leading_axis_counts_positions(ids)
    return shape.rank == 1 or shape[0] == 1


# Ops whose output's leading axis is spelled out by a shape (or a literal array), not
# carried from an input: zeros shaped like the batch, positions broadcast or tiled to it.
_SPELLED_OUT = frozenset({"Const", "Fill", "BroadcastTo", "Tile", "Reshape", "Transpose", "ConcatV2", "Pack",
                          "Pad", "PadV2", "MirrorPad", "ZerosLike", "OnesLike"})
# Ops that may add or drop an axis while keeping the input's leading one.
_KEEPS_LEADING = frozenset({"ExpandDims", "StridedSlice", "Squeeze"})


def _leading_axis_counts_positions(ids):
    """Whether `ids`' leading axis is the length of a `Range` carried through ops that keep it
    (T5's relative-position buckets, ``arange(L)[:, None] - arange(L)[None, :]`` and what
    follows), for ids whose leading axis equals the micro-batch's size: then it counts
    positions, not samples, and the lookup is once per batch (a T5 with micro-batches as long
    as its sequences). A leading axis spelled out by a shape or a literal array (zeros like the
    batch, positions broadcast or tiled to it) stays per sample, the answer for anything else."""
    todo, seen = [ids], set()
    while todo:
        current = todo.pop()
        if current.name in seen or len(seen) > _MAX_OPS:
            continue
        seen.add(current.name)
        op = current.op
        if op.type == "Range":
            return True
        if op.type in _SPELLED_OUT or current.shape.rank is None:
            continue
        leading = current.shape[0]
        for source in op.inputs:
            same_rank = source.shape.rank == current.shape.rank or op.type in _KEEPS_LEADING
            if source.shape.rank and same_rank and source.shape[0] == leading and source.dtype != tf.resource:
                todo.append(source)
    return False


def _is_symbolic(tensor):
    """Whether `tensor` belongs to a traced graph (eager tensors have no op)."""
    try:
        tensor.op  # noqa: B018  (eager tensors have no op)
    except AttributeError:
        return False
    return True


def _from_constants_and_shapes(tensor):
    """Whether `tensor`'s value is fixed by constants and shapes alone."""
    todo, seen = [tensor], set()
    while todo:
        current = todo.pop()
        key = (id(current.graph), current.name)
        if key in seen:
            continue
        seen.add(key)
        if len(seen) > _MAX_OPS:
            return False
        op = current.op
        if op.type in _SHAPE_ONLY or op.type == "Const":
            continue
        if op.type == "Placeholder":
            outer = _captured_from(current)
            if outer is None:
                return False        # an argument of the function: the data
            if _is_symbolic(outer):
                todo.append(outer)  # captured from an enclosing graph: follow it there
            elif outer.dtype == tf.resource:
                return False
            continue                # a constant captured from outside
        if op.type == "ReadVariableOp" and current.dtype.is_integer and _only_read(op.inputs[0]):
            continue                # an integer variable the step never writes: stored ids
        if op.op_def.is_stateful or any(t.dtype == tf.resource for t in op.inputs):
            return False            # iterators, random draws, variables' values
        todo.extend(op.inputs)
    return True


def _only_read(handle):
    """Whether every op of the step that uses the variable `handle` only reads it."""
    return all(op.type in _READS for op in handle.consumers())


def _captured_from(placeholder):
    """The outer tensor a function graph's placeholder captures, or None for an argument."""
    for external, internal in getattr(placeholder.graph, "captures", ()):
        if internal.name == placeholder.name:
            return external
    return None
