"""A custom loop that is the large batch without two rules to remember: `micro_batches`.

`fit` weighs each micro-batch (the `compute_loss` hook) and closes the last window
(the window callback). A custom loop must otherwise do both itself: pass
`micro_batch_weight` (the last micro-batch is often shorter) and call
`close_partial_window()` where its data ends. `optimizer.micro_batches(data)` owns the
data instead, as accelerate's `accumulate` with a prepared loader does:

- before it yields an element it writes that micro-batch's weight, its leading
  dimension (its samples), into a variable of the optimizer; a step that calls
  `apply_gradients` without `micro_batch_weight` reads it there at run time (`weight_for`),
  so one trace serves micro-batches of any size without retracing;
- when the data ends it closes the last window (`close_partial_window()`, as
  `partial_window` says: "apply" makes the large batch's short last batch);
- left early (`break`, an exception in the loop's body) it leaves the window open, since
  the loop may go on later, and warns once if micro-batches are held: they are not in
  the weights until the window closes.

The weight read from the variable comes after an explicit `micro_batch_weight` and after
the weight the `compute_loss` hook hands over (a step that calls `model.compute_loss`
of a compiled model: masks and sample weights counted), and never with
`loss_reduction="sum"` (every micro-batch weighs 1 there). Outside `micro_batches` the
variable holds -1 and a step weighs 1, as without it.

One device only: elements of a distributed dataset (each replica its own size) are
refused, as is a call inside a `tf.function` (a loop over a `tf.data` dataset inside one
`tf.function` passes `micro_batch_weight`; `accumulator.window.loop_notes` warns where it does not).
"""

from __future__ import annotations

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf
from tfx_gradient_accumulator.accumulator.window import loop_notes

# What the weight variable holds outside `micro_batches`: the step weighs 1.
NO_WEIGHT = -1.0


class CustomLoopData:
    """`micro_batches`, mixed into both Keras' `GradientAccumulator` (an `AccumulationWindow`)."""

    def micro_batches(self, data):
        """Iterates `data`'s micro-batches, weighing each and closing the last window.

        ```python
        for x, y in optimizer.micro_batches(dataset):     # a tf.data.Dataset, or any iterable
            micro_step(x, y)        # apply_gradients without micro_batch_weight
        # the last window is closed here: the weights are the large batch's
        ```

        Each element's weight is its leading dimension (its samples: a mean loss's
        denominator); a step's explicit `micro_batch_weight` wins (masked tokens,
        summed sample weights). When `data` ends, `close_partial_window()` runs
        (`partial_window` says how); a loop that leaves early (`break`, an exception)
        leaves the window open and warns once if it holds micro-batches. Each call is
        one pass (an epoch): call it again for the next.

        Args:
            data: the micro-batches: a `tf.data.Dataset` or any iterable whose elements
                hold tensors or arrays with a leading (batch) dimension.

        Returns:
            A generator of `data`'s elements, unchanged.

        Raises:
            TypeError: `data` is not iterable.
            RuntimeError: called inside a `tf.function`, or the optimizer was built under
                a strategy with several replicas (pass `micro_batch_weight` there).
        """
        return micro_batches(self, data)


def micro_batches(window, data):
    """`CustomLoopData.micro_batches`: `data` checked, then a generator over it (`_feed`)."""
    if not tf.executing_eagerly():
        raise RuntimeError(
            "`optimizer.micro_batches(data)` runs eagerly, around the step: call it outside "
            "tf.function. In a loop over a tf.data dataset inside one tf.function, pass "
            "`micro_batch_weight=tf.cast(tf.shape(x)[0], tf.float32)` to apply_gradients and "
            "call `optimizer.close_partial_window()` after the loop.")
    strategy = window._state.strategy
    if tf.distribute.has_strategy() or (strategy is not None and strategy.num_replicas_in_sync > 1):
        raise RuntimeError(
            "`optimizer.micro_batches(data)` weighs micro-batches on one device; under a "
            "strategy each replica's micro-batch has its own size: pass "
            "`micro_batch_weight=tf.cast(tf.shape(x)[0], tf.float32)` in the step instead "
            "(or train with `fit`).")
    try:
        iterator = iter(data)
    except TypeError:
        raise TypeError(
            "`data` must be iterable (a tf.data.Dataset, a list of (x, y) micro-batches, ...); "
            f"got {type(data).__name__}.") from None
    return _feed(window, iterator)


def _feed(window, iterator):
    """Yields `iterator`'s elements with their weights written first; closes the window at its end."""
    notes = window._state.notes.loop_notes
    weight = _weight_variable(notes)
    notes.feeding += 1
    finished = False
    try:
        for element in iterator:
            weight.assign(leading_dimension(element))
            yield element
        finished = True
    finally:
        notes.feeding -= 1
        if not notes.feeding:
            weight.assign(NO_WEIGHT)
        if finished:
            window.close_partial_window()
        else:
            notes.note_left_early(window.held_micro_batches)


def _weight_variable(notes):
    """The variable a step reads its micro-batch's weight from (made eagerly, once per optimizer)."""
    if notes.weight is None:
        with tf.init_scope():
            notes.weight = tf.Variable(NO_WEIGHT, trainable=False, dtype=tf.float32, name="micro_batch_weight")
    return notes.weight


def leading_dimension(element):
    """The leading dimension of `element`'s first tensor or array, as a float32 number or tensor."""
    for value in tf.nest.flatten(element):
        if isinstance(value, tf.distribute.DistributedValues):
            raise TypeError(
                "`optimizer.micro_batches` got a distributed dataset's element (one value per "
                "replica); under a strategy pass `micro_batch_weight` in the step instead.")
        shape = getattr(value, "shape", None)
        if shape is None or not tf.TensorShape(shape).rank:
            continue
        size = tf.TensorShape(shape)[0]
        if size is not None:
            return float(size)
        return tf.cast(tf.shape(value)[0], tf.float32)
    raise TypeError(
        "Each element `optimizer.micro_batches` is given must hold a tensor or array with a "
        f"leading (batch) dimension, its weight; got {type(element).__name__}.")


def weight_for(window, micro_batch_weight):
    """The weight `apply_gradients` passes on: `micro_batch_weight` if given, else the one
    `micro_batches` wrote, where it applies (see the module's docstring), else None.

    Called as the step is traced (or eagerly, per step); notes the window as fed by a
    loop (`loop_notes.note_fed`) so its open window can be told of.
    """
    notes = window._state.notes.loop_notes
    loop_notes.note_fed(window)
    if micro_batch_weight is not None or notes.weight is None or window.is_passthrough:
        return micro_batch_weight
    if window.loss_reduction == "sum" or _hook_noted_a_weight(window):
        return None
    value = notes.weight.read_value()
    return tf.where(value >= 0.0, value, 1.0)


def _hook_noted_a_weight(window):
    """Whether the `compute_loss` hook handed over a weight for this micro-batch, in this graph."""
    noted = window._state.notes.noted_weight
    return noted.weight is not None and noted.graph is _tf.current_graph()
