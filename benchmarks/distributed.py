"""MirroredStrategy over 2 logical CPUs: the accumulator against the seeds' pattern.

The seeds' distributed recipe reduces the gradients across replicas after every
micro-step, then accumulates; the accumulator reduces once per update. Both run
as the same custom `strategy.run` loop, one `tf.function` call per micro-step.
"""

import random
import statistics
import time

import keras
import tensorflow as tf

from accumulator import GradientAccumulator
from benchmarks import contenders as c


class CountingReduction(tf.distribute.ReductionToOneDevice):
    def __init__(self):
        super().__init__()
        with tf.init_scope():
            self.count = tf.Variable(0, dtype=tf.int64, trainable=False)

    def batch_reduce_implementation(self, reduce_op, value_destination_pairs, options):
        self.count.assign_add(1)
        return super().batch_reduce_implementation(reduce_op, value_destination_pairs, options)


def _accumulator(model_name, micro, accum, x, y):
    """The same custom loop as the seeds', with the accumulator doing the work."""
    counter = CountingReduction()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=counter)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    with strategy.scope():
        model = c.MODELS[model_name]()
        optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), accum)
        optimizer.build(model.trainable_variables)
    iterator = iter(strategy.experimental_distribute_dataset(c._dataset(x, y, micro)))

    @tf.function
    def micro_step():
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=micro)
            optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
        strategy.run(replica, args=next(iterator))

    def train(updates):
        for _ in range(updates * accum):
            micro_step()

    return train, counter


def _seeds_pattern(model_name, micro, accum, x, y):
    counter = CountingReduction()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"], cross_device_ops=counter)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    with strategy.scope():
        model = c.MODELS[model_name]()
        optimizer = keras.optimizers.Adam(1e-3)
        optimizer.build(model.trainable_variables)
        buffers = [tf.Variable(tf.zeros_like(v), trainable=False) for v in model.trainable_variables]
    iterator = iter(strategy.experimental_distribute_dataset(c._dataset(x, y, micro)))

    @tf.function
    def micro_step():
        def replica(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.nn.compute_average_loss(loss_fn(yb, model(xb, training=True)), global_batch_size=micro)
            return tape.gradient(loss, model.trainable_variables)
        grads = strategy.run(replica, args=next(iterator))
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

    return train, counter


def mirrored(model_name, micro, accum, updates, rounds):
    x, y = c.data(model_name, micro * accum * 8)
    built = {"accumulator": _accumulator(model_name, micro, accum, x, y),
             "seeds_reduce_every_micro_step": _seeds_pattern(model_name, micro, accum, x, y)}
    for train, _ in built.values():
        train(2)
    times = {name: [] for name in built}
    reductions = {}
    order = list(built)
    for _ in range(rounds):
        random.shuffle(order)
        for name in order:
            train, counter = built[name]
            before = int(counter.count.numpy())
            start = time.perf_counter()
            train(updates)
            times[name].append(time.perf_counter() - start)
            reductions[name] = (int(counter.count.numpy()) - before) / updates
    return {name: {"seconds_per_update": statistics.median(t) / updates,
                   "reductions_per_update": reductions[name]} for name, t in times.items()}
