"""`accum_steps="fit"`: the micro-batch that fits the worker's device, found before training.

The user sets the effective batch E (or tunes it); how E splits into N micro-batches
depends on the device, the model and the data. Here the run_fn runs up to its first
`fit` (`exactness.probe`: its own model, compiled with the run's `GradientAccumulator`,
on its own data pipeline, under the run's strategy), and
`accumulator.find_micro_batch` trains real steps of that model on one batch of that
data, at growing micro-batches, until one runs out of memory (on a cluster each worker
probes a copy of the model on its own device, and all take the smallest found: one
collective). The micro-batch taken
leaves 10% headroom and divides E (the Trainer's datasets are batched at one size), so
N = E / b, and the run then trains from the start exactly as with that `accum_steps`.
The probe's model is dropped, and Keras' global state and every random generator are put
back (`exactness.forget_the_probe`): the run_fn's training is the one without the probe.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf
from absl import logging

from tfx_gradient_accumulator.accumulator.core import seam
from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile
from tfx_gradient_accumulator.accumulator.batch.micro_batch import find_micro_batch
from tfx_gradient_accumulator.components import exactness, fn_args_utils, settings as settings_lib


def settle(run_fn, fn_args, settings: settings_lib.AccumulationSettings, strategy, role
           ) -> settings_lib.AccumulationSettings:
    """The run's settings with `accum_steps` found on this device (unchanged without "fit").

    Args:
        run_fn: the user's run_fn.
        fn_args: its `FnArgs`, as the Trainer made them.
        settings: the resolved settings (`fit_to_device`: accum_steps="fit").
        strategy: the executor's strategy.
        role: this process's place in a cluster.

    Returns:
        The settings, with `accum_steps` = E / b and `fitted` (the `MicroBatchFit`).

    Raises:
        ValueError: a run_fn that never calls `fit` on a compiled Keras 3 model.
        tf.errors.ResourceExhaustedError: not even one sample's step fits the device.
    """
    if not settings.fit_to_device:
        return settings
    logging.info("accum_steps='fit': running the run_fn up to its fit, then training steps of growing "
                 "micro-batches of its data until one runs out of memory (effective batch %d).",
                 settings.effective_batch_size)
    before = keras.config.dtype_policy(), seam.random_state()
    try:
        with accumulating_compile(strategy=strategy, **settings.compile_arguments()):
            reached = exactness.probe(run_fn, fn_args_utils.for_accumulation(fn_args, settings, role.workers),
                                      strategy)
        if reached is None:
            raise ValueError("accum_steps='fit' probes the model the run_fn trains, but the run_fn never "
                             "called Model.fit. Set an int accum_steps.")
        x, y, sample_weight = _one_batch(reached)
        found = find_micro_batch(reached.model, x, y, sample_weight=sample_weight,
                                 effective_batch_size=settings.effective_batch_size, uniform=True)
    finally:
        exactness.forget_the_probe(before)
    logging.info("accum_steps='fit': %s.", found)
    return dataclasses.replace(settings, accum_steps=found.accum_steps, fitted=found)


def _one_batch(reached):
    """One batch of the data `fit` was called with, as arrays: (x, y, sample_weight)."""
    if reached.x is not None and not isinstance(reached.x, tf.data.Dataset):
        return reached.x, reached.y, None
    batch = next(iter(reached.x))
    batch = tf.nest.map_structure(lambda t: t.numpy(), batch)
    return keras.utils.unpack_x_y_sample_weight(batch if isinstance(batch, tuple) else (batch,))
