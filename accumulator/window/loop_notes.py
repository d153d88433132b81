"""What a custom loop is told where it drifts from the large batch without a word.

`fit` weighs each micro-batch (the `compute_loss` hook hands over its weight) and
closes the windows at epoch and training ends (the window callback). A custom loop
does neither unless it says so (`optimizer.micro_batches(data)` does both for it:
`accumulator.window.custom_loop`), and two slips train unlike the large batch silently:
micro-batches of different sizes handed over without a weight (each counts the same in
the window), and a window left open at the end (its micro-batches never reach the
weights). Where the optimizer can see either, it warns once (`warnings.warn`, category
`CustomLoopWarning`, and this module's logger):

- sizes: a step traced with no weight (no `micro_batch_weight`, no hook's weight, no
  `micro_batches`, a mean loss) records the leading dimension of its function's
  inputs; a later trace of another size (the last, shorter micro-batch of an epoch
  retraces the step) is uneven micro-batches without a weight ("uneven"). A step traced
  for any size (a leading dimension of None: `tf.function(reduce_retracing=True)` after
  a second size, an `input_signature` with None, a loop over a `tf.data` dataset inside
  one `tf.function`) cannot tell its sizes apart: it is warned as it is traced that
  micro-batches of different sizes would weigh wrong ("any size"). Eager steps show no
  size: nothing is said there.
- open windows, from a custom loop (no hook's weight) only: `get_weights()` and saving
  of the optimizer (`model.save`, `save_weights` of a model compiled with it) while its
  window holds micro-batches; `get_weights()`, `save` or `save_weights` of any model
  whose variables a live optimizer's open window holds (an uncompiled model: the model
  does not know its optimizer, the optimizer knows the variables; the `Model` hooks of
  `accumulator.hooks` ask `note_model_read`); a `micro_batches` loop left early with
  micro-batches held; and the end of the program, or of the optimizer (collected), with
  a window still open ("exit": a `weakref.finalize` per optimizer a loop fed, which also
  runs at the interpreter's exit; it holds the window's count, not the optimizer). In `fit`,
  mid-window saves (backups, checkpoints) are meant to resume, and `fit` itself reports
  a window it leaves open; inside `micro_batches` the window closes when the data ends.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import warnings
import weakref
from typing import Any

import tensorflow as tf

logger = logging.getLogger("tfx_gradient_accumulator.accumulator.window.window")

THE_WAY = ("Loop with `for batch in optimizer.micro_batches(data):` (it weighs each micro-batch "
           "and closes the last window), or pass each micro-batch's weight, e.g. "
           "`optimizer.apply_gradients(zip(grads, variables), "
           "micro_batch_weight=tf.cast(tf.shape(x)[0], tf.float32))` for a mean loss "
           "(or train with `fit`, which weighs them).")

UNEVEN_MESSAGE = (
    "GradientAccumulator: the custom step calling apply_gradients was traced for "
    "micro-batches of %s sample(s), and before for %s, and is given no "
    "`micro_batch_weight`: every micro-batch counts the same in the window, so a "
    "smaller one sharing a window with larger ones counts more per sample than in "
    "the large batch. " + THE_WAY)

ANY_SIZE_MESSAGE = (
    "GradientAccumulator: the custom step calling apply_gradients is traced for "
    "micro-batches of any size (a leading dimension of None: tf.function(reduce_retracing=True), "
    "an input_signature with None, or a loop over a tf.data dataset inside one tf.function) "
    "and is given no `micro_batch_weight`: every micro-batch counts the same in the window, "
    "so micro-batches of different sizes (a shorter last one) train unlike the large batch. "
    + THE_WAY + " Inside one tf.function, pass `micro_batch_weight`.")

OPEN_WINDOW_MESSAGE = (
    "GradientAccumulator: its state is read for saving (get_weights, model.save, "
    "save_weights) while its window holds %d micro-batch(es) that are not in the "
    "model's weights yet. In a custom loop, call `optimizer.close_partial_window()` "
    "where training (or an epoch) ends, before saving, or loop with "
    "`optimizer.micro_batches(data)`, which closes it; a save meant to resume training "
    "mid-window (the window is saved with it) can ignore this.")

MODEL_OPEN_WINDOW_MESSAGE = (
    "GradientAccumulator: the model's weights are read (get_weights, save, save_weights) "
    "while a GradientAccumulator's window holds %d micro-batch(es) of a custom loop that "
    "are not in them yet. Call `optimizer.close_partial_window()` where training (or an "
    "epoch) ends, or loop with `optimizer.micro_batches(data)`, which closes it.")

LEFT_EARLY_MESSAGE = (
    "GradientAccumulator: the loop left `optimizer.micro_batches(data)` before its data "
    "ended (break, or an exception), with %d micro-batch(es) held in an open window that "
    "are not in the model's weights yet: iterate again (the window goes on), or call "
    "`optimizer.close_partial_window()` to apply them.")

EXIT_MESSAGE = (
    "GradientAccumulator: the program ends (or the optimizer is discarded) with %d "
    "micro-batch(es) of a custom loop held in an open window: they never reached the "
    "model's weights. Call "
    "`optimizer.close_partial_window()` where training ends, or loop with "
    "`optimizer.micro_batches(data)`, which closes it.")


class CustomLoopWarning(UserWarning):
    """A custom loop trains unlike the large batch (or is about to): `accumulator.window.loop_notes`."""


# Packages whose frames a warning skips to reach the user's line.
_NOT_THE_USERS = {"tfx_gradient_accumulator", "tensorflow", "keras", "tf_keras", "contextlib", "functools", "weakref"}

# The optimizers `apply_gradients` has fed, while they live: the `Model` hooks ask those a custom loop fed.
_fed = weakref.WeakSet()


@dataclasses.dataclass
class LoopNotes:
    """What the window noted of the steps that feed it (Python, filled while steps are traced).

    Attributes:
        from_custom_loop: whether the last step traced handed over micro-batches without
            the `compute_loss` hook's weight (a custom loop, not `fit`).
        unweighted_sizes: the leading dimensions of the inputs of the steps traced
            without any weight, one tuple per trace.
        warned: the warnings given ("uneven", "any size", "open", "left", "exit"), each
            once per optimizer.
        weight: the variable `micro_batches` writes each micro-batch's weight to (-1
            outside it), made by its first call; None before (`accumulator.window.custom_loop`).
        feeding: how many `micro_batches` loops over this optimizer are running.
    """

    from_custom_loop: bool = False
    unweighted_sizes: set = dataclasses.field(default_factory=set)
    warned: set = dataclasses.field(default_factory=set)
    weight: Any = None
    feeding: int = 0

    def note_step(self, micro_batch_weight, noted_weight, summed):
        """Notes a micro-batch as its step is traced; warns once on unweighted uneven sizes,
        and once on a step traced for any size without a weight.

        Args:
            micro_batch_weight: the caller's weight (or `micro_batches`'), or None.
            noted_weight: the `compute_loss` hook's weight, or None (a custom loop).
            summed: whether the loss sums over its samples (every micro-batch weighs 1 then).
        """
        self.from_custom_loop = noted_weight is None
        if micro_batch_weight is not None or noted_weight is not None or summed or tf.executing_eagerly():
            return
        sizes, any_size = _leading_dimensions(tf.compat.v1.get_default_graph())
        if any_size:
            self._warn_once("any size", ANY_SIZE_MESSAGE)
        if not sizes:
            return
        others = [s for s in self.unweighted_sizes if s != sizes]
        self.unweighted_sizes.add(sizes)
        if others:
            self._warn_once("uneven", UNEVEN_MESSAGE, _said(sizes), _said(others[0]))

    def note_saved(self, held):
        """Warns once when a custom loop's state is saved with `held` (> 0) micro-batches unapplied."""
        if held and self.from_custom_loop and not self.feeding:
            self._warn_once("open", OPEN_WINDOW_MESSAGE, held)

    def note_left_early(self, held):
        """Warns once when a `micro_batches` loop ends before its data with `held` micro-batches held."""
        if held:
            self._warn_once("left", LEFT_EARLY_MESSAGE, held)

    def _warn_once(self, kind, message, *arguments):
        """Says `message % arguments` once per optimizer: a `CustomLoopWarning` and the logger."""
        if kind in self.warned:
            return
        self.warned.add(kind)
        # Logged only where logging is set up: unconfigured, both would print the same text.
        if logger.hasHandlers():
            logger.warning(message, *arguments)
        warnings.warn(message % arguments, CustomLoopWarning, stacklevel=_users_stacklevel())


