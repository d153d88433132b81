"""Exact gradient accumulation for TensorFlow 2 / Keras 3 and Keras 2: the library's public names.

`GradientAccumulator(optimizer, accum_steps)` wraps any Keras optimizer so that training
with micro-batches follows the run with the `accum_steps`-times larger batch;
`GradientCache(model, accum_steps)` does it for losses that couple the batch. Each makes
the class of the Keras its argument belongs to. Importing the package imports TensorFlow
and Keras only, and installs the library's Keras hooks (`accumulator.hooks`) unless
ACCUMULATOR_KERAS_HOOKS=0 is set.
"""

if __name__ != "tfx_gradient_accumulator.accumulator":   # `import accumulator` from a checkout's root: a second copy
    raise ImportError(f"`import {__name__}` would load the library a second time under another name; "
                      "import tfx_gradient_accumulator.accumulator instead.")

from tfx_gradient_accumulator.accumulator import flavours, hooks
from tfx_gradient_accumulator.accumulator import noise_scale  # noqa: F401  (accumulator.noise_scale.* after `import accumulator`)
from tfx_gradient_accumulator.accumulator.distribute import strategy_from_environment
from tfx_gradient_accumulator.accumulator.noise_scale import NoiseScaleEstimate
from tfx_gradient_accumulator.accumulator.options import WindowOptions, validate_accum_steps
from tfx_gradient_accumulator.accumulator.window import AccumulationWindow

if flavours.keras_is_3():
    from tfx_gradient_accumulator.accumulator import callbacks  # noqa: F401  (accumulator.callbacks.* after `import accumulator`)
    from tfx_gradient_accumulator.accumulator.batch_norm import AccumBatchNormalization, use_accumulated_batch_norm
    from tfx_gradient_accumulator.accumulator.auto_batch import AutoAccumulation
    from tfx_gradient_accumulator.accumulator.callbacks import AccumulationSchedule, EpochWindows
    from tfx_gradient_accumulator.accumulator.gradient_cache import GradientCache
    from tfx_gradient_accumulator.accumulator.micro_batch import MicroBatchFit, find_micro_batch
    from tfx_gradient_accumulator.accumulator.out_of_memory import (
        MicroBatchSwitch, RecoveredFit, fit_with_out_of_memory_recovery)
    from tfx_gradient_accumulator.accumulator.optimizer import GradientAccumulator
else:
    # TF <= 2.15: `keras` is Keras 2. The Keras 3 features (AccumBatchNormalization,
    # the TFX and KerasTuner helpers) are absent; accumulation is whole.
    from tfx_gradient_accumulator.accumulator import callbacks  # noqa: F401
    from tfx_gradient_accumulator.accumulator.auto_batch import AutoAccumulation
    from tfx_gradient_accumulator.accumulator.callbacks import AccumulationSchedule, EpochWindows
    from tfx_gradient_accumulator.accumulator.keras2 import GradientAccumulator
    from tfx_gradient_accumulator.accumulator.keras2.gradient_cache import GradientCache

hooks.install_unless_opted_out()


def __getattr__(name):
    # Imported on first use, so `python -m tfx_gradient_accumulator.accumulator.check` runs the module once.
    if name == "check_exact":
        from tfx_gradient_accumulator.accumulator.check import check_exact
        return check_exact
    raise AttributeError(f"module 'tfx_gradient_accumulator.accumulator' has no attribute {name!r}")


__all__ = [
    "AccumulationSchedule",
    "AccumulationWindow",
    "AutoAccumulation",
    "EpochWindows",
    "GradientAccumulator",
    "GradientCache",
    "NoiseScaleEstimate",
    "check_exact",
    "noise_scale",
    "strategy_from_environment",
    "WindowOptions",
    "validate_accum_steps",
]
if flavours.keras_is_3():
    __all__ += ["AccumBatchNormalization", "MicroBatchFit", "MicroBatchSwitch", "RecoveredFit", "find_micro_batch",
                "fit_with_out_of_memory_recovery", "use_accumulated_batch_norm"]
__version__ = "0.4.0"
