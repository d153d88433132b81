"""Everything the library changes in Keras at run time, and when: the one place.

Models compiled with any optimizer other than a `GradientAccumulator` train exactly as
without the library. The changes: (1) at import, `install()` wraps `Model.fit` and
`Model.compute_loss` of each installed Keras, Keras 3's `Model.get_weights`, `save` and
`save_weights` (a custom loop's open window is told of first), Keras 3's `compile` (a mixed_float16
model's loss scaling goes inside the accumulator), Keras 3's `train_step` and
`make_train_function` (`micro_batch_size`: the batch split inside the step; with "auto", the
batch fetched before the compiled step, to be trained again after an out-of-memory error),
Keras 2's `train_step` and `make_train_function` (the same two, where Keras 2 is installed),
and two Keras 3 functions that stop `fit`
under `MultiWorkerMirroredStrategy` (`uninstall()` restores them; `ACCUMULATOR_KERAS_HOOKS=0`
skips them); (2) while `accumulating_compile` is open, `Model.compile` wraps optimizers,
and, when asked, `fit` backs up and strategy scopes map onto one strategy; (3) while a
window's update is traced under a strategy, the inner optimizer does not all-reduce the
gradients it is handed again.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
from typing import TYPE_CHECKING

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import fit_hook
from tfx_gradient_accumulator.accumulator.batch import fit_auto_micro_batch, fit_micro_batches
from tfx_gradient_accumulator.accumulator.core import flavours, loss_scaling, seam
from tfx_gradient_accumulator.accumulator.window import loop_notes, weighting
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

    from tfx_gradient_accumulator.accumulator.batch.backup import TrainingBackup

logger = logging.getLogger(__name__)

HOOKS_ENV = "ACCUMULATOR_KERAS_HOOKS"
HOOKS = ("fit", "compute_loss", "compile", "symbolic_build", "scalar_logs", "get_weights", "save", "save_weights",
         "fit_micro_batches", "fit_auto_micro_batch",
         "keras2_fit", "keras2_compute_loss", "keras2_get_weights", "keras2_save", "keras2_save_weights",
         "keras2_fit_micro_batches", "keras2_fit_auto_micro_batch", "keras2_compile")

# What restores each function `install()` replaced, by label.
_restorers = {}


# ------------------------------------------------------- the import-time hooks
def install(hooks: Iterable[str] = HOOKS) -> list[str]:
    """Installs the named hooks (all by default); installing one twice changes nothing.

    The hooks, by label:

    * `"fit"`: `keras.Model.fit`. For a model compiled with a `GradientAccumulator`
      it refuses, before training, a `LossScaleOptimizer` put around the
      accumulator (one the user wrote, or one that `"compile"` could not move) and XLA under a multi-replica strategy, ties
      `AccumBatchNormalization` layers to the optimizer, and puts the `EpochWindows`
      callback first, so windows close at epoch ends.
    * `"compute_loss"`: `keras.Model.compute_loss`. On training batches of such a
      model it notes the loss's denominator: the micro-batch's weight.
    * `"compile"`: Keras 3's `Model.compile` (where Keras defines it, so that
      `load_model` still compiles). Under mixed_float16 it puts the
      `LossScaleOptimizer` Keras put around a `GradientAccumulator` inside it
      (`_make_compile` says why); `model.optimizer` stays the accumulator given.
    * `"fit_micro_batches"`: Keras 3's `train_step` (the TensorFlow trainer's). For a
      model whose `GradientAccumulator` has `micro_batch_size`, the step of
      `accumulator.batch.fit_micro_batches` (the batch as one update, trained in
      micro-batches inside the step); Keras' own step for every other model.
    * `"fit_auto_micro_batch"`: Keras 3's `make_train_function` (the TensorFlow
      trainer's). For a model whose `GradientAccumulator` has `micro_batch_size="auto"`,
      `accumulator.batch.fit_auto_micro_batch.train_function`: the batch taken from the
      iterator eagerly, then a compiled step per micro-batch size, so a step that runs
      out of memory trains the same batch again at a smaller one; Keras' own for every
      other model.
    * `"symbolic_build"`, `"scalar_logs"`: the two Keras functions that stop `fit`
      under `MultiWorkerMirroredStrategy` (keras-team/keras#20585); each is a no-op
      under any other strategy.
    * `"get_weights"`, `"save"`, `"save_weights"`: `keras.Model`'s. Before reading the
      weights they ask `loop_notes.note_model_read`, which warns once per optimizer
      whose custom loop left a window open over the model's variables (its
      micro-batches are not in what is read); they change nothing else.
    * `"keras2_fit"`, `"keras2_compute_loss"`, `"keras2_get_weights"`, `"keras2_save"`,
      `"keras2_save_weights"`, `"keras2_fit_micro_batches"` (its `train_step`),
      `"keras2_fit_auto_micro_batch"` (its `make_train_function`:
      `accumulator.keras2.fit_auto_micro_batch.train_function` for an "auto" model),
      `"keras2_compile"` (under mixed_float16, the `LossScaleOptimizer` Keras 2's `compile`
      put around a `GradientAccumulator` with `micro_batch_size` taken inside it at once:
      `_make_keras2_compile`): where Keras 2 is installed (`tf_keras`, or TF 2.15's
      `keras`), its `Model`'s, the same way.

    A hook whose Keras or function is absent here is skipped.

    Args:
        hooks: labels from `HOOKS`.

    Returns:
        The labels of the hooks installed now, sorted.

    Raises:
        ValueError: a label is not in `HOOKS`.
    """
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


def installed_hooks() -> list[str]:
    """The labels of the hooks installed now, sorted."""
    return sorted(_restorers)


def uninstall() -> None:
    """Restores every function `install()` replaced."""
    for restore in _restorers.values():
        restore()
    _restorers.clear()


def install_unless_opted_out() -> list[str]:
    """What `import accumulator` does: `install()`, unless ACCUMULATOR_KERAS_HOOKS=0."""
    if os.environ.get(HOOKS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("%s=%s: accumulator installs no Keras hooks.", HOOKS_ENV, os.environ[HOOKS_ENV])
        return []
    return install()


def _targets():
    """`{label: (owner, name, make_replacement)}` for the hooks this installation can take."""
    targets = {}
    if flavours.keras_is_3():
        targets.update({
            "fit": (keras.Model, "fit", _make_fit),
            "compute_loss": (keras.Model, "compute_loss", _make_compute_loss),
            "compile": (_compile_owner(), "compile", _make_compile),
            "get_weights": (keras.Model, "get_weights", functools.partial(_make_model_read, saving=False)),
            "save": (keras.Model, "save", functools.partial(_make_model_read, saving=True)),
            "save_weights": (keras.Model, "save_weights", functools.partial(_make_model_read, saving=True)),
            "fit_micro_batches": (seam.train_step_owner(), "train_step", _make_train_step),
            "fit_auto_micro_batch": (seam.train_step_owner(), "make_train_function", _make_make_train_function),
        })
        targets.update(seam.multiworker_fixes())
    keras2 = flavours.keras2_module()
    if keras2 is not None:
        targets.update({
            "keras2_fit": (keras2.Model, "fit", _make_fit),
            "keras2_compute_loss": (keras2.Model, "compute_loss", _make_compute_loss),
            "keras2_get_weights": (keras2.Model, "get_weights", functools.partial(_make_model_read, saving=False)),
            "keras2_save": (keras2.Model, "save", functools.partial(_make_model_read, saving=True)),
            "keras2_save_weights": (keras2.Model, "save_weights", functools.partial(_make_model_read, saving=True)),
            "keras2_fit_micro_batches": (keras2.Model, "train_step", _make_keras2_train_step),
            "keras2_fit_auto_micro_batch": (keras2.Model, "make_train_function", _make_keras2_make_train_function),
            "keras2_compile": (keras2.Model, "compile", _make_keras2_compile),
        })
    return targets


def _make_fit(original):
    """`Model.fit` that first runs `fit_hook.before_fit` (its callbacks, its refusals)."""
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
    """`Model.compute_loss` that notes a training batch's weight (`weighting.note_batch`)."""
    @functools.wraps(original)
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, *args, **kwargs):
        training = args[0] if args else kwargs.get("training", True)
        if training:
            weighting.note_batch(self, x, y, y_pred, sample_weight)
        return original(self, x, y, y_pred, sample_weight, *args, **kwargs)

    return compute_loss


