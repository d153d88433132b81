"""The Keras 2 classes (`tf_keras`, or `tf.keras` on TF <= 2.15); imported only where Keras 2 is installed.

`optimizer` (`GradientAccumulator`), `gradient_cache` (`GradientCache`) and `task_cache`
(a TensorFlow Recommenders model's task). The public names make these classes themselves
(`accumulator.core.flavours`); their `__module__` is this package, where users name them. They stand on the same
rooms as the Keras 3 classes; the public fronts (`accumulator.optimizer`,
`accumulator.gradient_cache`) make them, never the other way round.

May import: core, rows, noise, window, schedules, cache, batch.
"""

from tfx_gradient_accumulator.accumulator.keras2.optimizer import (
    AccumulationSchedule, EpochWindows, GradientAccumulator, LossScalingGradientAccumulator, keras2,
)

GradientAccumulator.__module__ = LossScalingGradientAccumulator.__module__ = __name__

__all__ = ["AccumulationSchedule", "EpochWindows", "GradientAccumulator", "LossScalingGradientAccumulator"]
