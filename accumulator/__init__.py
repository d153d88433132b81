"""Exact gradient accumulation for TensorFlow 2 / Keras 3.

`GradientAccumulator(optimizer, accum_steps)` wraps any Keras 3 optimizer so that
training with micro-batches follows the run with the `accum_steps`-times larger
batch. This package imports neither TFX nor anything beyond TensorFlow and Keras.
"""

from accumulator.batch_norm import AccumBatchNormalization, use_accumulated_batch_norm
from accumulator.compat import apply_keras_multiworker_fixes
from accumulator.distribute import strategy_from_environment
from accumulator.optimizer import GradientAccumulator, validate_accum_steps

__all__ = [
    "AccumBatchNormalization",
    "GradientAccumulator",
    "use_accumulated_batch_norm",
    "apply_keras_multiworker_fixes",
    "strategy_from_environment",
    "validate_accum_steps",
]
__version__ = "0.1.0"
