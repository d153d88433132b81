"""How much each micro-batch weighs in its window, so the window is one exact batch.

A micro-batch weighs its loss's denominator (its element count, unmasked steps or summed
sample weight), or 1 with a loss reduced by "sum" (`SUMMED_LOSS`). In `fit`, `note_batch`
(from the `compute_loss` hook) reads it from the compiled loss and hands it to the
optimizer; a custom loop passes `micro_batch_weight`, or iterates its data with
`optimizer.micro_batches(data)`, which writes each micro-batch's sample count where the
step reads it (`accumulator.window.custom_loop`).
"""

import functools
import logging

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.rows import lookups
from tfx_gradient_accumulator.accumulator.core._tf import current_graph
from tfx_gradient_accumulator.accumulator.window.window import SUMMED_LOSS, AccumulationWindow

logger = logging.getLogger(__name__)


def note_batch(model, x, y, y_pred, sample_weight):
    """Called by the `compute_loss` hook on training batches: hands D of the batch to
    the model's optimizer (`AccumulationWindow.note_micro_batch_weight`).

    Only for models compiled with an accumulating `GradientAccumulator`; under
    `tf.function` it runs when the step is traced, so it costs nothing per step.
    """
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, AccumulationWindow) or optimizer.is_passthrough:
        return
    # Its samples too: the noise scale counts samples, where D counts a sequence's tokens.
    optimizer.note_micro_batch_weight(loss_denominator(model, x, y, y_pred, sample_weight),
                                      loss_samples(model, x, y, y_pred))
    lookups.note_batch_size(_static_batch_size(x), current_graph())


def _static_batch_size(x):
    """The batch's size from its first tensor's static shape, or None."""
    flat = [t for t in tf.nest.flatten(x) if t is not None and hasattr(t, "shape")]
    return tf.TensorShape(flat[0].shape)[0] if flat and tf.TensorShape(flat[0].shape).rank else None


def _batch_size(x):
    """The batch's size as a float tensor (1 for no tensors)."""
    flat = [t for t in tf.nest.flatten(x) if t is not None]
    if not flat:
        return tf.constant(1.0)
    return tf.cast(tf.shape(flat[0])[0], tf.float32)


def _first_loss(model):
    """(loss, key, index) of the model's first compiled loss (key: its output's name in a
    dict of losses, index: its position), or None without one."""
    loss = getattr(model, "loss", None)
    if loss is None:
        return None
    if isinstance(loss, dict):
        names = [n for n in (getattr(model, "output_names", None) or list(loss)) if loss.get(n) is not None]
        if not names:
            return None
        key = names[0]
        return loss[key], key, list(getattr(model, "output_names", None) or list(loss)).index(key)
    if isinstance(loss, (list, tuple)):
        indices = [i for i, item in enumerate(loss) if item is not None]
        return (loss[indices[0]], None, indices[0]) if indices else None
    return loss, None, None


def _first_output_loss(model, y, y_pred, sample_weight):
    """(loss, y, y_pred, sample_weight) of the model's first compiled loss, or None."""
    found = _first_loss(model) if y is not None else None
    if found is None:
        return None
    loss, key, index = found
    if index is None:
        return loss, y, y_pred, sample_weight

    def pick(structure):
        if isinstance(structure, dict):
            return structure[key] if key in structure else list(structure.values())[index]
        if isinstance(structure, (list, tuple)):
            return structure[index]
        return structure

    return loss, pick(y), pick(y_pred), pick(sample_weight)


def summed_loss(model):
    """The model's compiled loss (its first output's) when it sums over its samples
    (reduction "sum" or "none"), else None: what `loss_denominator` notes as
    `SUMMED_LOSS`, known from `compile`, before any batch."""
    found = _first_loss(model)
    if found is None:
        return None
    loss = flavours.keras_package_of(model).losses.get(found[0])
    return loss if getattr(loss, "reduction", "sum_over_batch_size") in (None, "none", "sum") else None


