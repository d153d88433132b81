"""`WindowLossScaling`: how a Keras 3 `GradientAccumulator` keeps mixed_float16's loss scaling.

Keras' `LossScaleOptimizer` scales the loss by S, unscales the gradient and skips a
step whose gradient is not finite. Around an accumulator it would do that for each
micro-batch; the large batch it stands for has one scale per update and skips a
whole step. So the accumulator holds the `LossScaleOptimizer` inside (`compile`'s
own one is moved there: `take_loss_scaling_from`, called by the "compile" hook),
scales each micro-batch's loss by S / N (`scale_loss`), and hands the window's mean,
at scale S, to it, as NaN where the large batch's float16 gradient would have
overflowed (`_beyond_float16_as_non_finite`: only in the variables of layers the
compiled model says compute in float16; elsewhere, as in Keras' own, only a non-finite
gradient skips). A mixin of `GradientAccumulator`: it reads the window's state and
`loss_scale_optimizer`, both the accumulator's.

Where it differs from Keras' `LossScaleOptimizer` used alone (Keras' own tests run
through it: tests/accumulator/test_keras_loss_scale_suite.py): `scale_loss` gives S / N,
not S, and `get_config` is the accumulator's, holding the LossScaleOptimizer's whole.
"""

from __future__ import annotations

import keras
import tensorflow as tf

# float32 values from here on round to inf in float16 (its largest finite value is 65504).
FLOAT16_OVERFLOW = 65520.0


