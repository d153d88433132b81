"""What a layer may need to know of the micro-batch it is called on, inside `fit`'s step.

Under `GradientAccumulator(inner, micro_batch_size=b)` (`accumulator.batch.fit_micro_batches`)
one training step runs every micro-batch of the batch in a loop, and the last micro-batch is
padded up to b with rows that are masked out of the loss. A layer that keeps statistics of
its inputs (`AccumBatchNormalization`'s pooled moments) must leave those rows out, and learn
when the step's micro-batches are over. The step tells it here: `note_real_rows` while a
micro-batch is traced, `close_after_micro_batches` once the loop is done. The notes are
plain TensorFlow, so the rooms that train (`batch`) and the layers (the fronts) meet here
without importing each other: a layer reads the note (`real_rows`), and a front that pools
registers what closes it (`closes_after_micro_batches`).

The note is kept per thread (MirroredStrategy traces each replica in a thread of its own)
and tied to the graph it was made in: a layer traced in that graph, or in a graph nested in
it (a loop's body), reads it; any other trace (a step without micro-batches, inference)
finds none.
"""

import threading

import tensorflow as tf

_noted = threading.local()      # .graph, .real: the micro-step being traced in this thread
_closers = {}                   # {name: closer(model)}, in registration order


def note_real_rows(real) -> None:
    """While the micro-step is traced: `real`, a boolean vector over the micro-batch's rows,
    True where a row is the batch's own and False where it is padding."""
    if tf.executing_eagerly():
        return
    _noted.graph, _noted.real = tf.compat.v1.get_default_graph(), real


def real_rows():
    """The `real` noted for the micro-step being traced here (this graph or one it is nested
    in), or None: not inside a micro-step of `fit`'s step with `micro_batch_size`."""
    if tf.executing_eagerly():
        return None
    noted = getattr(_noted, "graph", None)
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if graph is noted:
            return _noted.real
        graph = getattr(graph, "outer_graph", None)
    return None


def closes_after_micro_batches(name: str, closer) -> None:
    """Registers `closer(model)`, run by `close_after_micro_batches` (once per `name`: a
    module imported again replaces its own)."""
    _closers[name] = closer


def close_after_micro_batches(model) -> None:
    """In the training step, after the loop over the micro-batches and before the update:
    the layers of `model` that pool their statistics over the step close them."""
    for closer in list(_closers.values()):
        closer(model)
