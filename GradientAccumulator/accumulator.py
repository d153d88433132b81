"""`from GradientAccumulator.accumulator import GradientAccumulator`, as in the seed project."""

from accumulator import GradientAccumulator  # noqa: F401

__all__ = ["GradientAccumulator"]