def _make_train_step(original):
    """Keras 3's `train_step`, in micro-batches for a model whose optimizer has `micro_batch_size`."""
    @functools.wraps(original)
    def train_step(self, data):
        if fit_micro_batches.micro_batch_size_of(self) is None:
            return original(self, data)
        return fit_micro_batches.train_step(self, data)

    train_step.accumulator_hook = True
    return train_step


def _make_make_train_function(original):
    """Keras 3's `make_train_function`, whose function trains a batch again at a smaller
    micro-batch after an out-of-memory error for a `micro_batch_size="auto"` model."""
    @functools.wraps(original)
    def make_train_function(self, force=False):
        if not fit_auto_micro_batch.is_auto(self):
            return original(self, force)
        if self.train_function is None or force:
            fit_auto_micro_batch.refuse_unsupported(self)
            self.train_function = fit_auto_micro_batch.train_function(self)
        return self.train_function

    return make_train_function


def _make_keras2_train_step(original):
    """Keras 2's `train_step`, in micro-batches for a model whose optimizer has `micro_batch_size`
    (`accumulator.keras2.fit_micro_batches`, imported only where Keras 2 is installed)."""
    from tfx_gradient_accumulator.accumulator.keras2 import fit_micro_batches as keras2_fit_micro_batches

    @functools.wraps(original)
    def train_step(self, data):
        if fit_micro_batches.micro_batch_size_of(self) is None:
            return original(self, data)
        return keras2_fit_micro_batches.train_step(self, data)

    train_step.accumulator_hook = True
    return train_step


