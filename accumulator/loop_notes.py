"""What a custom loop is told where it drifts from the large batch without a word.

`fit` weighs each micro-batch (the `compute_loss` hook hands over its weight) and
closes the windows at epoch and training ends (the window callback). A custom loop
does neither unless it says so, and two slips train unlike the large batch silently:
micro-batches of different sizes handed over without `micro_batch_weight` (each
counts the same in the window), and a window left open at the end (its micro-batches
never reach the weights). Where the optimizer can see either, it warns once:

- sizes: a step traced with no weight (no `micro_batch_weight`, no hook's weight, a
  mean loss) records the leading dimension of its function's inputs; a later trace
  of another size (the last, shorter micro-batch of an epoch retraces the step) is
  uneven micro-batches without a weight. Eager steps and steps traced for any size
  (`input_signature` with `None`) show no size: nothing is said there.
- open windows: `get_weights()` and saving (`model.save`, `save_weights`) of an
  optimizer whose window holds micro-batches, when they came from a custom loop
  (no hook's weight). In `fit`, mid-window saves (backups, checkpoints) are meant to
  resume, and `fit` itself reports a window it leaves open.
"""

from __future__ import annotations

import dataclasses
import logging

import tensorflow as tf

logger = logging.getLogger("tfx_gradient_accumulator.accumulator.window")

UNEVEN_MESSAGE = (
    "GradientAccumulator: the custom step calling apply_gradients was traced for "
    "micro-batches of %s sample(s), and before for %s, and is given no "
    "`micro_batch_weight`: every micro-batch counts the same in the window, so a "
    "smaller one sharing a window with larger ones counts more per sample than in "
    "the large batch. Pass each "
    "micro-batch's weight, e.g. `optimizer.apply_gradients(zip(grads, variables), "
    "micro_batch_weight=tf.cast(tf.shape(x)[0], tf.float32))` for a mean loss "
    "(or train with `fit`, which weighs them).")

OPEN_WINDOW_MESSAGE = (
    "GradientAccumulator: its state is read for saving (get_weights, model.save, "
    "save_weights) while its window holds %d micro-batch(es) that are not in the "
    "model's weights yet. In a custom loop, call `optimizer.close_partial_window()` "
    "where training (or an epoch) ends, before saving; a save meant to resume training "
    "mid-window (the window is saved with it) can ignore this.")


@dataclasses.dataclass
class LoopNotes:
    """What the window noted of the steps that feed it (Python, filled while steps are traced).

    Attributes:
        from_custom_loop: whether the last step traced handed over micro-batches without
            the `compute_loss` hook's weight (a custom loop, not `fit`).
        unweighted_sizes: the leading dimensions of the inputs of the steps traced
            without any weight, one tuple per trace.
        warned: the warnings given ("uneven", "open"), each once per optimizer.
    """

    from_custom_loop: bool = False
    unweighted_sizes: set = dataclasses.field(default_factory=set)
    warned: set = dataclasses.field(default_factory=set)

    def note_step(self, micro_batch_weight, noted_weight, summed):
        """Notes a micro-batch as its step is traced; warns once on unweighted uneven sizes.

        Args:
            micro_batch_weight: the caller's weight, or None.
            noted_weight: the `compute_loss` hook's weight, or None (a custom loop).
            summed: whether the loss sums over its samples (every micro-batch weighs 1 then).
        """
        self.from_custom_loop = noted_weight is None
        if micro_batch_weight is not None or noted_weight is not None or summed or tf.executing_eagerly():
            return
        sizes = _leading_dimensions(tf.compat.v1.get_default_graph())
        if not sizes:
            return
        others = [s for s in self.unweighted_sizes if s != sizes]
        self.unweighted_sizes.add(sizes)
        if others and "uneven" not in self.warned:
            self.warned.add("uneven")
            logger.warning(UNEVEN_MESSAGE, _said(sizes), _said(others[0]))

    def note_saved(self, held):
        """Warns once when a custom loop's state is saved with `held` (> 0) micro-batches unapplied."""
        if held and self.from_custom_loop and "open" not in self.warned:
            self.warned.add("open")
            logger.warning(OPEN_WINDOW_MESSAGE, held)


def _leading_dimensions(graph):
    """The static leading dimensions of the traced function's own inputs (not its captures)."""
    captured = {id(t) for t in getattr(graph, "internal_captures", ())}
    return tuple(sorted({int(t.shape[0]) for t in getattr(graph, "inputs", ())
                         if id(t) not in captured and t.dtype != tf.resource
                         and t.shape.rank and t.shape[0] is not None}))


def _said(sizes):
    """`sizes` as words ("8", "8 and 3")."""
    return " and ".join(str(s) for s in sizes)
