"""Accumulation for training code that was written without it.

`accumulating_compile(accum_steps)` wraps every optimizer handed to
`keras.Model.compile` in `GradientAccumulator` while the context is open (for a
mixed_float16 model, around a `LossScaleOptimizer`, with Keras' own loss-scale
wrapping turned off), so an unchanged training function trains with
accumulation. Its AccumBatchNormalization layers get the same `accum_steps`.
The TFX executor and the KerasTuner helpers use it.
"""

import contextlib
import functools
import logging

import keras

from accumulator import fit_hook
from accumulator.batch_norm import configure_batch_norm
from accumulator.optimizer import GradientAccumulator

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def accumulating_compile(accum_steps, schedule=None, partial_window="apply"):
    """Patches `keras.Model.compile` (and, with a `schedule`, `fit`); yields the wrappers made.

    `schedule` ({epoch: accum_steps}) makes the wrappers schedulable and adds an
    `AccumulationSchedule` callback to every `fit` of a model compiled here.
    `partial_window` is the wrappers' (see `GradientAccumulator`).
    """
    from accumulator.callbacks import AccumulationSchedule, accum_steps_at, validate_schedule

    if schedule is not None:
        schedule = validate_schedule(schedule)
        accum_steps = accum_steps_at(schedule, 0)
    fit_hook.install()   # before `fit` is saved here: restoring it keeps the hook
    original = keras.Model.compile
    original_fit = keras.Model.fit
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
                optimizer = GradientAccumulator(
                    inner, accum_steps, partial_window=partial_window, schedulable=schedule is not None
                )
                configure_batch_norm(self, accum_steps, optimizer)
                logger.info("Wrapped %s in GradientAccumulator(accum_steps=%d).",
                             type(inner).__name__, accum_steps)
            made.append(optimizer)
        return original(self, optimizer, *args, **kwargs)

    @functools.wraps(original_fit)
    def fit(self, *args, callbacks=None, **kwargs):
        if schedule is not None and any(self.optimizer is o for o in made):
            callbacks = list(callbacks or []) + [AccumulationSchedule(schedule)]
        return original_fit(self, *args, callbacks=callbacks, **kwargs)

    keras.Model.compile = compile
    keras.Model.fit = fit
    try:
        yield made
    finally:
        keras.Model.compile = original
        keras.Model.fit = original_fit
