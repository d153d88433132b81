"""`micro_batch_size="auto"` under `MirroredStrategy` and `MultiWorkerMirroredStrategy`.

On one device a step is one compiled function (`fit_auto_micro_batch`). Under a strategy the
step's all-reduce is the danger: one replica (or worker) that runs out of memory inside its
micro-batch loop while the others already wait in the all-reduce leaves them waiting (a
launched NCCL all-reduce on GPUs can wait forever), and under `MultiWorkerMirroredStrategy`
a collective that failed leaves the worker's collective executor aborted (TensorFlow asks
for a restart). So no out-of-memory error may come while a collective is in flight, and
each step here is three calls:

1. **The micro-batches, with no collective** (`_Halves.first`, one compiled function per b):
   each replica runs its loop over its share at b / R (`fit_micro_batches.replica_sums`) and
   returns its sums, per replica (`PerReplica` tensors held on each replica's device until
   step 3: nothing is written to the weights or the optimizer). Metrics and the loss
   trackers are updated per micro-batch, as on one device; their components and those of
   the non-trainable variables are copied first (`_ComponentShadows`), eagerly, on each
   replica's device.
2. **Agreement** (several workers only, `_Agreement`): every worker joins one small all-reduce
   of (did I run out of memory, my next b, the seconds lost): if any did, all put their
   shadows back and train the same batch again at the smallest b proposed; so b, the
   `micro_batch_changes` and the updates stay the same on every worker. In one process
   (`MirroredStrategy`) the failed function's error is every replica's: no collective.
3. **Reduce and update** (`_Halves.second`, compiled once, traced per shape): each replica
   all-reduces the sums and the inner optimizer makes its one update from cross-replica
   context (`fit_micro_batches.reduce_and_update`, the second half of the int-b step).
   An out-of-memory error here stops the run, as inside the update on one device.

Metrics are updated inside the micro-batches, so their variables must be per replica
(`on_read`, as Keras 3.15 makes them): a Keras that mirrors them (3.8) adds each update over
the replicas there, an all-reduce where memory can run out, and is refused before the first
step (`_refuse_metrics_written_through_collectives`). The model's non-trainable variables
(`BatchNormalization`'s moving statistics, seed states) are written per replica by Keras
3.15 (aggregation "none"), no collective.

b is global and a multiple of R: each replica trains b / R of its share, an even split of
it (`micro_batch_changes.next_micro_batch(..., replicas=R)`). The first b is the first
batch's global size (this worker's rows times the workers), rounded up to a multiple of R.
"""

from __future__ import annotations

import time

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import seam
from tfx_gradient_accumulator.accumulator.batch import auto_batches as auto, fit_micro_batches
from tfx_gradient_accumulator.accumulator.batch.micro_batch import is_out_of_memory, unique_variables
from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import next_micro_batch


def is_distributed(model) -> bool:
    """Whether `model` trains under a Mirrored or MultiWorkerMirrored strategy (the split step)."""
    strategy = model.distribute_strategy
    return isinstance(strategy, (tf.distribute.MirroredStrategy, tf.distribute.MultiWorkerMirroredStrategy))


def refuse_unsupported(model) -> None:
    """Strategies other than Mirrored and MultiWorkerMirrored, and `run_eagerly` under one."""
    strategy = model.distribute_strategy
    if is_distributed(model):
        if model.run_eagerly:
            raise NotImplementedError(
                "micro_batch_size='auto' under a tf.distribute strategy runs compiled steps; compile with "
                "run_eagerly=False, or pass an int micro_batch_size.")
        return
    if strategy.num_replicas_in_sync > 1 or tf.distribute.has_strategy():
        raise NotImplementedError(
            f"micro_batch_size='auto' trains on one device or under MirroredStrategy and "
            f"MultiWorkerMirroredStrategy, not under {type(strategy).__name__}: pass an int "
            f"micro_batch_size (find one with find_micro_batch).")


def _components(variable):
    """The per-replica (or single) tf.Variables behind a Keras variable, on this worker."""
    value = getattr(variable, "_value", None)
    value = variable if value is None else value
    return list(getattr(value, "values", (value,)))


