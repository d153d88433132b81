"""The ways to train with an effective batch of N*b, built side by side.

Two families, compared only within themselves:

* ``fit`` (Keras `model.fit`): plain b (no accumulation: the speed peer), plain
  N*b (the large batch itself, where it fits in memory), `GradientAccumulator`,
  the same with `measure_noise_scale=True`, and Keras' built-in
  `gradient_accumulation_steps=N`.
* ``loop`` (a custom `tf.function` training loop, one call per micro-batch):
  plain b, the seeds' hand-written `GradientTape` loop (sum the gradients in
  buffers, apply their mean every N micro-batches, reset; as
  `tests/accumulator/reference.py`), and `GradientAccumulator` driven by
  `apply_gradients` once per micro-batch.

Every contender is a `Contender` whose `run(micro_steps)` trains on
`micro_steps * b` samples and returns the seconds those took. A `fit` call runs
warm steps first (one step; a whole window for the accumulating contenders) and
is timed from the end of the warm steps to the end of its last step, so `fit`'s
per-call set-up, its first step and its end-of-epoch work are outside the
timing, for every `fit` contender alike; `micro_steps` is a multiple of N, so
whole windows are timed and no window is left open.
"""

import time

import keras
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import AccumBatchNormalization, GradientAccumulator
from tfx_gradient_accumulator.accumulator.batch_norm import configure_batch_norm
from benchmarks import models
from benchmarks.parts import jit_compile_setting, jit_compile_value

FIT = ["plain_b", "plain_Nb", "accumulator", "accumulator_noise_scale", "keras_builtin"]
LOOP = ["plain_b_loop", "seeds_loop", "accumulator_loop"]
CONTENDERS = FIT + LOOP
# Contenders whose work does not depend on N: built once, measured at every N
# (the sanity check compares those measurements).
N_INDEPENDENT = ["plain_b", "plain_b_loop"]
LABELS = {
    "plain_b": "plain b (fit)",
    "plain_Nb": "plain N·b (fit)",
    "accumulator": "GradientAccumulator (fit)",
    "accumulator_noise_scale": "GradientAccumulator + noise scale (fit)",
    "keras_builtin": "Keras built-in (fit)",
    "plain_b_loop": "plain b (loop)",
    "seeds_loop": "hand-written tape loop (loop)",
    "accumulator_loop": "GradientAccumulator (loop)",
    "plain_b_mirrored": "plain b (fit, MirroredStrategy, 1 device)",
    "accumulator_mirrored": "GradientAccumulator (fit, MirroredStrategy, 1 device)",
}
MIRRORED = "_mirrored"      # suffix: the contender built under a one-device MirroredStrategy


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _optimizer(**kwargs):
    return keras.optimizers.Adam(1e-3, **kwargs)


def dataset(x, y, batch):
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch, drop_remainder=True).repeat().prefetch(2)


def _sync(value):
    """Waits for the device (a host copy of a value the step produced)."""
    np.asarray(value)


class _Timer(keras.callbacks.Callback):
    """Marks the ends of two batches of one `fit` call."""

    def __init__(self, first, last):
        super().__init__()
        self.at, self.marks = (first, last), []

    def on_train_batch_end(self, batch, logs=None):
        if batch in self.at:
            _sync(self.model.optimizer.iterations)
            self.marks.append(time.perf_counter())


