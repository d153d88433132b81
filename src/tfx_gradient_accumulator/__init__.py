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

import importlib.util as _importlib_util

# The distribution requires no TensorFlow (an extra, or the user, chooses which one: setup.py
# says why), so an environment may hold none: say so here, before Keras or the library fail
# on `import tensorflow` deep inside. `find_spec` imports nothing.
if _importlib_util.find_spec("tensorflow") is None:
    raise ImportError(
        "tfx_gradient_accumulator needs TensorFlow 2.15 to 2.21, and none is installed. Install exactly one, "
        "for example with the package's extras: "
        'pip install "tfx-gradient-accumulator[cpu]" (tensorflow-cpu), '
        'pip install "tfx-gradient-accumulator[and-cuda]" (tensorflow with CUDA on Linux), '
        'pip install "tfx-gradient-accumulator[tensorflow]"; '
        "or pip install tensorflow-cpu (or tensorflow) beside it.",
        name="tensorflow")

from tfx_gradient_accumulator import accumulator as _library  # noqa: E402
from tfx_gradient_accumulator.accumulator import __all__, __version__  # noqa: F401


def __getattr__(name):
    # The library's names, read on first use (`check_exact` stays lazy there, so
    # `python -m tfx_gradient_accumulator.accumulator.check` runs its module once).
    if name in __all__:
        return getattr(_library, name)
    raise AttributeError(f"module 'tfx_gradient_accumulator' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
