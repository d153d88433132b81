"""Loss scaling (mixed_float16) for `fit`'s micro-batches under Keras 2.

The Keras 2 side of the "Loss scaling" section of `accumulator.batch.fit_micro_batches`
(one loss scale S per update, each micro-batch's loss scaled by S times its share of the
batch's samples, one unscaling and one finiteness check), read by
`accumulator.keras2.fit_micro_batches`. What Keras 2 does differently:

- Where the scaling is. Keras 2's `compile` puts a `LossScaleOptimizer` around any
  optimizer of a mixed_float16 model that is not one, with no switch to stop it (Keras 3
  has `auto_scale_loss`). Around the accumulator it would stay outside the step's
  micro-batches, and `fit`'s step would not even know the model trains in micro-batches.
  So, before `fit` trains, `take_loss_scaling_inside` does what Keras 3's "compile" hook
  does: the accumulator (unbuilt) holds `LossScaleOptimizer(inner)` with the settings
  Keras 2 gave the one around it, and goes back to being `model.optimizer` (the
  accumulator the user compiled with, as `GradientAccumulator(LossScaleOptimizer(inner),
  micro_batch_size=b)` written by hand; its config holds the LossScaleOptimizer, so a
  saved model loads as that form).
- Who unscales. Keras 2's `LossScaleOptimizer.apply_gradients` takes gradients already
  unscaled (`get_unscaled_gradients`) and checks them; Keras 3's unscales in
  `apply_gradients`. So the step unscales the reduced gradient itself, once, after the
  float16 range check (`unscaled`), and the LossScaleOptimizer skips a non-finite update
  and lowers the scale, as it does for the large batch.
"""


import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import flavours, loss_scaling
from tfx_gradient_accumulator.accumulator.batch import fit_micro_batches
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow


def _loss_scale_optimizer_class():
    """Keras 2's `mixed_precision.LossScaleOptimizer`."""
    return flavours.keras2_module().mixed_precision.LossScaleOptimizer


def take_loss_scaling_inside(model):
    """Before `fit` trains a Keras 2 model whose `LossScaleOptimizer` (put by `compile`
    under mixed_float16) holds a `GradientAccumulator` with `micro_batch_size`: the
    scaling moved inside the accumulator, which becomes `model.optimizer` again (the
    module says why). An accumulator built already cannot take it (its variables are
    fixed): refused, naming the form that works."""
    outer = getattr(model, "optimizer", None)
    if not isinstance(outer, _loss_scale_optimizer_class()):
        return
    accumulator = outer.inner_optimizer
    if not isinstance(accumulator, AccumulationWindow) or accumulator.options.micro_batch_size is None:
        return
    size = accumulator.options.micro_batch_size
    if accumulator.loss_scale_optimizer is None and _built(accumulator):
        raise ValueError(
            f"micro_batch_size={size}: the GradientAccumulator is inside a LossScaleOptimizer (Keras 2's "
            "compile puts one around it under mixed_float16) and was built without loss scaling, so it "
            "cannot take it inside. Compile a new one, or write GradientAccumulator("
            "tf_keras.mixed_precision.LossScaleOptimizer(inner), micro_batch_size=...).")
    if accumulator.loss_scale_optimizer is None:
        settings = {"dynamic": outer.dynamic, "initial_scale": outer.initial_scale}
        if outer.dynamic:
            settings["dynamic_growth_steps"] = outer.dynamic_growth_steps
        with model.distribute_strategy.scope():
            accumulator._updater = _loss_scale_optimizer_class()(accumulator._updater, **settings)
    model.optimizer = accumulator


def _built(accumulator):
    """Whether the accumulator or its inner optimizer has made its variables."""
    return accumulator._window_built() or getattr(accumulator.inner_optimizer, "_built", False)


def loss_scale(optimizer):
    """The loss scale S of this update (a float32 scalar), or None without loss scaling.
    Read through `get_scaled_loss`, so Keras 2's LossScaleOptimizer knows the loss was
    scaled (it warns otherwise)."""
    held = getattr(optimizer, "loss_scale_optimizer", None)
    if held is None:
        return None
    return tf.cast(held.get_scaled_loss(tf.constant(1.0)), tf.float32)


def unscaled(model, optimizer, grads, variables):
    """The update's gradient (the reduced mean at the loss scale S) unscaled once by the
    LossScaleOptimizer, NaN throughout where a float16 layer's variable has one beyond
    float16's range (the large batch's float16 sum would be inf there): the
    LossScaleOptimizer then skips the update and lowers the scale, as for the large batch."""
    grads = fit_micro_batches._float16_overflow_as_nan(loss_scaling.float16_layers(model), grads, variables)
    return optimizer.loss_scale_optimizer.get_unscaled_gradients(grads)
