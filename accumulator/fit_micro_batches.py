"""`fit`'s batch as the effective batch: one update from micro-batches inside one step.

For a model compiled with `GradientAccumulator(inner, micro_batch_size=b)`, the
`"fit_micro_batches"` hook of `accumulator.hooks` runs `train_step` here in place of
Keras' own. Each batch `fit` draws (n samples) is one update: a `tf.while_loop` over
N = ceil(n / b) micro-batches of b samples (one traced step, one XLA program under
`jit_compile=True`), each its forward and backward pass, its gradient weighed as the
window weighs a micro-batch (`accumulator.weighting`: its loss's denominator D, or 1
for a loss that sums), then the inner optimizer's one update with
sum(D_i g_i) / sum(D_i): the large batch's gradient, so clipping, weight decay, EMA and
schedules act once, as in the large batch, and Keras' steps, `iterations` and
callbacks count updates.

Static shapes: the last micro-batch is filled up to b with the batch's first samples,
and those rows are masked out (a Keras mask on each output, and a zero weight for the
metrics): Keras' losses then divide by the unmasked elements only, so D and the loss
are the real rows' (a zero sample weight alone would not do: "sum_over_batch_size"
counts zero-weighted elements). Dense gradients sum in loop variables; a sparse
gradient (`tf.IndexedSlices`, an `Embedding`'s) keeps each micro-batch's rows, scaled
by its weight, in a `TensorArray`, concatenated after the loop: the large batch's
gradient with its repeated rows, as Keras applies it (the padding's rows are zeros); a
table looked up once per batch (a position table's `arange`, `accumulator.lookups`) has
its rows summed over the micro-batches, as the large batch has them once.

Metrics are updated per micro-batch: Keras releases that apply an output's mask to the
unweighted `metrics=` only with sample weights (3.8) count the padding there.

This slice: Keras 3, one device, no loss scaling, Keras' own `train_step`
(`refuse_unsupported` says so before `fit` trains).
"""

import functools

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import _tf, lookups, seam, weighting
from tfx_gradient_accumulator.accumulator.window import AccumulationWindow


def micro_batch_size_of(model):
    """The `micro_batch_size` of `model`'s `GradientAccumulator`, or None."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, AccumulationWindow):
        return None
    return getattr(optimizer.options, "micro_batch_size", None)


def refuse_unsupported(model):
    """Before `fit` trains: what this first slice of `micro_batch_size` does not do yet."""
    size = micro_batch_size_of(model)
    if size is None:
        return
    owner = seam.train_step_owner()
    if not getattr(owner.train_step, "accumulator_hook", False):
        raise RuntimeError(
            f"micro_batch_size={size} needs accumulator's Keras hooks (ACCUMULATOR_KERAS_HOOKS=0 or "
            "hooks.uninstall() left them out): without them `fit` would train each batch whole.")
    if type(model).train_step is not owner.train_step:
        raise NotImplementedError(
            f"micro_batch_size={size}: the model defines its own `train_step`, which the accumulator "
            "cannot split into micro-batches. Use `accum_steps` (fit at the micro-batch), or Keras' "
            "own train_step.")
    if model.distribute_strategy.num_replicas_in_sync > 1 or tf.distribute.has_strategy():
        raise NotImplementedError(
            f"micro_batch_size={size} trains on one device for now; under a tf.distribute strategy "
            "use `accum_steps` (fit at the micro-batch).")
    if getattr(model.optimizer, "loss_scale_optimizer", None) is not None:
        raise NotImplementedError(
            f"micro_batch_size={size} does not take loss scaling (mixed_float16) yet; use "
            "`accum_steps` (fit at the micro-batch), or float32.")


def _micro_batch(batch, size, count, index):
    """Micro-batch `index` of `batch` ((x, y, sample_weight) of `count` samples): `size`
    rows, the last filled up with the batch's first samples; and which rows are real."""
    positions = tf.range(size) + index * size
    real = positions < count
    rows = tf.math.floormod(positions, count)

    def take(tensor):
        return None if tensor is None else tf.gather(tensor, rows)

    return tf.nest.map_structure(take, batch), real