def note_fed(window):
    """Notes `window` (a built `AccumulationWindow`) as fed by `apply_gradients`, so that its
    open window can be told of at a model's read and when the optimizer or the program ends."""
    if window in _fed:
        return
    _fed.add(window)
    # Run when the optimizer is collected, or at the exit (`weakref.finalize` runs those
    # still alive then): it holds the notes and the count, not the optimizer.
    weakref.finalize(window, _note_end, window._state.notes.loop_notes, window._state.saved.micro_step)


def note_model_read(model, saving):
    """Before `model.get_weights()`, `save` or `save_weights` (`saving`): warns once per optimizer
    whose custom loop's open window holds micro-batches for any of `model`'s variables. A save
    of a model compiled with the optimizer saves its window too: `note_saved` says that."""
    ids = None
    for window in list(_fed):
        notes = window._state.notes.loop_notes
        if not notes.from_custom_loop or notes.feeding or "open" in notes.warned or not window._window_built() \
                or (saving and getattr(model, "optimizer", None) is window):
            continue
        if ids is None:
            ids = {id(v) for v in getattr(model, "variables", ())}
        if not any(id(v) in ids for v in window._state.variables):
            continue
        held = window.held_micro_batches
        if held:
            notes._warn_once("open", MODEL_OPEN_WINDOW_MESSAGE, held)


