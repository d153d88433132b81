"""How much each micro-batch weighs in its window, so the window is one exact batch.

A micro-batch's loss is S_k / D_k: a sum S_k over its samples (times sample
weights, over unmasked steps) divided by the loss's own denominator D_k: its
element count (`sum_over_batch_size`), its unmasked steps (masked sequences), or
its summed sample weight (`mean_with_sample_weight`). The large batch's loss is
sum(S_k) / sum(D_k), so its gradient is sum(D_k * g_k) / sum(D_k): each micro-batch
weighs its denominator, not 1. With equal micro-batches the two agree; with a
short last batch, sample weights or masks, only the weighted one is exact.

In `fit`, D_k comes through a public seam: Keras' train step calls
`Model.compute_loss(x, y, y_pred, sample_weight)` with the batch and the
predictions, and the hook `import accumulator` installs there
(`accumulator.seam`) hands them to `note_batch`, which evaluates the compiled
loss's own reduction on ones (`loss_denominator`, public Keras API only). The
accumulator's `apply` then takes the note (`take_noted_weight`). A model whose
own `train_step` calls `self.compute_loss(...)` is weighed the same way; one
that computes its loss without it (or overrides `compute_loss` without calling
`super()`) weighs every micro-batch 1, as does a custom loop that passes no
`micro_batch_weight`. In a custom loop, pass it:
`optimizer.apply(grads, vars, micro_batch_weight=D_k)`.
"""

import threading

import keras
import tensorflow as tf
from keras import ops


class _Notes(threading.local):
    # Per thread: MirroredStrategy traces each replica's step in its own thread.
    def __init__(self):
        self.graph = None
        self.weight = None


_notes = _Notes()


def _current_graph():
    return None if tf.executing_eagerly() else tf.compat.v1.get_default_graph()


def note_batch(model, x, y, y_pred, sample_weight):
    """Called by the `compute_loss` hook on training batches: notes D of the batch.

    Only for models compiled with an accumulating `GradientAccumulator`; under
    `tf.function` it runs when the step is traced, so it costs nothing per step.
    """
    from accumulator.optimizer import GradientAccumulator

    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, GradientAccumulator) or optimizer.is_passthrough:
        return
    _notes.graph = _current_graph()
    _notes.weight = loss_denominator(model, x, y, y_pred, sample_weight)


def take_noted_weight():
    """D noted for the batch whose gradients are being applied (in this thread and graph), or None."""
    weight, graph = _notes.weight, _notes.graph
    _notes.weight = _notes.graph = None
    if weight is None or graph is not _current_graph():
        return None
    return weight


def _batch_size(x):
    flat = [t for t in tf.nest.flatten(x) if t is not None]
    if not flat:
        return ops.cast(1.0, "float32")
    return ops.cast(ops.shape(flat[0])[0], "float32")


def _first_output_loss(model, y, y_pred, sample_weight):
    """(loss, y, y_pred, sample_weight) of the model's first compiled loss, or None."""
    loss = getattr(model, "loss", None)
    if loss is None or y is None:
        return None
    if isinstance(loss, dict):
        names = [n for n in (getattr(model, "output_names", None) or list(loss)) if loss.get(n) is not None]
        if not names:
            return None
        key, index = names[0], list(getattr(model, "output_names", None) or list(loss)).index(names[0])
    elif isinstance(loss, (list, tuple)):
        indices = [i for i, item in enumerate(loss) if item is not None]
        if not indices:
            return None
        key, index = None, indices[0]
    else:
        return loss, y, y_pred, sample_weight

    def pick(structure):
        if isinstance(structure, dict):
            return structure[key] if key in structure else list(structure.values())[index]
        if isinstance(structure, (list, tuple)):
            return structure[index]
        return structure

    return loss[key if key is not None else index], pick(y), pick(y_pred), pick(sample_weight)


class _Ones(keras.losses.Loss):
    """A loss whose values are ones shaped like `values`: its reduction is Keras' own."""

    def __init__(self, values, reduction):
        super().__init__(name="accumulator_denominator", reduction=reduction)
        self._values = values

    def call(self, y_true, y_pred):
        return ops.ones_like(self._values)


def loss_denominator(model, x, y, y_pred, sample_weight):
    """D of the model's compiled loss on this batch (of its first output's loss)."""
    found = _first_output_loss(model, y, y_pred, sample_weight)
    if found is None:
        return _batch_size(x)
    loss, y_t, y_p, weight = found
    loss = keras.losses.get(loss)
    reduction = getattr(loss, "reduction", "sum_over_batch_size")
    if reduction in (None, "none", "sum"):
        return ops.cast(1.0, "float32")
    compute = loss.call if isinstance(loss, keras.losses.Loss) else loss
    y_p_tensor = ops.convert_to_tensor(y_p)
    values = compute(ops.cast(ops.convert_to_tensor(y_t), y_p_tensor.dtype), y_p_tensor)
    reduced = _Ones(values, reduction)(y_t, y_p, weight)
    summed = _Ones(values, "sum")(y_t, y_p, weight)
    return ops.cast(ops.divide_no_nan(summed, reduced), "float32")