class _ComponentShadows:
    """Copies of each replica's component of the metrics' and the non-trainable variables,
    taken eagerly before a step's micro-batches and put back after an out-of-memory error
    (on every worker). Component by component, on its own device: no collective, and a
    SyncOnRead metric's per-replica partial sums stay per replica."""

    def __init__(self, model):
        variables = list(model.metrics_variables) + list(model.non_trainable_variables)
        self.components = unique_variables(c for v in variables for c in _components(v))
        self.copies = []

    def take(self):
        self.copies = []
        for component in self.components:
            with tf.device(component.device):
                self.copies.append(tf.identity(component))

    def put_back(self):
        for component, copy in zip(self.components, self.copies):
            component.assign(copy)


class _Halves:
    """The split step's compiled functions: `first(b, data)` (one per b) and `second(sums)`;
    `op_types(first=...)` lists the ops their traces hold (nested functions included)."""

    def __init__(self, model):
        self.model, self.strategy = model, model.distribute_strategy
        self.replicas = self.strategy.num_replicas_in_sync
        self.compiled, self.once, self.gradients = {}, [], 0
        self.traced_first, self.traced_second = [], []     # each trace's graph, for `op_types`
        self.second = tf.function(self._second, reduce_retracing=True)
        self.agree = _Agreement(self.strategy)

    def op_types(self, first=True):
        found = set()
        for traced in (self.traced_first if first else self.traced_second):
            graph = traced.as_graph_def()
            found.update(node.op for node in graph.node)
            found.update(node.op for f in graph.library.function for node in f.node_def)
        return found

    def first(self, size, data):
        if size not in self.compiled:
            self.compiled[size] = tf.function(self._first, reduce_retracing=True)
        return self.compiled[size](data)

    def _first(self, data):
        self.traced_first.append(tf.compat.v1.get_default_graph())

        def in_replica(data):
            sums, kinds, once, count = fit_micro_batches.replica_sums(self.model, data, self.replicas)
            self.once, self.gradients = list(once), len(kinds)      # read by `_second`'s trace
            return sums, tf.cast(count, tf.int32)

        return self.strategy.run(in_replica, args=(data,))

    def _second(self, halves):
        self.traced_second.append(tf.compat.v1.get_default_graph())

        def in_replica(sums, count):
            # Placed on the replica's device: the function's inputs have none, and the
            # collectives take their destinations from their values' devices.
            sums, count = tf.nest.map_structure(tf.identity, (sums, count))
            return fit_micro_batches.reduce_and_update(self.model, sums, [None] * self.gradients, self.once,
                                                       count)

        logs = self.strategy.run(in_replica, args=halves)
        return seam.reduce_per_replica(logs, self.strategy)


class _Agreement:
    """Every worker's (failed, next b, seconds lost) in one all-reduce, one function for the
    run: (any failed, the smallest b proposed, the most seconds lost). One worker: its own."""

    def __init__(self, strategy):
        self.strategy, self.replicas = strategy, strategy.num_replicas_in_sync
        self.multi_worker = seam.is_multi_worker(strategy)
        self.gather = tf.function(self._gather)

    def _gather(self, values):
        def in_replica(values):
            context = tf.distribute.get_replica_context()
            row = tf.one_hot(context.replica_id_in_sync_group, self.replicas, dtype=tf.float64)
            return context.all_reduce(tf.distribute.ReduceOp.SUM, row[:, None] * values[None, :])

        return self.strategy.run(in_replica, args=(values,))

    def __call__(self, failed, proposal, seconds):
        if not self.multi_worker:
            return failed, proposal, seconds
        mine = tf.constant([float(failed), float(proposal), float(seconds)], tf.float64)
        rows = self.strategy.experimental_local_results(self.gather(mine))[0].numpy()
        return bool(rows[:, 0].max() > 0), int(rows[:, 1].min()), float(rows[:, 2].max())


def _sizes(strategy, data):
    """(the batch's global rows, its input elements per sample) from this worker's shares."""
    local = strategy.experimental_local_results(data)
    xs = [keras.utils.unpack_x_y_sample_weight(part)[0] for part in local]
    rows = sum(int(auto._first_tensor(x).shape[0]) for x in xs)
    workers = strategy.num_replicas_in_sync // max(len(local), 1)
    return rows * workers, auto._elements_per_sample(xs[0])