class WindowLossScaling:
    """The loss-scaling part of the Keras 3 `GradientAccumulator` (see the module)."""

    def _beyond_float16_as_non_finite(self, grads, variables):
        """`grads` (the window's mean at the loss scale), or NaN where the large batch's
        float16 gradient would have overflowed: the LossScaleOptimizer then skips the
        window and halves the scale, as it skips the large batch's step.

        Each micro-batch's float16 gradient is a share of the large batch's; their sum,
        in float32, can pass float16's range where the large batch's own float16 sum
        rounds to inf (from 65520 on). Only the variables of layers that compute in
        float16 are checked, known from the model `compile` was called on
        (`take_loss_scaling_from`). Without a compiled model nothing says which
        gradients were float16's: then, as Keras' `LossScaleOptimizer` does, only a
        non-finite gradient skips (a finite float32 gradient past 65504 is applied).
        Maxima (`overwrite_with_gradient`) are not checked."""
        s, layers = self._state, getattr(self, "_float16_layers", None)
        if layers is None:
            return grads
        checked = {id(v) for layer in layers for v in layer.trainable_weights}
        values = [g.values if isinstance(g, tf.IndexedSlices) else g
                  for i, (g, v) in enumerate(zip(grads, variables))
                  if g is not None and i not in s.overwrite_indices and id(v) in checked]
        if not values:
            return grads
        # NaN and inf fail the comparison too: the LossScaleOptimizer skips those anyway.
        in_range = tf.reduce_all(tf.stack([tf.reduce_all(tf.abs(v) < FLOAT16_OVERFLOW) for v in values]))

        def checked_value(g):
            return tf.where(in_range, g, tf.constant(float("nan"), g.dtype))

        return [g if g is None else tf.IndexedSlices(checked_value(g.values), g.indices, g.dense_shape)
                if isinstance(g, tf.IndexedSlices) else checked_value(g) for g in grads]

    # Keras' `LossScaleOptimizer` settings and scale, read through the accumulator that
    # holds one (code written for `LossScaleOptimizer(inner)` keeps working once it is
    # wrapped); AttributeError without one, as on any other optimizer.
    @property
    def initial_scale(self) -> float:
        """The `LossScaleOptimizer`'s initial loss scale S (its `initial_scale`)."""
        return self._held_loss_scale_optimizer("initial_scale").initial_scale

    @property
    def dynamic_growth_steps(self) -> int:
        """The `LossScaleOptimizer`'s `dynamic_growth_steps`: updates (windows) between
        doublings of the scale."""
        return self._held_loss_scale_optimizer("dynamic_growth_steps").dynamic_growth_steps

    @property
    def dynamic_scale(self):
        """The `LossScaleOptimizer`'s current scale S, a variable (made when it is built).
        Each micro-batch's loss is scaled by S / accum_steps: `scale_loss`."""
        return self._held_loss_scale_optimizer("dynamic_scale").dynamic_scale

    def _held_loss_scale_optimizer(self, name):
        """The `LossScaleOptimizer` inside; AttributeError naming `name` without one."""
        held = getattr(self, "loss_scale_optimizer", None)
        if held is None:
            raise AttributeError(f"{type(self).__name__} has no `{name}`: it holds no LossScaleOptimizer "
                                 "(wrap one: GradientAccumulator(keras.optimizers.LossScaleOptimizer(inner), N)).")
        return held

    def _window_gradient_scale(self):
        """The loss scale the window's mean carries (None without a LossScaleOptimizer)."""
        # In Keras 3 the loss is scaled by `scale_loss` and the LossScaleOptimizer
        # unscales in `apply`: the window's mean carries its scale S.
        if self.loss_scale_optimizer is None:
            return None
        return self.loss_scale_optimizer.scale_loss(1.0)

    def _loss_scale_divisor(self):
        """N: each micro-batch's loss is scaled by S / N, not by the window's S (None: no
        loss scaling, or a pass-through).

        The large batch's loss is the mean over N micro-batches' worth of samples, so
        at scale S each sample's float16 gradient is S / (N b) times its term; a
        micro-batch's own mean at S would make it S / b, N times larger, and windows
        would overflow at a scale N times smaller than the large batch's steps do. At
        S / N each micro-batch's float16 intermediates are the large batch's (exactly
        for equal micro-batches), and the window's sums, divided by the window's weight
        over N, carry S again for the LossScaleOptimizer to unscale (for N a power of
        two, scaling by S / N and back is exact: the same bits as scaling by S)."""
        if self.loss_scale_optimizer is None or self.is_passthrough:
            return None
        if self._window_built():
            return tf.cast(self._state.saved.accum_steps, tf.float32)
        return float(self._accum_steps)

    def scale_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """The micro-batch's loss scaled by its share of the loss scale: S / accum_steps
        under a `LossScaleOptimizer` of scale S (S in a pass-through).

        Custom loops scale each micro-batch's loss with this, not with the inner
        `LossScaleOptimizer`'s `scale_loss`: the window's sums then carry S, which
        the LossScaleOptimizer unscales (`_loss_scale_divisor` says why S / N).

        Args:
            loss: the micro-batch's loss.

        Returns:
            The scaled loss (unchanged without loss scaling).
        """
        divisor = self._loss_scale_divisor()
        if divisor is None:
            return self._updater.scale_loss(loss)
        return loss * (self.loss_scale_optimizer.scale_loss(1.0) / divisor)

    def take_loss_scaling_from(self, wrapper: keras.optimizers.LossScaleOptimizer,
                               float16_layers: list | None = None) -> bool:
        """Puts the loss scaling of `wrapper`, a `LossScaleOptimizer` around this
        accumulator, inside it: what `compile` does under mixed_float16 (`accumulator.hooks`).

        The accumulator then holds `LossScaleOptimizer(inner)` with `wrapper`'s
        settings (`loss_scale_optimizer`): one scale per window, a window with any
        non-finite micro-batch skipped whole. Outside, `wrapper` would unscale each
        micro-batch and skip single micro-batches.

        Args:
            wrapper: the `LossScaleOptimizer` around this accumulator (then unused).
            float16_layers: the layers that compute in float16 (the large batch's
                gradients of their variables are float16). A window whose mean at the
                loss scale is beyond float16's range in any of them is skipped, as the
                large batch's float16 gradient would overflow there. None: not known
                (only a non-finite gradient skips, as in Keras' own).

        Returns:
            Whether the scaling is inside now: already (a `LossScaleOptimizer` given or
            taken before: `wrapper` is dropped) or taken; False for an accumulator
            built without one, whose variables are fixed.
        """
        if float16_layers is not None:
            self._untracked(_float16_layers=list(float16_layers))
        if self.loss_scale_optimizer is not None:
            return True
        if self.built:
            return False
        self._updater = keras.optimizers.LossScaleOptimizer(
            self._updater, initial_scale=wrapper.initial_scale,
            dynamic_growth_steps=wrapper.dynamic_growth_steps, name=wrapper.name)
        self.loss_scale_optimizer = self._updater
        return True


def float16_layers(model):
    """`model`'s layers that compute in float16 (their gradients are the large batch's
    float16 ones); a layer without sub-layers (`layers`) counts whole. Layers, not
    variables: a model compiled before it is built has no variables yet."""
    found, layers = [], list(getattr(model, "layers", []))
    while layers:
        layer = layers.pop()
        inner = getattr(layer, "layers", None)
        if inner:
            layers.extend(inner)
        elif getattr(layer, "compute_dtype", None) == "float16":
            found.append(layer)
    return found