def _make_keras2_compile(original):
    """Keras 2's `Model.compile`, then, for a `GradientAccumulator` with `micro_batch_size` that
    Keras 2 put inside a `LossScaleOptimizer` (mixed_float16: it wraps any optimizer, with no
    switch to stop it), the scaling taken inside the accumulator
    (`accumulator.keras2.micro_batch_scaling.take_loss_scaling_inside`): `model.optimizer` is the
    accumulator given, and `train_on_batch` trains in micro-batches as `fit` does (`fit` takes it
    inside too, for a model compiled before the hooks). Every other model: Keras 2's own."""
    from tfx_gradient_accumulator.accumulator.keras2 import micro_batch_scaling

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        compiled = original(self, *args, **kwargs)
        micro_batch_scaling.take_loss_scaling_inside(self)
        return compiled

    return compile


def _make_keras2_make_train_function(original):
    """Keras 2's `make_train_function`, whose function takes the batch before the compiled step, to
    train it again at a smaller micro-batch after an out-of-memory error, for a
    `micro_batch_size="auto"` model (`accumulator.keras2.fit_auto_micro_batch`, imported only where
    Keras 2 is installed); Keras 2's own for every other model."""
    from tfx_gradient_accumulator.accumulator.keras2 import fit_auto_micro_batch as keras2_fit_auto_micro_batch
    from tfx_gradient_accumulator.accumulator.keras2 import fit_micro_batches as keras2_fit_micro_batches

    @functools.wraps(original)
    def make_train_function(self, force=False):
        if not fit_auto_micro_batch.is_auto(self):
            return original(self, force)
        if self.train_function is None or force:
            # Here too, not only at `fit`: `train_on_batch` makes the function without `fit`'s hook.
            keras2_fit_auto_micro_batch.refuse_unsupported(self)
            keras2_fit_micro_batches.refuse_unsupported(self)
            self.train_function = keras2_fit_auto_micro_batch.train_function(self)
        return self.train_function

    make_train_function.accumulator_hook = True     # `refuse_unsupported` asks
    return make_train_function