@functools.lru_cache(maxsize=None)
def _ones_loss_class(keras_package):
    """A loss of `keras_package` whose values are ones shaped like `values`: its
    reduction (sample weights, masks) is that Keras' own."""

    class Ones(keras_package.losses.Loss):
        def __init__(self, values, reduction):
            super().__init__(name="accumulator_denominator", reduction=reduction)
            self.values = values

        def call(self, y_true, y_pred):
            return tf.ones_like(self.values)

    return Ones


def _warn_if_regularized(model):
    """Warns when a summed loss's model adds losses of its own: the window counts them per micro-batch."""
    if getattr(model, "losses", None):
        logger.warning(
            "The model's loss sums over its samples (reduction 'sum' or 'none') and the model "
            "adds losses of its own (weight regularizers, add_loss): the window sums the "
            "micro-batches' gradients, as the large batch sums its samples', and so counts "
            "those losses once per micro-batch, where the large batch counts them once. "
            "Use a mean reduction ('sum_over_batch_size') for the large batch's weights.")


def loss_samples(model, x, y, y_pred):
    """The batch's samples, on the scale of `loss_denominator`: the noise scale's unit.

    Keras 3 divides a mean loss by the replicas under a strategy, so D carries their
    count; the same reduction of one per sample carries it too (a sequence's D counts
    its tokens, this counts it once). Keras 2's D does not: its samples are the batch's.
    """
    found = _first_output_loss(model, y, y_pred, None)
    if found is None or flavours.is_keras2_object(model):
        return _batch_size(x)
    keras_package = flavours.keras_package_of(model)
    loss = keras_package.losses.get(found[0])
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if reduction in (None, "none", "sum"):
        return _batch_size(x)
    # Ones per sample, without the outputs' mask (a mask is per element).
    per_sample = tf.ones(tf.shape(tf.convert_to_tensor(found[2]))[:1])
    ones = _ones_loss_class(keras_package)
    summed = ones(per_sample, "sum")(per_sample, per_sample)
    return tf.cast(tf.math.divide_no_nan(summed, ones(per_sample, reduction)(per_sample, per_sample)), tf.float32)


def loss_denominator(model, x, y, y_pred, sample_weight):
    """D of the model's compiled loss on this batch (of its first output's loss), or
    `SUMMED_LOSS` when that loss sums over its samples (reduction "sum" or "none").

    A loss that returns one number per batch (a function that reduces its samples itself)
    weighs the batch's samples, as a mean loss over them: its window is exact when that
    number is their mean, and the noise scale comes in samples either way (a sum is a
    constant multiple, b, of the mean on equal micro-batches; exact windows of a sum need
    `loss_reduction="sum"`).

    Keras 3: the ratio of the loss's sum to its own reduction, both on ones.
    Keras 2 (whose `sum_over_batch_size` divides by the loss elements, or by the
    unmasked ones under a mask, whatever the sample weights): the reduction
    "sum" of ones without sample weights (the one reduction Keras 2 allows on
    any loss under a strategy).
    """
    found = _first_output_loss(model, y, y_pred, sample_weight)
    if found is None:
        return _batch_size(x)
    keras_package = flavours.keras_package_of(model)
    keras2 = flavours.is_keras2_object(model)
    loss, y_t, y_p, weight = found
    loss = keras_package.losses.get(loss)
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if reduction in (None, "none", "sum"):
        _warn_if_regularized(model)
        return SUMMED_LOSS
    compute = loss.call if isinstance(loss, keras_package.losses.Loss) else loss
    y_p_tensor = tf.convert_to_tensor(y_p)
    values = compute(tf.cast(tf.convert_to_tensor(y_t), y_p_tensor.dtype), y_p_tensor)
    if values.shape.rank == 0:
        # The loss reduced its batch itself (one number per batch, a mean or a sum of the
        # samples: it does not say): weighed by its samples, as a mean over them would be,
        # not 1, so a window's size, and the noise scale, are in samples.
        values = tf.ones(tf.shape(y_p_tensor)[:1], values.dtype)
    ones = _ones_loss_class(keras_package)
    if keras2:
        return tf.cast(ones(values, "sum")(y_t, y_p), tf.float32)
    reduced = ones(values, reduction)(y_t, y_p, weight)
    summed = ones(values, "sum")(y_t, y_p, weight)
    return tf.cast(tf.math.divide_no_nan(summed, reduced), tf.float32)