def _note_end(notes, micro_step):
    """When a custom loop's optimizer is collected or the program ends: warns once if its window
    holds micro-batches (they never reach the weights), unless that was told before."""
    if not notes.from_custom_loop or notes.warned & {"open", "left"}:
        return
    try:
        with tf.init_scope():       # collected while a step is traced: read eagerly all the same
            held = int(micro_step.numpy())
    except Exception:   # noqa: BLE001  (TensorFlow already torn down: nothing can be read, nothing to say)
        return
    if held:
        notes._warn_once("exit", EXIT_MESSAGE, held)


def _users_stacklevel():
    """The `stacklevel` of the first caller outside this library, TensorFlow and Keras (for
    `_warn_once`'s `warnings.warn`): the warning names the user's line."""
    frame, level = inspect.currentframe().f_back.f_back, 2     # level 1: `_warn_once`, 2: its caller
    while frame is not None and frame.f_back is not None and \
            frame.f_globals.get("__name__", "").split(".")[0] in _NOT_THE_USERS:
        frame, level = frame.f_back, level + 1
    return level


def _leading_dimensions(graph):
    """(the static leading dimensions of the traced function's own inputs (not its captures),
    whether one of them has none: a step traced for any size)."""
    captured = {id(t) for t in getattr(graph, "internal_captures", ())}
    shapes = [t.shape for t in getattr(graph, "inputs", ())
              if id(t) not in captured and t.dtype != tf.resource and t.dtype != tf.variant and t.shape.rank]
    return tuple(sorted({int(s[0]) for s in shapes if s[0] is not None})), any(s[0] is None for s in shapes)


def _said(sizes):
    """`sizes` as words ("8", "8 and 3")."""
    return " and ".join(str(s) for s in sizes)
