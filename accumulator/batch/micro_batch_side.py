"""The Keras 3 `GradientAccumulator`'s side of the micro-batch inside `fit`.

What the micro-batch's training and its records read from the optimizer: the b in use
(`micro_batch_size`, with "auto" the one it found), the changes "auto" made
(`micro_batch_changes`), and the counter that tells out-of-memory recovery whether an
error stopped an inner update half-way (`track_updates`; `fit_with_out_of_memory_recovery`
and `micro_batch_size="auto"` read it). A mixin of `GradientAccumulator`, beside the
window (`AccumulationWindow`), whose `options`, `_state` and `_updater` it reads.
"""

from __future__ import annotations

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import AUTO, MicroBatchChange, state_of
from tfx_gradient_accumulator.accumulator.core import _tf


class MicroBatchSide:
    """`micro_batch_size`, `micro_batch_changes` and `track_updates` of the Keras 3 class."""

    @property
    def micro_batch_size(self) -> int | None:
        """The samples of each micro-batch `fit`'s step splits its batch into, or None. With
        `micro_batch_size="auto"`, the one in use (None before the first batch)."""
        if self.options.micro_batch_size == AUTO:
            return state_of(self).current
        return self.options.micro_batch_size

    @property
    def micro_batch_changes(self) -> list[MicroBatchChange]:
        """With `micro_batch_size="auto"`: each change of the micro-batch, in order (a
        `MicroBatchChange`: `as_record()` gives its fields); empty otherwise."""
        if self.options.micro_batch_size != AUTO:
            return []
        return list(state_of(self).changes)

    def track_updates(self) -> tf.Variable:
        """A counter that tells whether an error stopped an inner update half-way.

        From the next traced step on, each update of the inner optimizer adds 1 before any
        of its writes and 1 after its last (every variable it writes read back): an odd
        count after an error says the update began and did not finish, some variables
        written and others not; an even one, that it did not begin or finished.
        `fit_with_out_of_memory_recovery` reads it. One device only. Not saved.

        Returns:
            The counter (int64, made on the first call).
        """
        if getattr(self, "_updates_begun", None) is None:
            with tf.init_scope():
                self._untracked(_updates_begun=tf.Variable(0, dtype=tf.int64, trainable=False,
                                                           name="updates_begun"))
            self._state.notes.close_function = None   # the eager close, traced again with the counter
        return self._updates_begun

    def _counted_update(self, grads, variables, reduced):
        """The inner optimizer's update, counted where `track_updates` asked for it."""
        # A pass-through's update counts where "auto" retries a step (one device, nothing to reduce).
        tracked = reduced or self.options.micro_batch_size == AUTO
        begun = getattr(self, "_updates_begun", None) if tracked else None
        if begun is None:
            self._updater.apply(grads, variables)
            return
        # `track_updates`: +1 before any write of the update, +1 after its last one.
        with tf.control_dependencies([begun.assign_add(1)]):
            self._updater.apply(grads, variables)
        _tf.assign_add_after(begun, 1, after=list(variables) + list(self._updater.variables))