def _along_rows(real, like):
    """`real` (one per row, float) shaped to broadcast against `like`."""
    rank = like.shape.rank if like.shape.rank is not None else 1
    return tf.reshape(real, [-1] + [1] * max(rank - 1, 0))


def _row_mask(real, output):
    """`real` as a Keras mask of `output`: one per element of its loss, the output's shape
    without its last axis (a sequence's steps; one per row for (rows,) and (rows, k))."""
    rank = output.shape.rank
    if rank is None or rank <= 2:
        return real
    return tf.broadcast_to(tf.reshape(real, [-1] + [1] * (rank - 2)), tf.shape(output)[:-1])


def _masked(y_pred, real):
    """`y_pred` with its filled-up rows masked out (each output's own mask kept)."""
    for output in tf.nest.flatten(y_pred):
        if not isinstance(output, tf.Tensor):
            continue
        mask = seam.keras_mask(output)
        if mask is None:
            mask = _row_mask(real, output)
        else:
            mask = tf.logical_and(tf.cast(mask, tf.bool), tf.cast(_along_rows(tf.cast(real, tf.float32), mask),
                                                                 tf.bool))
        seam.set_keras_mask(output, mask)
    return y_pred


def _metric_weights(sample_weight, real):
    """The sample weights the metrics see: the filled-up rows weigh 0."""
    ones = tf.cast(real, tf.float32)
    if sample_weight is None:
        return ones
    return tf.nest.map_structure(
        lambda w: None if w is None else tf.cast(w, tf.float32) * _along_rows(ones, w), sample_weight)


def _sums_its_samples(model):
    """Whether the loss sums over its samples (each micro-batch weighs 1, as in the window)."""
    reduction = model.optimizer.loss_reduction
    return reduction == "sum" or (reduction == "auto" and weighting.summed_loss(model) is not None)


def _micro_step(model, variables, batch, index, size, count, summed):
    """One micro-batch: (its gradients, its loss, its weight), the metrics updated."""
    (x, y, sample_weight), real = _micro_batch(batch, size, count, index)
    with tf.GradientTape() as tape:
        y_pred = _masked(seam.call_for_training(model, x), real)
        loss = seam.training_loss(model, x, y, y_pred, sample_weight)
    grads = tape.gradient(loss, variables)
    lookups.note_batch_size(size, _tf.current_graph())     # tells a table looked up once per batch
    weight = tf.constant(1.0)
    if not summed:
        denominator = weighting.loss_denominator(model, x, y, y_pred, sample_weight)
        if not isinstance(denominator, str):      # SUMMED_LOSS with loss_reduction="mean": 1 each
            weight = tf.cast(denominator, tf.float32)
    model.compute_metrics(x, y, y_pred, sample_weight=_metric_weights(sample_weight, real))
    return grads, tf.cast(loss, tf.float32), weight


def _gradient_kinds(step):
    """Each gradient as a traced micro-step makes it (None, a tensor, `tf.IndexedSlices`),
    and the positions of those whose rows are a table looked up once per batch (of a static
    row count): traced once in a scratch function, never run, so the loop's variables can
    be made."""
    once = []

    def scratch():
        grads = step(0)[0]
        once.extend(k for k, g in enumerate(grads) if isinstance(g, tf.IndexedSlices)
                    and g.values.shape.is_fully_defined()
                    and lookups.kind_of_rows(g.indices) == lookups.ONCE_PER_BATCH)
        return grads

    traced = tf.function(scratch, autograph=False).get_concrete_function()
    return list(traced.structured_outputs), once


