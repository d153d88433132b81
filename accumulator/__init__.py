"""Exact gradient accumulation for TensorFlow 2 / Keras 3 and Keras 2: the library's public names.

`GradientAccumulator(optimizer, accum_steps)` wraps any Keras optimizer so that training
with micro-batches follows the run with the `accum_steps`-times larger batch;
`GradientCache(model, accum_steps)` does it for losses that couple the batch. Each makes
the class of the Keras its argument belongs to. Importing the package imports TensorFlow
and Keras only, and installs the library's Keras hooks (`accumulator.hooks`) unless
ACCUMULATOR_KERAS_HOOKS=0 is set.

The library's rooms are its sub-packages, each with the list of rooms it may import in its
own docstring: `core`, `rows`, `noise`, `window`, `schedules`, `cache`, `batch`, `keras2`,
then the public fronts at this level (`optimizer`, `gradient_cache`, `batch_norm`,
`hooks`, `fit_hook`, `autowrap`, `tuning`), then `check`, built on those fronts. This
file, the package's face, imports what it re-exports.

May import: core, rows, noise, window, schedules, cache, batch, keras2.
"""

if __name__ != "tfx_gradient_accumulator.accumulator":   # `import accumulator` from a checkout's root: a second copy
    raise ImportError(f"`import {__name__}` would load the library a second time under another name; "
                      "import tfx_gradient_accumulator.accumulator instead.")

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

from tfx_gradient_accumulator.accumulator import hooks
from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.core.distribute import strategy_from_environment
from tfx_gradient_accumulator.accumulator.noise.noise_scale import NoiseScaleEstimate
from tfx_gradient_accumulator.accumulator.core.options import WindowOptions, validate_accum_steps
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow

if flavours.keras_is_3():
    from tfx_gradient_accumulator.accumulator.batch_norm import AccumBatchNormalization, use_accumulated_batch_norm
    from tfx_gradient_accumulator.accumulator.schedules.auto_batch import AutoAccumulation
    from tfx_gradient_accumulator.accumulator.schedules.callbacks import AccumulationSchedule, EpochWindows
    from tfx_gradient_accumulator.accumulator.gradient_cache import GradientCache
    from tfx_gradient_accumulator.accumulator.batch.micro_batch import MicroBatchFit, find_micro_batch
    from tfx_gradient_accumulator.accumulator.batch.out_of_memory import (
        MicroBatchSwitch, RecoveredFit, fit_with_out_of_memory_recovery)
    from tfx_gradient_accumulator.accumulator.optimizer import GradientAccumulator
else:
    # TF <= 2.15: `keras` is Keras 2. The Keras 3 features (AccumBatchNormalization,
    # the TFX and KerasTuner helpers) are absent; accumulation is whole.
    from tfx_gradient_accumulator.accumulator.schedules.auto_batch import AutoAccumulation
    from tfx_gradient_accumulator.accumulator.schedules.callbacks import AccumulationSchedule, EpochWindows
    from tfx_gradient_accumulator.accumulator.keras2 import GradientAccumulator
    from tfx_gradient_accumulator.accumulator.keras2.gradient_cache import GradientCache

hooks.install_unless_opted_out()


# The modules that moved into the rooms (version 0.5), by their old name: the old path
# (`tfx_gradient_accumulator.accumulator.options`) still imports, as the module at its new
# path (`...accumulator.core.options`, the same module object), with a FutureWarning naming it.
MOVED_MODULES = {
    **dict.fromkeys(("flavours", "seam", "_tf", "validation", "refusals", "options", "distribute", "replicas",
                     "loss_scaling"), "core"),
    **dict.fromkeys(("lookups", "window_rows", "row_room"), "rows"),
    **dict.fromkeys(("noise_scale", "window_noise", "preconditioning"), "noise"),
    **dict.fromkeys(("window_saving", "weighting", "forwarding", "custom_loop", "loop_notes"), "window"),
    **dict.fromkeys(("callbacks", "auto_batch", "batch_target", "lr_scaling"), "schedules"),
    **dict.fromkeys(("cache_passes", "across_replicas", "contrastive"), "cache"),
    **dict.fromkeys(("fit_micro_batches", "micro_batch", "micro_batch_workers", "micro_batch_changes",
                     "out_of_memory", "fit_auto_micro_batch", "backup"), "batch"),
    **dict.fromkeys(("check_arbiter", "check_arguments", "check_compare", "check_report", "check_runs"), "check"),
}


def _moved_module(old_name):
    """The module an old path names, imported at its new path, with a warning that names it."""
    new_name = f"{__name__}.{MOVED_MODULES[old_name]}.{old_name}"
    warnings.warn(f"`{__name__}.{old_name}` is now `{new_name}`; import it from there "
                  "(the old path will be removed).", FutureWarning, stacklevel=3)
    return importlib.import_module(new_name)


class _OldModulePaths(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """`import tfx_gradient_accumulator.accumulator.<old name>`: the moved module, under both names."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        return importlib.util.spec_from_loader(fullname, self) if package == __name__ and name in MOVED_MODULES else None

    def create_module(self, spec):
        return _moved_module(spec.name.rpartition(".")[2])

    def exec_module(self, module):
        pass   # already run at its new path


if not any(isinstance(finder, _OldModulePaths) for finder in sys.meta_path):
    sys.meta_path.append(_OldModulePaths())


def __getattr__(name):
    # Imported on first use, so `python -m tfx_gradient_accumulator.accumulator.check` runs the module once.
    if name == "check_exact":
        from tfx_gradient_accumulator.accumulator.check import check_exact
        return check_exact
    if name in MOVED_MODULES:     # `accumulator.callbacks.EpochWindows`, as before the rooms
        return importlib.import_module(f"{__name__}.{name}")
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
__version__ = "0.5.0"
