"""What both `GradientAccumulator` classes (Keras 3 and Keras 2) forward to the inner optimizer.

Mixed in before each Keras' optimizer base, so these win over the base's own.
"""

from __future__ import annotations

from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow, optimizer_chain


class InnerOptimizerForwarding:
    """The inner optimizer's update count, learning rate and weight-decay exclusions.

    The class mixing it in has `inner_optimizer` (the optimizer that makes the
    updates) and `_is_loss_scale_optimizer(optimizer)` (its Keras' `LossScaleOptimizer`).
    """

    @property
    def iterations(self):
        """The update-making optimizer's count: updates, not micro-steps."""
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        """The inner optimizer's learning rate (set on the inner optimizer too)."""
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def exclude_from_weight_decay(self, var_list=None, var_names=None) -> None:
        """Forwarded to the optimizers that apply weight decay (the inner ones).

        Args:
            var_list: variables to exclude.
            var_names: names (substrings) of variables to exclude.
        """
        for optimizer in optimizer_chain(self.inner_optimizer):
            if not isinstance(optimizer, AccumulationWindow) and not self._is_loss_scale_optimizer(optimizer):
                optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)