def _make_model_read(original, saving):
    """A `Model` method that reads the weights (`get_weights`; `save`, `save_weights`: `saving`),
    told first of a custom loop's open window over them (`loop_notes.note_model_read`)."""
    @functools.wraps(original)
    def read(self, *args, **kwargs):
        loop_notes.note_model_read(self, saving)
        return original(self, *args, **kwargs)

    return read


def _compile_owner():
    """The class that defines Keras 3's `Model.compile` (its `Trainer`).

    Replaced there, not on `keras.Model`: `compile_from_config` (what `load_model`
    calls) compiles only a model whose `compile` is that class's own."""
    return next(c for c in keras.Model.__mro__ if "compile" in vars(c))


def _make_compile(original):
    """Keras 3's `compile` that keeps a mixed_float16 model's loss scaling inside its
    `GradientAccumulator`.

    Why: with `auto_scale_loss=True` (the default) and the mixed_float16 policy,
    Keras' `compile` puts a `LossScaleOptimizer` around any optimizer, ours too.
    Around the accumulator it would unscale and check each micro-batch alone: a
    micro-batch with an overflow would be dropped while the rest of its window is
    applied, and the scale would move per micro-batch; the large batch instead
    skips its whole step and moves the scale once. So when Keras wrapped the
    accumulator the user gave, the accumulator takes the loss scaling over
    (`GradientAccumulator.take_loss_scaling_from`: `LossScaleOptimizer(inner)` with
    Keras' settings) and `model.optimizer` goes back to the accumulator: the same
    training as the explicit `GradientAccumulator(LossScaleOptimizer(inner))` with
    `auto_scale_loss=False`. Its config then holds the `LossScaleOptimizer`, so a
    saved model loads as that explicit form. A `LossScaleOptimizer(GradientAccumulator(...))`
    the user wrote is left as written (`fit` refuses it, saying what to write), as
    is a wrapped accumulator built without loss scaling (its variables are fixed).
    """
    signature = inspect.signature(original)

    @functools.wraps(original)
    def compile(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        given = signature.bind(self, *args, **kwargs).arguments.get("optimizer")
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and given is not optimizer and \
                given is optimizer.inner_optimizer and isinstance(given, AccumulationWindow) and \
                given.take_loss_scaling_from(optimizer, loss_scaling.float16_layers(self)):
            self.optimizer = given
        elif isinstance(optimizer, AccumulationWindow) and getattr(optimizer, "loss_scale_optimizer", None) \
                is not None and not flavours.is_keras2_object(optimizer):
            optimizer.take_loss_scaling_from(optimizer.loss_scale_optimizer, loss_scaling.float16_layers(self))
        return result

    return compile


# ------------------------------------------------------------- scoped changes
def replace(owner: type, name: str, make_replacement: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Sets `owner.name = make_replacement(original)`.

    Args:
        owner: the class (or module) whose attribute is replaced.
        name: the attribute's name.
        make_replacement: takes the original, returns its replacement.

    Returns:
        The function that restores exactly what was there: an attribute `owner`
        inherited is deleted again rather than copied down.
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
def swapped(owner: type, name: str, make_replacement: Callable[[Callable], Callable]) -> Iterator[None]:
    """Context: `owner.name` is `make_replacement(original)` inside, restored after.

    Args:
        owner: the class (or module) whose attribute is replaced.
        name: the attribute's name.
        make_replacement: takes the original, returns its replacement.
    """
    restore = replace(owner, name, make_replacement)
    try:
        yield
    finally:
        restore()


@contextlib.contextmanager
def fits_backed_up(backup: TrainingBackup) -> Iterator[None]:
    """Context: `keras.Model.fit` (and Keras 2's) runs through `backup.fit`.

    Args:
        backup: backs every `fit` up and resumes it from its latest backup.
    """

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


def strategy_scopes_map_onto(strategy: tf.distribute.Strategy) -> contextlib.AbstractContextManager:
    """Context: every `tf.distribute.Strategy.scope()` opens `strategy`'s scope instead.

    Args:
        strategy: the strategy every scope maps onto (a run_fn's own strategy, opened
            under it, logs a warning and trains under this one).

    Returns:
        The context manager.
    """

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
