"""`fit`'s batch as the effective batch: one update from micro-batches inside one step.

For a model compiled with `GradientAccumulator(inner, micro_batch_size=b)`, the
`"fit_micro_batches"` hook of `accumulator.hooks` runs `train_step` here in place of
Keras' own. Each batch `fit` draws (n samples) is one update: a `tf.while_loop` over
N = ceil(n / b) micro-batches of b samples (one traced step, one XLA program under
`jit_compile=True`), each its forward and backward pass, its gradient weighed as the
window weighs a micro-batch (`accumulator.window.weighting`: its loss's denominator D, or 1
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
table looked up once per batch (a position table's `arange`, `accumulator.rows.lookups`) has
its rows summed over the micro-batches, as the large batch has them once.

Metrics are updated per micro-batch: Keras releases that apply an output's mask to the
unweighted `metrics=` only with sample weights (3.8) count the padding there. Each
output's loss tracker (`<output>_loss`), which Keras' loss weighs by the micro-batch's
static rows, is weighed again by its real rows (`_weigh_by_real_rows`).

Replicas (MirroredStrategy, MultiWorkerMirroredStrategy): `micro_batch_size` is global,
each replica's loop runs micro-batches of b / R of its share (`refuse_unsupported`
refuses a b the replicas cannot share, and XLA under several replicas). The loop's sums
and weights are added over the replicas in one all-reduce, per-sample rows gathered in
replica order (`sum_over_replicas`), and the update is R sum(D_i g_i) / sum(D_i) over
every replica's micro-batches (Keras divides each replica's mean loss by R): exact where
the replicas' shares are uneven. The inner optimizer applies it once from cross-replica
context with its own all-reduce off (`_apply_once`), so clipping sees the global gradient.
The step is two halves, `replica_sums` (the loop, no collective) and `reduce_and_update`:
`micro_batch_size="auto"` under a strategy runs them as two compiled functions
(`accumulator.batch.fit_auto_distributed`), so that no out-of-memory error comes while a
collective is in flight.

Loss scaling (mixed_float16, `compile`'s LossScaleOptimizer taken inside the
accumulator): each micro-batch's loss scaled by S times its share of the batch's samples
(each sample's float16 gradient at the large batch's scale), the gradients brought back
to S, one unscaling and finiteness check by the LossScaleOptimizer; a gradient beyond
float16's range in a float16 layer is made NaN first (`_float16_overflow_as_nan`), as the
large batch's float16 gradient would overflow. `merge_duplicate_rows` merges the rows
after the sums (densely under XLA, which cannot merge rows).

The loop pieces (`micro_batch`, `traced_micro_step`, `micro_batch_loop`,
`sum_over_replicas`, `update_gradients`) and the padding's mask and metric weights
(`masked`, `metric_weights`) are plain TensorFlow, shared with Keras 2.
Keras' own `train_step` only: a model's own is refused before `fit` trains.
"""

import functools

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, loss_scaling, micro_batch_notes, replicas, seam
from tfx_gradient_accumulator.accumulator.rows import lookups, window_rows
from tfx_gradient_accumulator.accumulator.window import weighting
from tfx_gradient_accumulator.accumulator.core.replicas import NO_MERGE_CALL_MESSAGE
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow


