"""tfx-gradient-accumulator: exact gradient accumulation for TensorFlow 2 / Keras, and a
TFX Trainer that uses it.

Everything the distribution installs lives under this one package, so a project's own
`components/`, `pipelines/` or `accumulator` module cannot shadow it, nor it theirs:

* `from tfx_gradient_accumulator import GradientAccumulator, GradientCache`: the
  library (`tfx_gradient_accumulator.accumulator`; every name of its `__all__` is
  here too). Importing it imports TensorFlow and Keras, not TFX.
* `from tfx_gradient_accumulator.components import AccumulatingTrainer`: the TFX
  Trainer component (needs the `tfx` extra).
* `tfx_gradient_accumulator.pipelines`: the demo pipelines
  (`python -m tfx_gradient_accumulator.pipelines.run_local`).
"""

from tfx_gradient_accumulator import accumulator as _library
from tfx_gradient_accumulator.accumulator import __all__, __version__  # noqa: F401


def __getattr__(name):
    # The library's names, read on first use (`check_exact` stays lazy there, so
    # `python -m tfx_gradient_accumulator.accumulator.check` runs its module once).
    if name in __all__:
        return getattr(_library, name)
    raise AttributeError(f"module 'tfx_gradient_accumulator' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
