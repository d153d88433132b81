"""`fit`'s batch as the effective batch under Keras 2: one update from micro-batches inside one step.

The Keras 2 side of `accumulator.batch.fit_micro_batches` (read its docstring first): for a Keras 2
model (`tf_keras`, or TF 2.15's `keras`) compiled with `GradientAccumulator(inner,
micro_batch_size=b)`, the `"keras2_fit_micro_batches"` hook of `accumulator.hooks` runs
`train_step` here in place of Keras 2's own. Each batch `fit` draws (n samples) is one
update: the Keras-agnostic `tf.while_loop` of `fit_micro_batches.micro_batch_loop` over
ceil(n / b) micro-batches of b samples, each weighed by its loss's denominator, then the
inner optimizer's one update with the large batch's gradient.

What Keras 2 does differently, and how this step keeps it exact:

- The padding. The last micro-batch is filled up to b with the batch's first samples and
  those rows are masked out through the outputs' Keras 2 mask (`_keras_mask`, which Keras 2's
  compiled losses and metrics read, as Keras 3's read theirs): its "sum_over_batch_size"
  divides by the unmasked elements (`losses_utils.apply_valid_mask`), so each micro-batch's
  loss and weight D (`weighting.loss_denominator`: Keras 2 counts the unmasked elements,
  whatever the sample weights) are its real rows'. A zero sample weight alone would not do:
  Keras 2 divides by the elements, zero-weighted ones included.
- The logged `loss`. Keras 2's compiled loss updates its `loss` metric each time it is
  called, weighed by the rows it saw (the padding too); the step puts that metric back as
  it was before the micro-batches and updates it once with the large batch's loss
  (sum(D_i L_i) / sum(D_i), regularization included) over the n samples, as Keras 2's own
  step logs it. A multi-output model's per-output losses are weighed again by each
  micro-batch's real rows (exact for a loss over rows; with an output's own mask, a mean
  of the micro-batches').
- Embeddings: the rows of each micro-batch are kept (one per lookup, as the large batch's
  `tf.IndexedSlices`, the padding's rows zeros) and Keras 2's optimizers merge repeated rows
  themselves, as they do for the large batch.
- Replicas (MirroredStrategy, MultiWorkerMirroredStrategy), as under Keras 3: b is global,
  each replica trains micro-batches of b / R of its share, the loop's sums and weights are
  all-reduced once (`fit_micro_batches.sum_over_replicas`, rows per sample gathered in
  replica order), and the update is R sum(D_i g_i) / sum(D_i): Keras 2's compiled loss
  divides each replica's mean loss and its regularization by R
  (`losses_utils.scale_loss_for_distribution`), not a "sum" loss. The inner optimizer
  applies that global gradient once in each replica with its own aggregation skipped
  (Keras 2's public `skip_gradients_aggregation=True`, as the window's close hands it
  over): its clipping sees the large batch's gradient. The logged `loss` is one device's:
  each replica's loss metric gets the global loss weighed by its rows.
- Loss scaling (mixed_float16): `accumulator.keras2.micro_batch_scaling`.

Keras 2's own `train_step` only (`refuse_unsupported` says so before `fit` trains), and no
XLA under several replicas.
"""

import functools

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, flavours, seam
from tfx_gradient_accumulator.accumulator.batch import fit_micro_batches
from tfx_gradient_accumulator.accumulator.keras2 import micro_batch_scaling
from tfx_gradient_accumulator.accumulator.rows import lookups
from tfx_gradient_accumulator.accumulator.window import weighting


def refuse_unsupported(model):
    """Before `fit` trains a Keras 2 model with `micro_batch_size`: compile's LossScaleOptimizer
    taken inside the accumulator (`micro_batch_scaling.take_loss_scaling_inside`), then what
    the step does not do refused (no hooks, a model's own `train_step`, XLA under several
    replicas) and a micro-batch the replicas cannot share."""
    micro_batch_scaling.take_loss_scaling_inside(model)
    fit_micro_batches.refuse_what_the_step_cannot_take(model, flavours.keras_package_of(model).Model)


