"""The seed project's import path, for users who switch:
`from GradientAccumulator.accumulator import GradientAccumulator` keeps working
and gives `accumulator.GradientAccumulator` (Keras 2 or Keras 3, picked by the
optimizer it wraps). New code imports `accumulator` directly."""