def _multiple(count, replicas):
    return replicas * -(-count // replicas)


def train_function(model, state, halves):
    """`model.train_function` for "auto" under a strategy (the module's docstring)."""
    parts, shadows = _Halves(model), []

    def function(iterator):
        data = auto._next_batch(iterator)
        if not shadows:
            _refuse_metrics_written_through_collectives(model)
            shadows.append(_ComponentShadows(model))
        return _train(model, state, halves, parts, shadows[0], data)

    function.split_step = parts         # its compiled halves, for a look at their ops
    return function


def _name(strategy):
    """The strategy's public name (MultiWorkerMirroredStrategy's class is CollectiveAllReduceStrategy)."""
    if isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return "MultiWorkerMirroredStrategy"
    return type(strategy).__name__


def _refuse_metrics_written_through_collectives(model):
    """Before the first step: metrics whose variables are mirrored (Keras 3.8 makes them so;
    later releases keep them per replica, `on_read`) add each update over the replicas, an
    all-reduce inside the micro-batches, where memory can run out."""
    tracker = {id(v) for v in seam.loss_tracker(model).variables}
    for variable in model.metrics_variables:
        value = getattr(variable, "_value", variable)
        if id(variable) not in tracker and getattr(value, "synchronization", None) == tf.VariableSynchronization.ON_WRITE:
            raise NotImplementedError(
                f"micro_batch_size='auto' under {_name(model.distribute_strategy)}: this Keras "
                f"({keras.__version__}) keeps the metric variable {variable.path!r} mirrored, so each of its "
                "updates is an all-reduce inside the micro-batches, where memory can run out with a collective "
                "in flight. Compile without metrics, use a Keras that keeps metric variables per replica "
                "(on_read, as 3.15 does), or pass an int micro_batch_size (find one with find_micro_batch).")


def _train(model, state, halves, parts, shadows, data):
    """One batch: its micro-batches at the current b, again at smaller ones (agreed by every
    worker) after out-of-memory errors, then the reduce-and-update."""
    count, per_sample = _sizes(parts.strategy, data)
    if state.current is None:
        state.current = _multiple(count, parts.replicas)
    state.effective_batch = max(state.effective_batch or 0, count)
    started, errors, lost = state.current, 0, 0.0
    while True:
        sums, failed, seconds = _first_half(parts, shadows, state, data)
        proposal = state.current
        if failed is not None and state.current > parts.replicas:
            proposal = next_micro_batch(state.current, _multiple(state.effective_batch, parts.replicas), per_sample,
                                        state.elements_fit, replicas=parts.replicas)
        any_failed, proposal, seconds = parts.agree(failed is not None, proposal, seconds)
        if not any_failed:
            break
        errors, lost = errors + 1, lost + seconds
        shadows.put_back()
        _stop_at_the_smallest(model, state, parts.replicas, failed)
        state.current = proposal
    logs = _second_half(parts, halves, sums)
    state.elements_fit = max(state.elements_fit or 0, state.current * per_sample)
    if errors:
        auto._record(model, state, started, errors, lost)
    return logs


def _first_half(parts, shadows, state, data):
    """(the replicas' sums or None, this worker's out-of-memory error or None, its seconds)."""
    began = time.monotonic()
    shadows.take()
    try:
        return parts.first(state.current, data), None, 0.0
    except tf.errors.OpError as err:
        if not is_out_of_memory(err):
            raise
        return None, err, time.monotonic() - began


def _stop_at_the_smallest(model, state, replicas, err):
    """Out of memory at one sample a replica: nothing smaller to try."""
    if state.current <= replicas:
        detail = f" Original error: {err.message}" if err is not None else " (on another worker)"
        raise tf.errors.ResourceExhaustedError(
            None, None, f"micro_batch_size='auto': a training step ran out of memory at a micro-batch of "
            f"{state.current} samples ({replicas} replicas: one sample each) at update "
            f"{int(model.optimizer.iterations.numpy())}, epoch {state.epoch}: this batch needs more memory than "
            f"the devices have for one sample a replica. The weights are those of the last update.{detail}")


def _second_half(parts, halves, sums):
    """The all-reduce and the update; an out-of-memory error there stops the run."""
    try:
        return parts.second(sums)
    except tf.errors.OpError as err:
        if not is_out_of_memory(err):
            raise
        raise RuntimeError(
            "micro_batch_size='auto' under a tf.distribute strategy: the out-of-memory error came in the "
            "all-reduce or the inner optimizer's update, after every replica's micro-batches had fit: the "
            "update may be half-made and the replicas' collectives aborted, so the batch cannot be trained "
            "again. The update's memory does not depend on the micro-batch; resume from a checkpoint "
            "(TrainingBackup) with more free memory.") from err
