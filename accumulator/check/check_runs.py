"""`check_exact`'s trainings: Keras' large batch, its permuted twin and the accumulator
at the micro-batch, each from the same initial weights and seed (the float64 arbiter
trains through the same `train`).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Callable, Dict

import keras
import numpy as np

from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.check.check_arguments import sample_count, take
from tfx_gradient_accumulator.accumulator.core.options import WindowOptions

if flavours.keras_is_3():
    from tfx_gradient_accumulator.accumulator.optimizer import GradientAccumulator
else:
    from tfx_gradient_accumulator.accumulator.keras2 import GradientAccumulator

logger = logging.getLogger("tfx_gradient_accumulator.accumulator.check")      # the check's one log


def build(model_fn, x, batch_size):
    """A fresh model from `model_fn`, built on a batch of `x`."""
    model = model_fn()
    if not is_model(model):
        raise TypeError(
            "`model_fn` must return a Keras model (keras.Model, or a tf_keras.Model for Keras 2); "
            f"it returned {type(model).__name__}.")
    if not model.weights:
        model(take(x, slice(0, batch_size)))          # a subclassed model builds on its first call
    if not model.weights:
        raise ValueError("The model `model_fn` returned has no weights to compare, even after a call.")
    return model


def is_model(model):
    """Whether `model` is a Keras 3 or Keras 2 model."""
    if isinstance(model, keras.Model):
        return True
    return flavours.is_keras2_object(model) and isinstance(model, flavours.keras_package_of(model).Model)


def optimizer_factory(optimizer_fn, model):
    """`optimizer_fn`, or fresh copies of the optimizer `model` was compiled with."""
    if optimizer_fn is not None:                      # callable: `check_arguments` saw to it
        return optimizer_fn
    compiled = getattr(model, "optimizer", None)
    compiled = getattr(compiled, "inner_optimizer", compiled) if isinstance(compiled, GradientAccumulator) \
        else compiled
    if compiled is None:
        raise ValueError("`optimizer_fn` is None and `model_fn`'s model is not compiled with an "
                         "optimizer: pass `optimizer_fn` (a function returning a fresh optimizer).")
    config, cls = compiled.get_config(), type(compiled)
    return lambda: cls.from_config(dict(config))


def loss_of(model, loss):
    """The loss to compile with: `loss`, or the one `model` was compiled with."""
    if loss is None:
        loss = getattr(model, "loss", None) or None
    if loss is None:
        raise ValueError("No loss to train with: pass `loss=` (anything `Model.compile` takes), or "
                         "return a model compiled with its loss from `model_fn`.")
    return loss


# ---------------------------------------------------------------- the runs
@dataclasses.dataclass(frozen=True)
class Runs:
    """What every training of one check shares (float32 and the arbiter's float64): the
    model and optimizer factories, the compile arguments, the samples, Keras' large batch
    and the micro-batch, the seed, and the accumulator's window."""

    model_fn: Callable[[], Any]
    new_optimizer: Callable[[], Any]
    compile_kwargs: Dict[str, Any]
    arrays: tuple
    large: int
    batch_size: int
    seed: int
    accum_steps: int
    options: WindowOptions


def train(model_fn, initial, optimizer, compile_kwargs, arrays, batch_size, seed, first=None):
    """One of the runs: a model set to `initial`, compiled and fit one epoch without shuffling."""
    keras.utils.set_random_seed(seed)
    model = first if first is not None else model_fn()
    if not model.weights:
        model(take(arrays[0], slice(0, batch_size)))
    model.set_weights(initial)
    model.compile(optimizer=optimizer, **compile_kwargs)
    x, y, weights = arrays
    model.fit(x, y, sample_weight=weights, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model


def permuted(arrays, block, seed):
    """The samples permuted inside each block of `block` samples (the noise floor's run)."""
    samples = sample_count(arrays[0])
    rng = np.random.RandomState(seed + 1)
    index = np.concatenate([start + rng.permutation(block) for start in range(0, samples, block)])
    return tuple(take(a, index) for a in arrays)


class Progress:
    """A progress line per training ("check_exact [2/3] ..."): logged, and on stderr when `verbose`."""

    def __init__(self, verbose, total):
        self.verbose, self.total, self.step = verbose, total, 0

    def __call__(self, text):
        self.step += 1
        line = f"check_exact [{self.step}/{self.total}] {text}"
        logger.info(line)
        if self.verbose:
            print(line, file=sys.stderr, flush=True)