def _micro_step(model, variables, batch, index, size, count, summed, loss_scale=None, scaled_rows=None):
    """One micro-batch: (its gradients, its loss, its weight), the metrics updated.

    Under loss scaling (`loss_scale`, the update's S) the gradients are taken of the loss
    times S times the micro-batch's share of the batch's samples (`_share`), so each
    sample's float16 gradient is scaled as in the large batch; they come back at S."""
    (x, y, sample_weight), real = fit_micro_batches.micro_batch(batch, size, count, index)
    trackers = _output_loss_metrics(model)
    before = [tf.identity(tracker.total) for tracker in trackers]
    with tf.GradientTape() as tape:
        y_pred = fit_micro_batches.masked(model(x, training=True), real, seam.keras2_mask, seam.set_keras2_mask)
        loss = model.compute_loss(x, y, y_pred, sample_weight)
        if loss_scale is not None:
            share = _share(real, count if scaled_rows is None else scaled_rows, summed)
            scaled = tf.cast(loss, tf.float32) * (loss_scale * share)
    _weigh_by_real_rows(trackers, before, real, loss)
    grads = tape.gradient(loss if loss_scale is None else scaled, variables)
    if loss_scale is not None:
        grads = [_tf.scaled_by(g, 1.0 / share) for g in grads]
    lookups.note_batch_size(size, _tf.current_graph())     # tells a table looked up once per batch
    weight = tf.constant(1.0)
    if not summed:
        denominator = weighting.loss_denominator(model, x, y, y_pred, sample_weight)
        if not isinstance(denominator, str):      # SUMMED_LOSS with loss_reduction="mean": 1 each
            weight = tf.cast(denominator, tf.float32)
    _update_metrics(model, x, y, y_pred, fit_micro_batches.metric_weights(sample_weight, real))
    return grads, tf.cast(loss, tf.float32), weight


def _share(real, rows, summed):
    """What a micro-batch's loss is scaled by beside S: its real rows over `rows` (the
    batch's; under R replicas the global batch's over R, as Keras 2 divides each replica's
    mean loss by R), so each sample's gradient carries S / n as in the large batch of n
    (also where the replicas' shares are uneven); 1 for a loss that sums (S a sample there)."""
    if summed:
        return tf.constant(1.0)
    return tf.reduce_sum(tf.cast(real, tf.float32)) / tf.cast(rows, tf.float32)


def _scaled_rows(context, replica_count, count, loss_scale):
    """The rows `_share` divides by: None (the replica's own) on one device or without loss
    scaling; under replicas the global batch's rows over R (one scalar all-reduce)."""
    if context is None or loss_scale is None:
        return None
    return context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(count, tf.float32)) / float(replica_count)


def _update_metrics(model, x, y, y_pred, sample_weight):
    """The micro-batch's metrics updated. Keras 2's own `compute_metrics` also reads every
    metric's result, which under a strategy is a `merge_call`, refused inside the traced
    micro-step: its update alone then (the step reads the results after the loop); a
    model's own `compute_metrics` is called as it is."""
    if type(model).compute_metrics is flavours.keras_package_of(model).Model.compute_metrics:
        model.compiled_metrics.update_state(y, y_pred, sample_weight)
    else:
        model.compute_metrics(x, y, y_pred, sample_weight)


def _output_loss_metrics(model):
    """The per-output loss metrics of a Keras 2 model with several outputs (built), else []."""
    compiled = getattr(model, "compiled_loss", None)
    return list(getattr(compiled, "metrics", None) or [])[1:]


def _weigh_by_real_rows(trackers, before, real, loss):
    """Each output's loss metric as the large batch's: Keras 2 adds an output's loss L
    weighed by the micro-batch's rows b, padding included (`before`: each metric's total
    before); weighed again by its real rows r, over the micro-batches sum(r_i L_i) / sum(r_i)
    is the large batch's L (exact for an output's loss over its rows; with a mask of its
    own, a mean of its micro-batches')."""
    if not trackers:
        return
    size = tf.cast(tf.size(real), tf.float32)
    rows = tf.reduce_sum(tf.cast(real, tf.float32))
    with tf.control_dependencies([loss]):
        for tracker, total in zip(trackers, before):
            added = tf.identity(tracker.total) - total
            tracker.total.assign_add(added * tf.cast(rows / size - 1.0, added.dtype))
            tracker.count.assign_add(tf.cast(rows - size, tracker.count.dtype))