def micro_batch_size_of(model):
    """The `micro_batch_size` of `model`'s `GradientAccumulator`, or None."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, AccumulationWindow):
        return None
    return getattr(optimizer.options, "micro_batch_size", None)


def refuse_unsupported(model):
    """Before `fit` trains: what `micro_batch_size` cannot do (`refuse_what_the_step_cannot_take`)
    and a synchronized `BatchNormalization` under several replicas."""
    size = refuse_what_the_step_cannot_take(model, seam.train_step_owner())
    if size is None:
        return
    replica_count = model.distribute_strategy.num_replicas_in_sync
    synchronized = [layer.name for layer in seam.flatten_layers(model)
                    if isinstance(layer, keras.layers.BatchNormalization) and getattr(layer, "synchronized", False)]
    if replica_count > 1 and synchronized:
        raise NotImplementedError(
            f"{', '.join(synchronized)}: synchronized=True under micro_batch_size with {replica_count} replicas "
            "would all-reduce each micro-batch's moments inside the step's loop, which a strategy's replica "
            "context cannot do. Pass synchronized=False, or train with accum_steps.")


def refuse_what_the_step_cannot_take(model, owner):
    """Before `fit` trains, for both Keras (`owner`: the class whose `train_step` the hook
    wraps): the step without Keras' hooks, a model's own `train_step`, a micro-batch the
    replicas cannot share (naming a multiple that works), XLA under several replicas.
    Returns the `micro_batch_size` (None: the model has none, nothing to refuse)."""
    size = micro_batch_size_of(model)
    if size is None:
        return None
    if not getattr(owner.train_step, "accumulator_hook", False):
        raise RuntimeError(
            f"micro_batch_size={size} needs accumulator's Keras hooks (ACCUMULATOR_KERAS_HOOKS=0 or "
            "hooks.uninstall() left them out): without them `fit` would train each batch whole.")
    if type(model).train_step is not owner.train_step:
        raise NotImplementedError(
            f"micro_batch_size={size}: the model defines its own `train_step`, which the accumulator "
            "cannot split into micro-batches. Use `accum_steps` (fit at the micro-batch), or Keras' "
            "own train_step.")
    replica_count = model.distribute_strategy.num_replicas_in_sync
    if isinstance(size, int) and size % replica_count:
        raise ValueError(
            f"micro_batch_size={size} is not divisible by the {replica_count} replicas in sync: it is global, "
            f"as fit's batch_size is, and each replica trains micro-batches of micro_batch_size / "
            f"{replica_count}. Pass a multiple of {replica_count} "
            f"(for example {max(replica_count, size - size % replica_count)}).")
    if replica_count > 1 and getattr(model, "jit_compile", False) is True:
        raise NotImplementedError(NO_MERGE_CALL_MESSAGE)
    return size


def build_before_tracing(model):
    """Before `fit` traces its step: the optimizer built for a built model's variables, in the
    model's strategy's scope, as Keras builds it itself under a strategy (`_symbolic_build`).
    Without a strategy Keras leaves the build to the step's first trace, and a `tf.function`
    whose first trace makes variables is traced again: the whole step (every micro-step's
    forward and backward pass, the loop, the update) twice, most of a first epoch under
    `jit_compile=True`. Built here, it is traced once. A model not built yet (a subclassed
    one, built by its first step) is left to the trace."""
    optimizer = getattr(model, "optimizer", None)
    if micro_batch_size_of(model) is None or optimizer.built or not model.built:
        return
    if not all(layer.built for layer in seam.flatten_layers(model)):
        return
    with model.distribute_strategy.scope():
        optimizer.build(model.trainable_variables)


def micro_batch(batch, size, count, index):
    """Micro-batch `index` of `batch` (any nest of tensors, None allowed, of `count` rows):
    `size` rows, the last filled up with the batch's first samples (static shapes, so a
    loop body and an XLA program keep one shape); and which rows are real (bool, `size`).
    Plain TensorFlow, for both Keras."""
    positions = tf.range(size) + index * size
    real = positions < count
    rows = tf.math.floormod(positions, count)

    def take(tensor):
        return None if tensor is None else tf.gather(tensor, rows)

    return tf.nest.map_structure(take, batch), real


def along_rows(values, like):
    """`values` (one per row) shaped to broadcast against `like`."""
    rank = like.shape.rank if like.shape.rank is not None else 1
    return tf.reshape(values, [-1] + [1] * max(rank - 1, 0))


def row_mask(real, output):
    """`real` as a Keras mask of `output`: one per element of its loss, the output's shape
    without its last axis (a sequence's steps; one per row for (rows,) and (rows, k))."""
    rank = output.shape.rank
    if rank is None or rank <= 2:
        return real
    return tf.broadcast_to(tf.reshape(real, [-1] + [1] * (rank - 2)), tf.shape(output)[:-1])


def masked(y_pred, real, get_mask=seam.keras_mask, set_mask=seam.set_keras_mask):
    """`y_pred` with its filled-up rows masked out (each output's own mask kept), through the
    Keras mask that `get_mask` reads and `set_mask` writes (Keras 2's: `seam.keras2_mask`)."""
    for output in tf.nest.flatten(y_pred):
        if not isinstance(output, tf.Tensor):
            continue
        mask = get_mask(output)
        if mask is None:
            mask = row_mask(real, output)
        else:
            mask = tf.logical_and(tf.cast(mask, tf.bool), along_rows(real, mask))
        set_mask(output, mask)
    return y_pred


def metric_weights(sample_weight, real):
    """The sample weights the metrics see: the filled-up rows weigh 0."""
    ones = tf.cast(real, tf.float32)
    if sample_weight is None:
        return ones
    return tf.nest.map_structure(
        lambda w: None if w is None else tf.cast(w, tf.float32) * along_rows(ones, w), sample_weight)


def sums_its_samples(model):
    """Whether the loss sums over its samples (each micro-batch weighs 1, as in the window)."""
    reduction = model.optimizer.loss_reduction
    return reduction == "sum" or (reduction == "auto" and weighting.summed_loss(model) is not None)


def _micro_step(model, variables, batch, index, size, count, summed, loss_scale=None):
    """One micro-batch: (its gradients, its loss, its weight), the metrics updated.

    Under loss scaling (`loss_scale`, the scale S of this update) the loss the gradients
    are taken of is scaled by S times the micro-batch's share of the batch's samples, so
    each sample's float16 gradient is scaled as in the large batch (S over the batch's
    samples, not over the micro-batch's); the gradients come back at S."""
    (x, y, sample_weight), real = micro_batch(batch, size, count, index)
    micro_batch_notes.note_real_rows(real)
    trackers = seam.output_loss_trackers(model)
    before = [tf.identity(tracker.total) for tracker in trackers]
    with tf.GradientTape() as tape:
        y_pred = masked(seam.call_for_training(model, x), real)
        loss = seam.training_loss(model, x, y, y_pred, sample_weight)
        if loss_scale is not None:
            share = tf.reduce_sum(tf.cast(real, tf.float32)) / tf.cast(count, tf.float32)
            scaled = tf.cast(loss, tf.float32) * (loss_scale * share)
    _weigh_by_real_rows(trackers, before, real, loss, count)
    grads = tape.gradient(loss if loss_scale is None else scaled, variables)
    if loss_scale is not None:
        grads = [_tf.scaled_by(g, 1.0 / share) for g in grads]
    lookups.note_batch_size(size, _tf.current_graph())     # tells a table looked up once per batch
    weight = tf.constant(1.0)
    if not summed:
        denominator = weighting.loss_denominator(model, x, y, y_pred, sample_weight)
        if not isinstance(denominator, str):      # SUMMED_LOSS with loss_reduction="mean": 1 each
            weight = tf.cast(denominator, tf.float32)
    model.compute_metrics(x, y, y_pred, sample_weight=metric_weights(sample_weight, real))
    return grads, tf.cast(loss, tf.float32), weight


def _weigh_by_real_rows(trackers, before, real, loss, count):
    """Each output's loss tracker as the large batch's. Keras' loss adds an output's loss
    L weighed by its rows' static count, or by 1 where the batch's size is not static (a
    dataset's, arrays' after a shorter last batch): here the micro-batch's rows b, padding
    included (`before`: each tracker's total before). Weighed again by its real rows r
    over the batch's `count` n, times n where n is static: over the micro-batches,
    sum(r_i L_i) / n is the large batch's L, with the large batch's weight (exact for an
    output's loss over its rows; with a mask of its own, a mean of its micro-batches')."""
    if not trackers:
        return
    size = tf.cast(tf.size(real), tf.float32)
    rows = tf.reduce_sum(tf.cast(real, tf.float32))
    weight = rows if isinstance(count, int) else rows / tf.cast(count, tf.float32)
    with tf.control_dependencies([loss]):
        for tracker, total in zip(trackers, before):
            added = tf.identity(tracker.total) - total
            tracker.total.assign_add(added * tf.cast(weight / size - 1.0, added.dtype))
            tracker.count.assign_add(tf.cast(weight - size, tracker.count.dtype))


def traced_micro_step(step):
    """`step(index=i)` trains micro-batch i and returns (gradients, loss, weight): traced
    once, as a function of the index, and that one trace serves twice. Its outputs give
    each gradient's kind (None, a tensor, `tf.IndexedSlices`: the loop's variables are
    made from them) and the positions of those whose rows are a table looked up once per
    batch (of a static row count); the loop's body calls it. Returns (the traced step,
    kinds, once). Tracing the forward and backward passes is most of a first epoch under
    `jit_compile=True`: they are traced once per batch shape, not once more in a scratch
    function to learn the kinds first. Plain TensorFlow, for both Keras."""
    once = []

    def traced(index):
        out = step(index=index)
        once.extend(k for k, g in enumerate(out[0]) if isinstance(g, tf.IndexedSlices)
                    and g.values.shape.is_fully_defined()
                    and lookups.kind_of_rows(g.indices) == lookups.ONCE_PER_BATCH)
        return out

    function = tf.function(traced, autograph=False).get_concrete_function(tf.TensorSpec([], tf.int32))

    def call(index):
        return function(index)

    return call, list(function.structured_outputs[0]), once


def micro_batch_loop(step, kinds, once, count, size, variables):
    """The micro-batches in a `tf.while_loop`: (dense sums, sparse rows, loss sum, weight sum).

    `step(index=i)` trains micro-batch i and returns (gradients, loss, weight); `kinds` and
    `once` are `traced_micro_step(step)`'s; `count` the batch's samples (an int or a scalar
    tensor), `size` the micro-batch's, `variables` those the gradients are of (their
    shapes make the dense sums). Dense sums are `{position: sum of weight * gradient}`,
    sparse rows `{position: (weighted rows, ids)}`. Plain TensorFlow, for both Keras.
    Rows looked up once per batch (`once`) are summed, as the large batch has them once; other
    rows are kept, one array per gradient, concatenated."""
    dense_at = [k for k, kind in enumerate(kinds) if kind is not None and not isinstance(kind, tf.IndexedSlices)]
    dense_at += once
    sparse_at = [k for k, kind in enumerate(kinds) if isinstance(kind, tf.IndexedSlices) and k not in once]
    micro_batches = (count + size - 1) // size

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
        return tf.zeros(variables[k].shape, kinds[k].dtype)

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


def replica_context():
    """(the replica context, its replicas) in a replica context of several; (None, 1) else."""
    if not tf.distribute.has_strategy():
        return None, 1
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None, 1
    return context, context.num_replicas_in_sync


def sum_over_replicas(context, sums, once, variables):
    """The loop's sums (`micro_batch_loop`'s four) over all replicas, in replica context
    `context` (unchanged for None): dense sums, a table's once-per-batch rows (positions
    `once`), the loss and weight sums added in one all-reduce; rows per sample gathered in
    replica order (the large batch's rows: replica r holds the r-th share of the batch).
    Plain TensorFlow, for both Keras."""
    if context is None:
        return sums
    dense, sparse, loss_sum, weight_sum = sums
    dense_at, once_at = list(dense), [k for k in once if k in sparse]
    summed = context.all_reduce(tf.distribute.ReduceOp.SUM, [dense[k] for k in dense_at]
                                + [sparse[k][0] for k in once_at] + [loss_sum, weight_sum])
    dense = dict(zip(dense_at, summed[:len(dense_at)]))
    rows = dict(sparse)
    rows.update({k: (v, sparse[k][1]) for k, v in zip(once_at, summed[len(dense_at):-2])})
    per_sample = [k for k in sparse if k not in once_at]
    if per_sample:
        gathered = context.all_reduce(tf.distribute.ReduceOp.SUM, [
            tf.IndexedSlices(*sparse[k], tf.shape(variables[k], out_type=sparse[k][1].dtype))
            for k in per_sample])
        rows.update({k: (g.values, g.indices) for k, g in zip(per_sample, gathered)})
    return dense, rows, summed[-2], summed[-1]


def update_gradients(kinds, variables, dense, sparse, factor, merge=False, densify=False):
    """The update's gradients from the (reduced) sums: each times `factor` (R over the
    weight sum for a mean loss, R undoing Keras' 1 / R of each replica's loss; 1 for a
    loss that sums), rows per id summed first with `merge` (`merge_duplicate_rows`), as a
    dense tensor with `densify` (under XLA, which cannot merge rows: the same update where
    the rows are merged). Plain TensorFlow."""
    grads = []
    for k, (kind, variable) in enumerate(zip(kinds, variables)):
        if k in dense:
            grads.append(dense[k] * tf.cast(factor, dense[k].dtype))
        elif k in sparse:
            rows, indices = sparse[k]
            slices = tf.IndexedSlices(rows * tf.cast(factor, rows.dtype), indices,
                                      tf.shape(variable, out_type=indices.dtype))
            if merge and densify:
                slices = tf.math.unsorted_segment_sum(slices.values, slices.indices, tf.shape(variable)[0])
            elif merge:
                slices = window_rows.merge_duplicate_rows(slices)
            grads.append(slices)
        else:
            grads.append(None)
    return grads


def _float16_overflow_as_nan(layers, grads, variables):
    """`grads` (the update's mean at the loss scale S), NaN throughout where a variable of a
    float16 layer (`layers`: the model's, None for none) has one beyond float16's range: the
    large batch's float16 gradient there is that sum, and would be inf; the LossScaleOptimizer
    then skips the update and lowers the scale, as for the large batch
    (`loss_scaling.WindowLossScaling` does it for a window)."""
    checked = {id(v) for layer in layers or () for v in layer.trainable_weights}
    values = [g.values if isinstance(g, tf.IndexedSlices) else g
              for g, v in zip(grads, variables) if g is not None and id(v) in checked]
    if not values:
        return grads
    in_range = tf.reduce_all(tf.stack([tf.reduce_all(tf.abs(v) < loss_scaling.FLOAT16_OVERFLOW) for v in values]))
    return [None if g is None else _tf.scaled_by(g, tf.where(in_range, 1.0, float("nan"))) for g in grads]


def _loss_scale(optimizer):
    """The loss scale S of this update (a float32 scalar), or None without loss scaling."""
    held = getattr(optimizer, "loss_scale_optimizer", None)
    return None if held is None else tf.cast(held.scale_loss(1.0), tf.float32)


@tf.autograph.experimental.do_not_convert
def train_step(model, data):
    """Keras' `train_step` for a model whose optimizer has `micro_batch_size`: one update
    from the batch, trained in micro-batches (the module's docstring)."""
    _, replica_count = replica_context()
    sums, kinds, once, count = replica_sums(model, data, replica_count)
    return reduce_and_update(model, sums, kinds, once, count)


def replica_sums(model, data, replica_count):
    """The step's first half, in each replica, with no collective: the micro-batch loop over
    this replica's share of `data`, at micro-batches of `micro_batch_size / replica_count`.
    Returns (the loop's sums: dense, sparse rows, loss sum, weight sum; the gradients'
    kinds; the positions of rows looked up once per batch; the share's rows, an int where
    static). `accumulator.batch.fit_auto_distributed` runs it alone, so that an
    out-of-memory error cannot come while a collective is in flight."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    first = next(t for t in tf.nest.flatten(x) if t is not None)
    count = first.shape[0] if first.shape[0] is not None else tf.shape(first)[0]
    optimizer, variables = model.optimizer, list(model.trainable_variables)
    size = optimizer.micro_batch_size // replica_count
    step = functools.partial(_micro_step, model, variables, (x, y, sample_weight), size=size, count=count,
                             summed=sums_its_samples(model), loss_scale=_loss_scale(optimizer))
    step, kinds, once = traced_micro_step(step)
    return micro_batch_loop(step, kinds, once, count, size, variables), kinds, once, count


def reduce_and_update(model, sums, kinds, once, count):
    """The step's second half, in each replica: `replica_sums`' sums added over the replicas
    (one all-reduce), the layers' notes closed, the loss logged, the inner optimizer's one
    update; returns the metrics' results. `kinds` only counts the gradients (one per
    trainable variable)."""
    context, replica_count = replica_context()
    optimizer, variables = model.optimizer, list(model.trainable_variables)
    summed = sums_its_samples(model)
    dense, sparse, loss_sum, weight_sum = sum_over_replicas(context, sums, once, variables)
    micro_batch_notes.close_after_micro_batches(model)
    # Keras scales a mean loss by 1 / R in each replica's `Loss.__call__` (not a sum): R undoes it.
    factor = tf.constant(1.0) if summed else tf.math.divide_no_nan(tf.constant(float(replica_count)), weight_sum)
    grads = update_gradients(kinds, variables, dense, sparse, factor, merge=optimizer.merge_duplicate_rows,
                             densify=seam.in_xla_context())
    if getattr(optimizer, "loss_scale_optimizer", None) is not None:
        grads = _float16_overflow_as_nan(getattr(optimizer, "_float16_layers", None), grads, variables)
    seam.loss_tracker(model).update_state(loss_sum * factor, sample_weight=count)
    _apply_once(optimizer, context, grads, variables)
    return model.get_metrics_result()


def _apply_once(optimizer, context, grads, variables):
    """The inner optimizer's one update with the reduced `grads`. Under several replicas
    from cross-replica context (a `merge_call`), each replica applying the global gradient
    with the inner optimizer's own all-reduce switched off (as the window's close does):
    clipping then acts on the large batch's gradient, not on each replica's share."""
    if context is None:
        optimizer.apply_gradients(zip(grads, variables))
        return
    given = [(g, v) for g, v in zip(grads, variables) if g is not None]

    def in_each(reduced):
        optimizer.apply_gradients(zip(reduced, [v for _, v in given]))

    context.merge_call(lambda distribution, reduced: replicas.in_each_replica(
        distribution, optimizer._updates_without_reduction, in_each, reduced), args=([g for g, _ in given],))