def _loop(step, kinds, once, count):
    """The micro-batches in a `tf.while_loop`: (dense sums, sparse rows, loss sum, weight sum).
    Rows looked up once per batch (`once`) are summed, as the large batch has them once; other
    rows are kept, one array per gradient, concatenated."""
    dense_at = [k for k, kind in enumerate(kinds) if kind is not None and not isinstance(kind, tf.IndexedSlices)]
    dense_at += once
    sparse_at = [k for k, kind in enumerate(kinds) if isinstance(kind, tf.IndexedSlices) and k not in once]
    micro_batches = (count + step.keywords["size"] - 1) // step.keywords["size"]

    def arrays(attribute):
        return [tf.TensorArray(getattr(kinds[k], attribute).dtype, size=micro_batches,
                               element_shape=getattr(kinds[k], attribute).shape) for k in sparse_at]

    def summed(grad):
        return grad.values if isinstance(grad, tf.IndexedSlices) else grad

    def body(index, loss_sum, weight_sum, dense, values, indices, once_indices):
        grads, loss, weight = step(index=index)
        dense = [total + tf.cast(weight, total.dtype) * summed(grads[k]) for total, k in zip(dense, dense_at)]
        once_indices = [grads[k].indices for k in once]
        values = [array.write(index, grads[k].values * tf.cast(weight, grads[k].values.dtype))
                  for array, k in zip(values, sparse_at)]
        indices = [array.write(index, grads[k].indices) for array, k in zip(indices, sparse_at)]
        return index + 1, loss_sum + weight * loss, weight_sum + weight, dense, values, indices, once_indices

    def zeros(k):
        if k in once:
            return tf.zeros(kinds[k].values.shape, kinds[k].values.dtype)
        return tf.zeros(step.args[1][k].shape, kinds[k].dtype)

    once_ids = [tf.zeros(kinds[k].indices.shape, kinds[k].indices.dtype) for k in once]
    start = (tf.constant(0), tf.constant(0.0), tf.constant(0.0), [zeros(k) for k in dense_at],
             arrays("values"), arrays("indices"), once_ids)
    _, loss_sum, weight_sum, dense, values, indices, once_indices = tf.while_loop(
        lambda index, *_: index < micro_batches, body, start, parallel_iterations=1,
        maximum_iterations=micro_batches)
    sums = dict(zip(dense_at, dense))
    rows = {k: (sums.pop(k), ids) for k, ids in zip(once, once_indices)}
    rows.update({k: (v.concat(), i.concat()) for k, v, i in zip(sparse_at, values, indices)})
    return sums, rows, loss_sum, weight_sum


@tf.autograph.experimental.do_not_convert
def train_step(model, data):
    """Keras' `train_step` for a model whose optimizer has `micro_batch_size`: one update
    from the batch, trained in micro-batches (the module's docstring)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    count = first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]
    variables = list(model.trainable_variables)
    summed = _sums_its_samples(model)
    step = functools.partial(_micro_step, model, variables, (x, y, sample_weight),
                             size=model.optimizer.micro_batch_size, count=count, summed=summed)
    kinds, once = _gradient_kinds(step)
    dense, sparse, loss_sum, weight_sum = _loop(step, kinds, once, count)
    divisor = tf.constant(1.0) if summed else weight_sum
    grads = []
    for k, (kind, variable) in enumerate(zip(kinds, variables)):
        if k in dense:
            grads.append(tf.math.divide_no_nan(dense[k], tf.cast(divisor, dense[k].dtype)))
        elif k in sparse:
            rows, indices = sparse[k]
            grads.append(tf.IndexedSlices(tf.math.divide_no_nan(rows, tf.cast(divisor, rows.dtype)),
                                          indices, tf.shape(variable, out_type=indices.dtype)))
        else:
            grads.append(None)
    loss = tf.math.divide_no_nan(loss_sum, divisor)
    seam.loss_tracker(model).update_state(loss, sample_weight=count)
    model.optimizer.apply_gradients(zip(grads, variables))
    return model.get_metrics_result()