def _build(model, x):
    """Builds a model whose variables its first call makes (a subclassed one, which Keras 2's
    `fit` builds in its first step): its forward pass traced in a scratch function, never
    run, so the step knows the variables before its micro-batches take their gradients."""
    if not model.built:
        tf.function(lambda: model(x, training=False), autograph=False).get_concrete_function()


def _loss_metric(model):
    """The metric behind the `loss` Keras 2's compiled loss logs (built by then), or None
    (a `compute_loss` of the model's own that does not call it)."""
    compiled = getattr(model, "compiled_loss", None)
    metrics = list(getattr(compiled, "metrics", None) or [])
    return metrics[0] if metrics else None


def _log_the_updates_loss(loss_metric, before, loss, count):
    """The `loss` metric as Keras 2's large batch on one device logs it: put back as it was
    before the micro-batches (`before`), then updated once with the update's loss over this
    replica's `count` rows (`loss`: the global loss, alike in each replica)."""
    if loss_metric is None:
        return
    for variable, value in zip(loss_metric.variables, before):
        variable.assign(value)
    loss_metric.update_state(loss, sample_weight=count)


def _apply_once(optimizer, context, grads, variables):
    """The inner optimizer's one update with the reduced `grads`. Under several replicas,
    in each replica with the inner optimizer's own aggregation skipped (the gradient is
    global already: its clipping acts on the large batch's gradient)."""
    if context is None:
        optimizer.apply_gradients(zip(grads, variables))
        return
    with tf.init_scope():
        optimizer.build(variables)
    optimizer._hand_to_updater(grads, variables, reduced=True)


@tf.autograph.experimental.do_not_convert
def train_step(model, data):
    """Keras 2's `train_step` for a model whose optimizer has `micro_batch_size`: one update
    from the batch, trained in micro-batches (the module's docstring)."""
    keras2 = flavours.keras_package_of(model)
    x, y, sample_weight = keras2.utils.unpack_x_y_sample_weight(data)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    count = first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]
    optimizer = model.optimizer
    context, replica_count = fit_micro_batches.replica_context()
    size = optimizer.micro_batch_size // replica_count
    _build(model, x)
    variables = list(model.trainable_variables)
    summed = fit_micro_batches.sums_its_samples(model)
    loss_scale = micro_batch_scaling.loss_scale(optimizer)
    step = functools.partial(_micro_step, model, variables, (x, y, sample_weight), size=size, count=count,
                             summed=summed, loss_scale=loss_scale,
                             scaled_rows=_scaled_rows(context, replica_count, count, loss_scale))
    step, kinds, once = fit_micro_batches.traced_micro_step(step)
    loss_metric = _loss_metric(model)
    before = [tf.identity(v) for v in loss_metric.variables] if loss_metric is not None else []
    dense, sparse, loss_sum, weight_sum = fit_micro_batches.sum_over_replicas(
        context, fit_micro_batches.micro_batch_loop(step, kinds, once, count, size, variables), once, variables)
    # Keras 2 divides a mean loss by R in each replica's compiled loss (not a sum): R undoes it.
    factor = tf.constant(1.0) if summed else tf.math.divide_no_nan(tf.constant(float(replica_count)), weight_sum)
    _log_the_updates_loss(loss_metric, before, loss_sum * factor, count)
    # Rows as the large batch has them, one per lookup: Keras 2's optimizers merge them.
    grads = fit_micro_batches.update_gradients(kinds, variables, dense, sparse, factor)
    if loss_scale is not None:
        grads = micro_batch_scaling.unscaled(model, optimizer, grads, variables)
    _apply_once(optimizer, context, grads, variables)
    return model.get_metrics_result()
