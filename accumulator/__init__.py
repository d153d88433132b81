"""Exact gradient accumulation for TensorFlow 2 / Keras 3.

`GradientAccumulator(optimizer, accum_steps)` wraps any Keras 3 optimizer so that
training with micro-batches follows the run with the `accum_steps`-times larger
batch.

Importing this package imports TensorFlow and Keras only (`accumulator.tuning`,
imported on its own, needs keras-tuner), and installs the library's Keras hooks
(`accumulator.seam`: `keras.Model.fit` and `compute_loss`, and two multi-worker
fixes), unless the environment variable ACCUMULATOR_KERAS_HOOKS=0 is set;
`accumulator.seam.uninstall()` removes them.
"""

from accumulator import seam
from accumulator import callbacks  # noqa: F401  (accumulator.callbacks.* after `import accumulator`)
from accumulator import noise_scale  # noqa: F401  (accumulator.noise_scale.* after `import accumulator`)
from accumulator.batch_norm import AccumBatchNormalization, use_accumulated_batch_norm
from accumulator.callbacks import AccumulationSchedule, EpochWindows
from accumulator.distribute import strategy_from_environment
from accumulator.noise_scale import NoiseScaleEstimate
from accumulator.optimizer import GradientAccumulator, validate_accum_steps

seam.install_unless_opted_out()

__all__ = [
    "AccumBatchNormalization",
    "AccumulationSchedule",
    "EpochWindows",
    "GradientAccumulator",
    "NoiseScaleEstimate",
    "noise_scale",
    "use_accumulated_batch_norm",
    "strategy_from_environment",
    "validate_accum_steps",
]
__version__ = "0.2.0"
