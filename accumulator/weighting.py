"""How much each micro-batch weighs in its window, so the window is one exact batch.

A micro-batch's loss is S_k / D_k: a sum S_k over its samples (times sample
weights, over unmasked steps) divided by the loss's own denominator D_k: its
element count (`sum_over_batch_size`), its unmasked steps (masked sequences), or
its summed sample weight (`mean_with_sample_weight`). The large batch's loss is
sum(S_k) / sum(D_k), so its gradient is sum(D_k * g_k) / sum(D_k): each micro-batch
weighs its denominator, not 1. With equal micro-batches the two agree; with a
short last batch, sample weights or masks, only the weighted one is exact.

In `fit`, `GradientAccumulator` finds D_k itself, by evaluating the compiled
loss's reduction on ones for the batch at hand (see `loss_denominator`). In a
custom loop, pass it: `optimizer.apply(grads, vars, micro_batch_weight=D_k)`.
"""

import inspect

import keras
from keras import ops
from keras.src.backend.common.masking import get_keras_mask
from keras.src.losses.loss import reduce_weighted_values


def _resolve_path(path, structure):
    if not keras.tree.is_nested(structure):
        return structure
    for key in path:
        structure = structure[key]
    return structure


def _batch_size(x):
    first = next(t for t in keras.tree.flatten(x) if t is not None)
    return ops.cast(ops.shape(first)[0], "float32")


def loss_denominator(model, x, y, y_pred, sample_weight):
    """D of the model's compiled loss on this batch (of its first output's loss)."""
    compile_loss = getattr(model, "_compile_loss", None)
    flat = getattr(compile_loss, "_flat_losses", None)
    if not flat or y is None:
        return _batch_size(x)
    path, loss_fn, _, _ = flat[0]
    reduction = getattr(loss_fn, "reduction", "sum_over_batch_size")
    if reduction in (None, "none", "sum"):
        return ops.cast(1.0, "float32")
    y_t, y_p = _resolve_path(path, y), _resolve_path(path, y_pred)
    weight = _resolve_path(path, sample_weight)
    in_mask = get_keras_mask(y_p)
    values = loss_fn.call(
        ops.convert_to_tensor(y_t, dtype=loss_fn.dtype), ops.convert_to_tensor(y_p, dtype=loss_fn.dtype)
    )
    out_mask = get_keras_mask(values)
    mask = in_mask if out_mask is None else (out_mask if in_mask is None else in_mask & out_mask)
    ones = ops.ones_like(values)
    reduced = reduce_weighted_values(ones, weight, mask, reduction, dtype="float32")
    summed = reduce_weighted_values(ones, weight, mask, "sum", dtype="float32")
    return ops.cast(ops.divide_no_nan(summed, reduced), "float32")


def fit_micro_batch_weight():
    """Inside a `train_step` (Keras' or one like it): D of its batch; else None.

    Looks up the caller frames for the `train_step` that computed the
    gradients, whose locals hold the model and the batch. Runs at trace time
    under `tf.function`, so it costs nothing per step there.
    """
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code.co_name == "train_step":
                local = frame.f_locals
                model = local.get("self")
                if isinstance(model, keras.Model) and "y_pred" in local:
                    return loss_denominator(
                        model, local.get("x"), local.get("y"), local["y_pred"], local.get("sample_weight")
                    )
            frame = frame.f_back
        return None
    finally:
        del frame
