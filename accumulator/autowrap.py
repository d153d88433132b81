"""Accumulation for training code that was written without it.

`accumulating_compile(accum_steps)` wraps every optimizer handed to
`keras.Model.compile` in `GradientAccumulator` while the context is open (for a
mixed_float16 model, around a `LossScaleOptimizer`, with Keras' own loss-scale
wrapping turned off), so an unchanged training function trains with
accumulation. The TFX executor and the KerasTuner helpers use it.
"""

import contextlib
import functools
import logging

import keras

from accumulator.optimizer import GradientAccumulator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def accumulating_compile(accum_steps):
    """Patches `keras.Model.compile`; yields the list of wrappers it made."""
    original = keras.Model.compile
    made = []

    @functools.wraps(original)
    def compile(self, optimizer="rmsprop", *args, **kwargs):
        if optimizer is not None:
            if isinstance(optimizer, GradientAccumulator):
                logger.warning(
                    "run_fn compiled with its own GradientAccumulator (accum_steps=%d); "
                    "it is kept, and the component's accum_steps=%d is not applied.",
                    optimizer.accum_steps, accum_steps,
                )
            else:
                inner = keras.optimizers.get(optimizer)
                if getattr(self, "dtype_policy", None) is not None and \
                        self.dtype_policy.name == "mixed_float16" and \
                        kwargs.get("auto_scale_loss", True) and \
                        not isinstance(inner, keras.optimizers.LossScaleOptimizer):
                    inner = keras.optimizers.LossScaleOptimizer(inner)
                    kwargs["auto_scale_loss"] = False
                optimizer = GradientAccumulator(inner, accum_steps)
                logger.info("Wrapped %s in GradientAccumulator(accum_steps=%d).",
                             type(inner).__name__, accum_steps)
            made.append(optimizer)
        return original(self, optimizer, *args, **kwargs)

    keras.Model.compile = compile
    try:
        yield made
    finally:
        keras.Model.compile = original