class Contender:
    """One way of training; `run(micro_steps)` returns the seconds they took."""

    def __init__(self, name, model, run, micro_steps_per_step=1):
        self.name, self.model, self._run = name, model, run
        self.micro_steps_per_step = micro_steps_per_step
        self.callbacks = []         # more `fit` callbacks (the memory probe)

    def run(self, micro_steps):
        if micro_steps % self.micro_steps_per_step:
            raise ValueError(f"{self.name}: {micro_steps} micro-steps are not whole steps")
        return self._run(micro_steps // self.micro_steps_per_step)


def _fit_contender(name, model, optimizer, x, y, batch, micro_steps_per_step=1, warm_steps=1):
    """`fit` runs `warm_steps` (a whole window when accumulating, so no window
    is left open at the end) untimed, then the timed steps."""
    # BENCH_JIT_COMPILE (parts.py): XLA as asked, for every contender alike.
    model.compile(optimizer=optimizer, loss=_loss(), jit_compile=jit_compile_value(jit_compile_setting()))
    data = dataset(x, y, batch)

    def run(steps):
        timer = _Timer(warm_steps - 1, warm_steps - 1 + steps)
        model.fit(data, steps_per_epoch=warm_steps + steps, epochs=1, verbose=0,
                  callbacks=[timer, *contender.callbacks])
        return timer.marks[1] - timer.marks[0]

    contender = Contender(name, model, run, micro_steps_per_step)
    return contender


def _timed_loop(step):
    def run(steps):
        start = time.perf_counter()
        for _ in range(steps):
            loss = step()
        _sync(loss)
        return time.perf_counter() - start
    return run


def _loop_contender(name, model, optimizer, x, y, micro):
    """A custom loop, one `tf.function` call per micro-batch: `optimizer.apply_gradients` each time."""
    loss_fn = _loss()
    variables = model.trainable_variables
    optimizer.build(variables)
    iterator = iter(dataset(x, y, micro))

    @tf.function
    def step():
        xb, yb = next(iterator)
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    step()          # trace
    return Contender(name, model, _timed_loop(step))


def _seeds_contender(model, x, y, micro, accum):
    """The seeds' loop (`tests/accumulator/reference.py`): buffers, mean every N, reset."""
    optimizer = _optimizer()
    loss_fn = _loss()
    variables = model.trainable_variables
    optimizer.build(variables)
    buffers = [tf.Variable(tf.zeros_like(v), trainable=False) for v in variables]
    iterator = iter(dataset(x, y, micro))

    @tf.function
    def micro_step():
        xb, yb = next(iterator)
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        for buf, g in zip(buffers, tape.gradient(loss, variables)):
            buf.assign_add(g)
        return loss

    @tf.function
    def apply(count):
        optimizer.apply_gradients([(buf / count, v) for buf, v in zip(buffers, variables)])
        for buf in buffers:
            buf.assign(tf.zeros_like(buf))

    count = tf.constant(float(accum))
    micro_step()
    apply(count)    # trace both

    def run(steps):
        start = time.perf_counter()
        for i in range(steps):
            loss = micro_step()
            if (i + 1) % accum == 0:
                apply(count)
        _sync(loss)
        return time.perf_counter() - start

    return Contender("seeds_loop", model, run)


def build(name, workload, size, accum, x, y):
    """A `Contender` training `workload` at effective batch accum * b.

    A name ending in `_mirrored` builds the contender under a MirroredStrategy
    over one device (the first GPU, else the CPU): the path a TFX Trainer with
    a strategy takes, where the window's sums go through an all-reduce.
    """
    if name.endswith(MIRRORED):
        device = "/gpu:0" if tf.config.list_logical_devices("GPU") else "/cpu:0"
        with tf.distribute.MirroredStrategy([device]).scope():
            contender = build(name[:-len(MIRRORED)], workload, size, accum, x, y)
        contender.name = name
        return contender
    micro = models.config(workload, size)["micro"]
    accumulating = name in ("accumulator", "accumulator_noise_scale", "accumulator_loop")
    batch_norm = AccumBatchNormalization if accumulating and workload in models.HAS_BATCH_NORM else None
    model = models.build(workload, size, batch_norm=batch_norm)
    if name == "plain_b":
        return _fit_contender(name, model, _optimizer(), x, y, micro)
    if name == "plain_Nb":
        return _fit_contender(name, model, _optimizer(), x, y, micro * accum, micro_steps_per_step=accum)
    if name in ("accumulator", "accumulator_noise_scale"):
        optimizer = GradientAccumulator(_optimizer(), accum,
                                        measure_noise_scale=name == "accumulator_noise_scale")
        return _fit_contender(name, model, optimizer, x, y, micro, warm_steps=accum)
    if name == "keras_builtin":
        optimizer = _optimizer(gradient_accumulation_steps=accum if accum > 1 else None)
        return _fit_contender(name, model, optimizer, x, y, micro, warm_steps=accum)
    if name == "plain_b_loop":
        return _loop_contender(name, model, _optimizer(), x, y, micro)
    if name == "seeds_loop":
        return _seeds_contender(model, x, y, micro, accum)
    if name == "accumulator_loop":
        optimizer = GradientAccumulator(_optimizer(), accum)
        optimizer.build(model.trainable_variables)
        configure_batch_norm(model, accum, optimizer)
        return _loop_contender(name, model, optimizer, x, y, micro)
    raise ValueError(f"unknown contender {name!r}")
