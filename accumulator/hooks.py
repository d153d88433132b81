"""Everything the library changes in Keras at run time, and when: the one place.

A change to Keras' behaviour is a design decision; these are all of them.
Models compiled with any other optimizer than a `GradientAccumulator` train
exactly as without the library (tested).

1. **At `import accumulator`**, `install()` wraps, once:

   * ``"fit"``: `keras.Model.fit`. For a model compiled with a
     `GradientAccumulator` it refuses, before training, a `LossScaleOptimizer`
     that Keras put around the accumulator and XLA under a multi-replica
     strategy, ties `AccumBatchNormalization` layers to the optimizer, and puts
     the `EpochWindows` callback first, so windows close at epoch ends
     (`accumulator.fit_hook`).
   * ``"compute_loss"``: `keras.Model.compute_loss`. On training batches of such
     a model it notes the loss's denominator: the micro-batch's weight
     (`accumulator.weighting`).
   * ``"symbolic_build"``, ``"scalar_logs"``: the two Keras functions that stop
     `fit` under `MultiWorkerMirroredStrategy` (keras-team/keras#20585; private
     names, so they come from `accumulator.seam.multiworker_fixes()`). Each is a
     no-op under any other strategy.
   * ``"keras2_fit"``, ``"keras2_compute_loss"``: where Keras 2 is installed
     (`tf_keras`, or TF 2.15's `keras`), its `Model.fit` and `Model.compute_loss`,
     the same way.

   `uninstall()` restores the originals; the environment variable
   ``ACCUMULATOR_KERAS_HOOKS=0``, set before the import, skips the installation.
2. **While `accumulator.autowrap.accumulating_compile` is open** (the TFX
   executor, the KerasTuner helpers), `swapped` makes `keras.Model.compile` (and
   Keras 2's) wrap the optimizers it is given and, given a strategy,
   `strategy_scopes_map_onto` maps every strategy's scope onto it; given a
   `TrainingBackup`, `fits_backed_up` makes `keras.Model.fit` back up and
   resume (`accumulator.backup`; Keras 2's `fit` too). All are
   restored when the context closes. (The TFX Trainer's own changes while it
   runs a run_fn are `components.run_fn_swaps`.)
3. **While a window's update is traced under a strategy**, the inner optimizer
   *instance* does not all-reduce the gradients it is handed
   (`accumulator.seam.gradients_already_reduced`: a private name).
"""

import contextlib
import functools
import inspect
import logging
import os

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import fit_hook, flavours, seam, weighting

logger = logging.getLogger(__name__)

HOOKS_ENV = "ACCUMULATOR_KERAS_HOOKS"
HOOKS = ("fit", "compute_loss", "symbolic_build", "scalar_logs", "keras2_fit", "keras2_compute_loss")

# What restores each function `install()` replaced, by label.
_restorers = {}


# ------------------------------------------------------- the import-time hooks
def install(hooks=HOOKS):
    """Installs the named hooks (all by default; idempotent); returns those now installed."""
    unknown = set(hooks) - set(HOOKS)
    if unknown:
        raise ValueError(f"`hooks` must be a subset of {HOOKS}; unknown: {sorted(unknown)}.")
    targets = _targets()
    for label in hooks:
        if label not in targets:
            continue        # no such Keras installed (Keras 2 hooks without tf_keras)
        owner, name, _ = targets[label]
        if not hasattr(owner, name):
            # Not in this Keras (`_maybe_symbolic_build` came with 3.5): nothing to fix.
            continue
        if label not in _restorers:
            _restorers[label] = replace(*targets[label])
    return installed_hooks()


def installed_hooks():
    """The labels of the hooks installed now, sorted."""
    return sorted(_restorers)


def uninstall():
    """Restores every function `install()` replaced."""
    for restore in _restorers.values():
        restore()
    _restorers.clear()


def install_unless_opted_out():
    """What `import accumulator` does: `install()`, unless ACCUMULATOR_KERAS_HOOKS=0."""
    if os.environ.get(HOOKS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("%s=%s: accumulator installs no Keras hooks.", HOOKS_ENV, os.environ[HOOKS_ENV])
        return []
    return install()


def _targets():
    targets = {}
    if flavours.keras_is_3():
        targets.update({
            "fit": (keras.Model, "fit", _make_fit),
            "compute_loss": (keras.Model, "compute_loss", _make_compute_loss),
        })
        targets.update(seam.multiworker_fixes())
    keras2 = flavours.keras2_module()
    if keras2 is not None:
        targets.update({
            "keras2_fit": (keras2.Model, "fit", _make_fit),
            "keras2_compute_loss": (keras2.Model, "compute_loss", _make_compute_loss),
        })
    return targets


def _make_fit(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["callbacks"] = fit_hook.before_fit(self, bound.arguments.get("callbacks"),
                                                            dict(bound.arguments))
        return original(*bound.args, **bound.kwargs)

    fit.accumulator_hook = True     # the optimizer asks, to warn when it is missing
    return fit


def _make_compute_loss(original):
    @functools.wraps(original)
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, *args, **kwargs):
        training = args[0] if args else kwargs.get("training", True)
        if training:
            weighting.note_batch(self, x, y, y_pred, sample_weight)
        return original(self, x, y, y_pred, sample_weight, *args, **kwargs)

    return compute_loss


# ------------------------------------------------------------- scoped changes
def replace(owner, name, make_replacement):
    """Sets `owner.name = make_replacement(original)`; returns the function that restores it.

    Restores exactly what was there: an attribute `owner` inherited is deleted
    again rather than copied down.
    """
    had_own = name in vars(owner)
    own = vars(owner).get(name)
    setattr(owner, name, make_replacement(getattr(owner, name)))

    def restore():
        if had_own:
            setattr(owner, name, own)
        else:
            delattr(owner, name)

    return restore


@contextlib.contextmanager
def swapped(owner, name, make_replacement):
    """`owner.name` is `make_replacement(original)` inside the context, restored after."""
    restore = replace(owner, name, make_replacement)
    try:
        yield
    finally:
        restore()


@contextlib.contextmanager
def fits_backed_up(backup):
    """Context: `keras.Model.fit` (and Keras 2's) runs through `backup.fit` (backed up,
    resumed from its latest backup)."""

    def make(original):
        signature = inspect.signature(inspect.unwrap(original))     # Keras' own parameters

        @functools.wraps(original)
        def fit(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
            arguments.update(arguments.pop("kwargs", None) or {})
            return backup.fit(original, self, arguments)

        return fit

    with contextlib.ExitStack() as stack:
        stack.enter_context(swapped(keras.Model, "fit", make))
        keras2 = flavours.keras2_module()
        if keras2 is not None and keras2.Model is not keras.Model:
            stack.enter_context(swapped(keras2.Model, "fit", make))
        yield


def strategy_scopes_map_onto(strategy):
    """Context: every `tf.distribute.Strategy.scope()` opens `strategy`'s scope instead."""

    def make(original):
        def scope(self):
            if self is not strategy:
                logger.warning(
                    "run_fn opened the scope of its own %s; it trains under the "
                    "executor's %s (%d replicas) instead.",
                    type(self).__name__, type(strategy).__name__, strategy.num_replicas_in_sync,
                )
            return original(strategy)

        return scope

    return swapped(tf.distribute.Strategy, "scope", make)
