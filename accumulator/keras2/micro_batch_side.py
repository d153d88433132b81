"""The Keras 2 `GradientAccumulator`'s side of the micro-batch inside `fit`.

What `micro_batch_size="auto"` reads from a Keras 2 optimizer, as from the Keras 3 one
(`accumulator.batch.micro_batch_side.MicroBatchSide`, whose properties this class inherits):
`micro_batch_size` (the b in use, not "auto": the Keras 2 step of
`accumulator.keras2.fit_micro_batches` splits its batch by it), `micro_batch_changes`, and
`track_updates`, whose counter needs the update counted in Keras 2's terms: Keras 2's
optimizers update through `apply_gradients` (Keras 3's through `apply`). A mixin, first among
the bases of `accumulator.keras2.optimizer.GradientAccumulator`, which must then not define
`micro_batch_size` or `_hand_to_updater` itself (a class's own attribute wins over a base's).
"""

from __future__ import annotations

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import AUTO
from tfx_gradient_accumulator.accumulator.batch.micro_batch_side import MicroBatchSide
from tfx_gradient_accumulator.accumulator.core import _tf


class Keras2MicroBatchSide(MicroBatchSide):
    """`micro_batch_size`, `micro_batch_changes`, `track_updates` and the counted inner update of
    the Keras 2 class."""

    def _hand_to_updater(self, grads, variables, reduced):
        """The inner optimizer's one update, without a second aggregation (Keras 2's public
        `skip_gradients_aggregation`), counted where `track_updates` asked for it."""
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if pairs:
            self._counted_update([g for g, _ in pairs], [v for _, v in pairs], reduced)

    def _counted_update(self, grads, variables, reduced):
        """Keras 2's `apply_gradients`, +1 on `track_updates`' counter before any of its writes
        and +1 after its last (every variable it writes read back), as the Keras 3 class counts."""
        tracked = reduced or self.options.micro_batch_size == AUTO
        begun = getattr(self, "_updates_begun", None) if tracked else None
        if begun is None:
            self._updater.apply_gradients(zip(grads, variables), skip_gradients_aggregation=reduced)
            return
        with tf.control_dependencies([begun.assign_add(1)]):
            self._updater.apply_gradients(zip(grads, variables), skip_gradients_aggregation=reduced)
        _tf.assign_add_after(begun, 1, after=list(variables) + list(self._updater.variables))
