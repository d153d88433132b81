"""MirroredStrategy over 2 logical CPUs: the accumulator against the seeds' pattern.

The seeds' distributed recipe reduces the gradients across replicas after every
micro-step, then accumulates; the accumulator reduces once per update. Both run
as the same custom `strategy.run` loop, one `tf.function` call per micro-step.
"""

import statistics
import time

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from benchmarks import contenders as c
from benchmarks import models


def count_batch_reductions(strategy):
    """Counts executed batched cross-replica reductions of `strategy` (graph or eager)."""
    with tf.init_scope():
        counter = tf.Variable(0, dtype=tf.int64, trainable=False)
    original = strategy.extended._batch_reduce_to

    def counted(reduce_op, value_destination_pairs, options):
        counter.assign_add(1)
        return original(reduce_op, value_destination_pairs, options)

    strategy.extended._batch_reduce_to = counted
    return counter


def mirrored_strategy():
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


_PER_EXAMPLE_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")


def _replica_gradients(model, xb, yb, global_batch):
    with tf.GradientTape() as tape:
        per_example = _PER_EXAMPLE_LOSS(yb, model(xb, training=True))
        loss = tf.nn.compute_average_loss(per_example, global_batch_size=global_batch)
    return tape.gradient(loss, model.trainable_variables)


def _accumulator(strategy, model_name, micro, accum, x, y):
    """The same custom loop as the seeds', with the accumulator doing the work."""
    with strategy.scope():
        model = models.build(model_name)
        optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), accum)
        optimizer.build(model.trainable_variables)
    iterator = iter(strategy.experimental_distribute_dataset(c.dataset(x, y, micro)))

    @tf.function
    def micro_step():
        def replica(xb, yb):
            grads = _replica_gradients(model, xb, yb, micro)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica, args=next(iterator))

    def train(updates):
        for _ in range(updates * accum):
            micro_step()

    return train


def _seeds_pattern(strategy, model_name, micro, accum, x, y):
    with strategy.scope():
        model = models.build(model_name)
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
        buffers = [tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables]
    iterator = iter(strategy.experimental_distribute_dataset(c.dataset(x, y, micro)))

    @tf.function
    def micro_step():
        grads = strategy.run(lambda xb, yb: _replica_gradients(model, xb, yb, micro), args=next(iterator))
        # The seeds: reduce every micro-step, then add into the buffers.
        reduced = strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, [(g, v.value) for g, v in zip(grads, model.trainable_variables)])
        for buf, g in zip(buffers, reduced):
            buf.assign_add(g / accum)

    @tf.function
    def apply():
        strategy.run(lambda: optimizer.apply_gradients(
            [(tf.convert_to_tensor(b) / strategy.num_replicas_in_sync, v)
             for b, v in zip(buffers, model.trainable_variables)]))
        for buf in buffers:
            buf.assign(tf.zeros_like(buf))

    def train(updates):
        for _ in range(updates):
            for _ in range(accum):
                micro_step()
            apply()

    return train


def compare(strategy, model_name, micro, accum, updates, rounds):
    """Time per update and reductions per update of both patterns under `strategy`."""
    counter = count_batch_reductions(strategy)
    x, y = models.data(model_name, "cpu", micro * accum * 8)
    built = {"accumulator": _accumulator(strategy, model_name, micro, accum, x, y),
             "seeds_reduce_every_micro_step": _seeds_pattern(strategy, model_name, micro, accum, x, y)}
    for train in built.values():
        train(2)
    times = {name: [] for name in built}
    reductions = {}
    order = sorted(built)       # the same order on every worker: collectives must match
    for round_index in range(rounds):
        for name in (order if round_index % 2 == 0 else order[::-1]):
            before = int(counter.numpy())
            start = time.perf_counter()
            built[name](updates)
            times[name].append(time.perf_counter() - start)
            reductions[name] = (int(counter.numpy()) - before) / updates
    return {name: {"seconds_per_update": statistics.median(t) / updates,
                   "seconds_per_update_by_round": [v / updates for v in t],
                   "reductions_per_update": reductions[name]} for name, t in times.items()}


def mirrored(model_name, micro, accum, updates, rounds):
    return compare(mirrored_strategy(), model_name, micro, accum, updates, rounds)


def multiworker(model_name, micro, accum, updates, rounds):
    """One worker's part (TF_CONFIG set by the launcher); every worker returns the same figures."""
    from tfx_gradient_accumulator.accumulator import strategy_from_environment
    strategy = strategy_from_environment()
    return compare(strategy, model_name, micro, accum, updates, rounds)


def launch_multiworker(args, workers=2, timeout=900):
    """Starts `workers` processes of `benchmarks.measure --mode=multiworker` on 127.0.0.1."""
    import json
    import os
    import subprocess
    import sys

    import portpicker

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cluster = {"worker": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(workers)]}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "benchmarks.measure", "--mode=multiworker", *args],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3",
                 TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})),
    ) for i in range(workers)]
    outputs = [p.communicate(timeout=timeout) for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError("multi-worker benchmark failed:\n" + "\n".join(e[-2000:] for _, e in outputs))
    return json.loads(outputs[0][0].strip().splitlines()[-1])
