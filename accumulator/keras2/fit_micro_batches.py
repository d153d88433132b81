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

One device, float32, Keras 2's own `train_step` (`refuse_unsupported` says so before `fit`
trains).
"""

import functools

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, flavours, seam
from tfx_gradient_accumulator.accumulator.batch import fit_micro_batches
from tfx_gradient_accumulator.accumulator.rows import lookups
from tfx_gradient_accumulator.accumulator.window import weighting


def refuse_unsupported(model):
    """Before `fit` trains a Keras 2 model with `micro_batch_size`: what it does not do yet."""
    size = fit_micro_batches.micro_batch_size_of(model)
    if size is None:
        return
    owner = flavours.keras_package_of(model).Model
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
            f"micro_batch_size={size} trains a Keras 2 model on one device for now; under a "
            "tf.distribute strategy use `accum_steps` (fit at the micro-batch).")
    if getattr(model.optimizer, "loss_scale_optimizer", None) is not None:
        raise NotImplementedError(
            f"micro_batch_size={size} does not take loss scaling (mixed_float16) under Keras 2 yet; "
            "use `accum_steps` (fit at the micro-batch), or float32.")


def _micro_step(model, variables, batch, index, size, count, summed):
    """One micro-batch: (its gradients, its loss, its weight), the metrics updated."""
    (x, y, sample_weight), real = fit_micro_batches.micro_batch(batch, size, count, index)
    trackers = _output_loss_metrics(model)
    before = [tf.identity(tracker.total) for tracker in trackers]
    with tf.GradientTape() as tape:
        y_pred = fit_micro_batches.masked(model(x, training=True), real, seam.keras2_mask, seam.set_keras2_mask)
        loss = model.compute_loss(x, y, y_pred, sample_weight)
    _weigh_by_real_rows(trackers, before, real, loss)
    grads = tape.gradient(loss, variables)
    lookups.note_batch_size(size, _tf.current_graph())     # tells a table looked up once per batch
    weight = tf.constant(1.0)
    if not summed:
        denominator = weighting.loss_denominator(model, x, y, y_pred, sample_weight)
        if not isinstance(denominator, str):      # SUMMED_LOSS with loss_reduction="mean": 1 each
            weight = tf.cast(denominator, tf.float32)
    model.compute_metrics(x, y, y_pred, fit_micro_batches.metric_weights(sample_weight, real))
    return grads, tf.cast(loss, tf.float32), weight


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


@tf.autograph.experimental.do_not_convert
def train_step(model, data):
    """Keras 2's `train_step` for a model whose optimizer has `micro_batch_size`: one update
    from the batch, trained in micro-batches (the module's docstring)."""
    keras2 = flavours.keras_package_of(model)
    x, y, sample_weight = keras2.utils.unpack_x_y_sample_weight(data)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    count = first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]
    size = model.optimizer.micro_batch_size
    _build(model, x)
    variables = list(model.trainable_variables)
    summed = fit_micro_batches.sums_its_samples(model)
    step = functools.partial(_micro_step, model, variables, (x, y, sample_weight),
                             size=size, count=count, summed=summed)
    step, kinds, once = fit_micro_batches.traced_micro_step(step)
    loss_metric = _loss_metric(model)
    before = [tf.identity(v) for v in loss_metric.variables] if loss_metric is not None else []
    dense, sparse, loss_sum, weight_sum = fit_micro_batches.micro_batch_loop(step, kinds, once, count, size,
                                                                             variables)
    factor = tf.constant(1.0) if summed else tf.math.divide_no_nan(tf.constant(1.0), weight_sum)
    if loss_metric is not None:
        for variable, value in zip(loss_metric.variables, before):
            variable.assign(value)
        loss_metric.update_state(loss_sum * factor, sample_weight=count)
    # Rows as the large batch has them, one per lookup: Keras 2's optimizers merge them.
    grads = fit_micro_batches.update_gradients(kinds, variables, dense, sparse, factor)
    model.optimizer.apply_gradients(zip(grads, variables))
    return model.get_metrics_result()
