"""What both trainings of `micro_batch_size="auto"` read of a batch and write of a change:
one device (`fit_auto_micro_batch`) and under a strategy (`fit_auto_distributed`), each
importing this, neither the other.
"""

from __future__ import annotations

import logging
import math

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import MicroBatchChange

# The change's warning keeps the name it has always been logged under.
logger = logging.getLogger("tfx_gradient_accumulator.accumulator.batch.fit_auto_micro_batch")


def _first_tensor(x):
    return next(t for t in tf.nest.flatten(x) if t is not None)


def _elements_per_sample(x) -> int:
    """The input elements of one sample: the batch's x, each tensor's shape past its rows."""
    total = 0
    for tensor in tf.nest.flatten(x):
        if tensor is not None and hasattr(tensor, "shape"):
            total += int(math.prod(int(d) for d in tensor.shape[1:]))
    return max(total, 1)


def _next_batch(iterator):
    """The next batch, eagerly: from `fit`'s dataset iterator (StopIteration at its end, which
    `fit` ends the epoch on), or from `train_on_batch`'s generator."""
    if isinstance(iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)):
        optional = iterator.get_next_as_optional()
        if not optional.has_value():
            raise StopIteration
        return optional.get_value()
    return next(iter(iterator))


def _record(model, state, previous, errors, lost):
    change = MicroBatchChange(update=int(model.optimizer.iterations.numpy()) - 1, micro_batch=state.current,
                              previous_micro_batch=previous, effective_batch=state.effective_batch,
                              out_of_memory_errors=errors, seconds_lost=round(lost, 3), epoch=state.epoch)
    state.changes.append(change)
    logger.warning(
        "micro_batch_size='auto': out of memory at micro-batch %d of %d in epoch %d, update %d; the batch was "
        "trained again (%d out-of-memory errors, %.1f s lost) and training goes on at micro-batch %d (%d per "
        "update).", previous, state.effective_batch, change.epoch, change.update, errors, lost, state.current,
        math.ceil(state.effective_batch / state.current))
