"""What runs between windows, eagerly: an open window closed, the window's length changed, room for rows made.

`BetweenWindows`, mixed into `AccumulationWindow`: `close_partial_window` (also where
training ends), `set_accum_steps` (a schedule's change, from the next window on) and
`make_row_room` (under XLA, before `fit` compiles). Each runs outside any step, on
the window's state (`self._state`); closing reuses the update rule's close
(`AccumulationWindow._update`, `_reset_window`).
"""

from __future__ import annotations

import logging

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core.options import validate_accum_steps, validate_partial_window
from tfx_gradient_accumulator.accumulator.rows import window_rows
from tfx_gradient_accumulator.accumulator.window import window_saving

logger = logging.getLogger(__name__)


class BetweenWindows:
    """The eager operations between windows of an `AccumulationWindow` (see the module)."""

    def close_partial_window(self, mode: str | None = None) -> int:
        """Applies ("apply"), keeps ("carry") or discards ("drop") an open window.

        Call it between training runs or where a custom loop's epoch ends;
        `fit` calls it with `partial_window` when an epoch and when training
        ends.

        Args:
            mode: "apply", "carry" or "drop"; None: the optimizer's `partial_window`.

        Returns:
            The number of micro-batches the window held.

        Raises:
            ValueError: `mode` is not one of those.
        """
        mode = validate_partial_window(mode or self.partial_window, name="mode")
        if not self._window_built() or self.is_passthrough:
            return 0
        s = self._state
        window_rows.refuse_overflowed_room(s)
        held = int(s.saved.micro_step.numpy())
        if mode == "carry" or (held == 0 and mode == "apply"):   # "drop" also empties a failed step's writes
            return held
        # Layers pooling statistics per window (AccumBatchNormalization) close theirs too.
        for layer in s.notes.listeners:
            layer.close_window(apply=mode == "apply")
        if not s.notes.with_grads:     # restored here, no step traced yet: close what it holds
            s.notes.with_grads |= window_saving.held_after_a_restore(s)
        if mode == "drop":
            self._reset_window(range(len(s.saved.accumulators)),
                               [i for i, rows in enumerate(s.saved.rows) if rows is not None])
            s.saved.micro_step.assign(0)
            s.notes.seen_in_window = set()
        else:
            self._close_now()
        return held

    def _close_at_training_end(self):
        """What `finalize_variable_values` does first: close the open window."""
        held = self.close_partial_window()
        if held and self.partial_window == "carry":
            logger.warning(
                "Training ended with %d micro-batch(es) held in an open window "
                "(partial_window='carry'); they are applied by the next fit or by "
                "close_partial_window('apply'), and are not in the weights yet.", held,
            )

    def _close_now(self):
        """Closes the open window eagerly, under the strategy it was built in."""
        s = self._state
        if s.notes.close_function is None:
            strategy = s.strategy

            def close_in_each_replica():
                self._update([], [], close_only=True)

            def close():
                strategy.run(close_in_each_replica)

            s.notes.close_function = tf.function(close)
        s.notes.close_function()

    def set_accum_steps(self, accum_steps: int) -> None:
        """Changes the window length from the next window on (no retracing).

        Args:
            accum_steps: the new micro-batches per window.

        Raises:
            TypeError: `accum_steps` is not an integer.
            ValueError: `accum_steps` < 1, a pass-through (`accum_steps=1` without
                `schedulable`) asked for more, or a window is open.
        """
        accum_steps = validate_accum_steps(accum_steps)
        if self.is_passthrough and accum_steps != 1:
            raise ValueError(
                "This GradientAccumulator was made with `accum_steps=1` and "
                "`schedulable=False`, a pass-through without buffers; construct "
                "it with `schedulable=True` to change `accum_steps` later."
            )
        if self._window_built() and int(self._state.saved.micro_step.numpy()):
            raise ValueError(
                "`accum_steps` can change only between windows; close the open "
                "window first (`close_partial_window`)."
            )
        self._accum_steps = accum_steps
        if self._window_built():
            self._state.saved.accum_steps.assign(accum_steps)
            window_rows.grow_rooms(self._state, accum_steps)
        for layer in self._state.notes.listeners:
            layer.set_accum_steps(accum_steps)

    def make_row_room(self, rows) -> dict:
        """Under XLA: room for per-sample sparse rows, made outside the compiled step
        (`accumulator.rows.row_room`, before `fit` compiles; `window_rows.has_room` as a step
        of static shapes is traced). `rows`: (variable, rows of one micro-batch) pairs.
        Returns {variable path: rows of one micro-batch} of every room the window has."""
        s = self._state
        for variable, count in rows:
            index = s.index_of(variable)
            if s.saved.rows[index] is not None:
                window_rows.note_room(s, index, count)
        window_rows.grow_rooms(s, int(s.saved.accum_steps.numpy()))
        return {getattr(s.variables[i], "path", None) or s.variables[i].name: n for i, n in s.notes.row_room.items()}

