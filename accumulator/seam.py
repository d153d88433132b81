"""The one place where this library reaches past Keras' and TensorFlow's public API.

Everything else in `accumulator/` and `components/` uses public names only; a
test (`tests/accumulator/test_seam.py`) fails if a private name appears anywhere
else, and another fails, naming it, when one of those below disappears from the
installed Keras or TensorFlow. Checked on Keras 3.8.0 + TF 2.16.2 (the oldest
supported pair), Keras 3.15.1 + TF 2.16.2 (the TFX 1.16 stack) and Keras 3.15.1
+ TF 2.21.0 (the newest), all run by `make test`.

Private names (`PRIVATE_NAMES` lists them for the test):

* ``keras.optimizers.Optimizer._all_reduce_sum_gradients`` (Keras >= 3.2, TF
  backend): Keras' optimizers all-reduce the gradients they are given. The
  accumulator reduces the window's sums itself, once per window, and must hand
  the reduced gradient to the inner optimizer without a second reduction; it
  replaces the method on the inner optimizer *instance* while the window update
  is traced (`gradients_already_reduced`), and removes it afterwards.
* ``tf.__internal__.distribute.strategy_supports_no_merge_call``: tells whether
  the replica context runs without `merge_call` (XLA-compiled steps on GPUs),
  where Keras' optimizers cannot count updates (keras-team/keras#17187).
* ``tensorflow.python.ops.control_flow_util.GraphOrParentsInXlaContext``: tells
  whether the step is being compiled by XLA (`jit_compile=True`), so a
  multi-replica window update refuses it with a message instead of a raw error.
* ``keras.layers.Layer._flatten_layers``: every nested layer of a model, to find
  its `AccumBatchNormalization` layers (Keras has no public recursive walk).
* ``keras.layers.BatchNormalization._moments``: the batch moments Keras' own
  layer normalizes with (masks, `synchronized`); `AccumBatchNormalization`
  pools exactly those.
* ``keras.src.backend.tensorflow.trainer.TensorFlowTrainer._maybe_symbolic_build``
  and ``keras.src.backend.tensorflow.trainer.reduce_per_replica``: the two Keras
  functions that stop `fit` under `MultiWorkerMirroredStrategy`
  (keras-team/keras#20585); see "Run-time changes".

Run-time changes to Keras (the README lists them under "What the library changes
in Keras"):

Keras 2 (`tf_keras`, or TF 2.15's `keras`) needs no private name: its
optimizers take a public `skip_gradients_aggregation=True` (`accumulator.keras2`).
`keras2_module()` finds it; `keras_package_of()` tells which Keras an object
belongs to (public `__module__` and `__version__` only).

1. **At `import accumulator`**, `install()` wraps three Keras functions, once:
   `keras.Model.fit` (a model compiled with a `GradientAccumulator` gets the
   `EpochWindows` callback first in its list, so windows close at epoch ends;
   `fit` refuses, before training, a `LossScaleOptimizer` that Keras put around
   the accumulator and XLA under a multi-replica strategy), `keras.Model.compute_loss`
   (reports each training batch's loss denominator to the accumulator: the
   micro-batch weight; see `accumulator.weighting`), and, for
   `MultiWorkerMirroredStrategy`, the two multi-worker fixes above (each a
   no-op under any other strategy). Models compiled with any other optimizer
   are left alone. Where Keras 2 is installed, its `Model.fit` and
   `Model.compute_loss` get the same two wrappers ("keras2_fit",
   "keras2_compute_loss"). `uninstall()` restores the originals; setting the
   environment variable `ACCUMULATOR_KERAS_HOOKS=0` before the import skips
   the installation.
2. **While `accumulator.autowrap.accumulating_compile` is open** (the TFX
   executor and the KerasTuner helpers), `keras.Model.compile` (and Keras 2's,
   where installed) wraps the optimizers it is given, and, when given a strategy,
   `tf.distribute.Strategy.scope` maps every strategy's scope onto it. Both are
   restored when the context closes (`swapped`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import logging
import os
import sys
import threading

import keras
import tensorflow as tf

logger = logging.getLogger(__name__)

HOOKS_ENV = "ACCUMULATOR_KERAS_HOOKS"


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """One private Keras/TF name: where it lives, and what needs it."""

    module: str
    path: str
    needed_for: str
    since: tuple = (3, 0)      # the first Keras release that has it

    def expected(self, version=None):
        """Whether this Keras should have it."""
        return version_tuple(version or keras.__version__) >= self.since

    def resolve(self):
        """The object, or AttributeError/ImportError naming what is missing."""
        obj = importlib.import_module(self.module)
        for part in self.path.split("."):
            obj = getattr(obj, part)
        return obj

    def __str__(self):
        return f"{self.module}.{self.path}"


PRIVATE_NAMES = (
    PrivateName("keras", "optimizers.Optimizer._all_reduce_sum_gradients",
                "tf.distribute: one reduction per window", since=(3, 2)),
    PrivateName("tensorflow", "__internal__.distribute.strategy_supports_no_merge_call",
                "refusing XLA-compiled steps under a multi-replica strategy"),
    PrivateName("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext",
                "refusing XLA-compiled steps under a multi-replica strategy"),
    PrivateName("keras", "layers.Layer._flatten_layers", "finding AccumBatchNormalization layers"),
    PrivateName("keras", "layers.BatchNormalization._moments", "AccumBatchNormalization"),
    PrivateName("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._maybe_symbolic_build",
                "MultiWorkerMirroredStrategy fix (keras#20585)", since=(3, 5)),
    PrivateName("keras.src.backend.tensorflow.trainer", "reduce_per_replica",
                "MultiWorkerMirroredStrategy fix (keras#20585)"),
)


def version_tuple(text):
    """(major, minor) of a version string such as '3.15.1'."""
    return tuple(int(part) for part in text.split(".")[:2])


def keras_is_3():
    """Whether `import keras` is Keras 3 (False on TF <= 2.15, whose `keras` is Keras 2)."""
    return version_tuple(keras.__version__) >= (3, 0)


def keras2_module():
    """The Keras 2 package: `tf_keras` where installed (TF >= 2.16), else `keras`
    when it is Keras 2 (TF <= 2.15); None where there is none."""
    if not keras_is_3():
        return keras
    if importlib.util.find_spec("tf_keras") is None:
        return None
    return importlib.import_module("tf_keras")


def keras_package_of(obj):
    """The Keras package (`keras` or `tf_keras` module) that defines `obj`'s class, or None."""
    for klass in type(obj).__mro__:
        root = klass.__module__.split(".")[0]
        if root in ("keras", "tf_keras") and root in sys.modules:
            return sys.modules[root]
    return None


def is_keras2_object(obj):
    """Whether `obj` (an optimizer, a model) belongs to Keras 2."""
    package = keras_package_of(obj)
    return package is not None and not package.__version__.startswith("3.")


def tf_keras_is_keras2():
    """Whether `tf.keras` is Keras 2 (TF <= 2.15, or TF >= 2.16 imported with
    TF_USE_LEGACY_KERAS=1 and tf_keras installed): what TensorFlow decided at import."""
    return not keras_is_3() or str(getattr(tf.keras, "__version__", "3")).startswith("2.")


def missing_private_names():
    """`[(name, error)]` for the private names this Keras/TF lacks."""
    missing = []
    for name in PRIVATE_NAMES:
        if not name.expected():
            continue
        try:
            name.resolve()
        except (AttributeError, ImportError) as err:
            missing.append((name, err))
    return missing


# --------------------------------------------------------------- distribution
_ALL_REDUCE = "_all_reduce_sum_gradients"


def reduces_gradients_itself(optimizer):
    """Whether `optimizer` all-reduces the gradients it is given (Keras TF optimizers >= 3.2)."""
    return hasattr(optimizer, _ALL_REDUCE)


@contextlib.contextmanager
def gradients_already_reduced(optimizers):
    """Switches off the gradient all-reduce of each of `optimizers`, per instance."""
    optimizers = [o for o in optimizers if reduces_gradients_itself(o)]
    for o in optimizers:
        setattr(o, _ALL_REDUCE, _identity)
    try:
        yield
    finally:
        for o in optimizers:
            delattr(o, _ALL_REDUCE)


def _identity(grads_and_vars):
    return list(grads_and_vars)


def replica_context_lacks_merge_call():
    """True where tf.distribute runs replica functions without `merge_call` (XLA on GPUs)."""
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def in_xla_context():
    """True while the current function is being compiled by XLA (`jit_compile=True`)."""
    if tf.executing_eagerly():
        return False
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph())


def is_multi_worker(strategy):
    """A `MultiWorkerMirroredStrategy` that spans a cluster (public API only)."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return False
    resolver = strategy.cluster_resolver
    return bool(resolver is not None and resolver.cluster_spec().as_dict())


@contextlib.contextmanager
def variables_created_as(synchronization=None, aggregation=None, shape=None):
    """Keras variables made inside get these `tf.Variable` settings.

    Public TensorFlow (`tf.variable_creator_scope`), so it works on every Keras
    3 release, including those whose `keras.Variable` takes no
    `synchronization` (before 3.10) or `aggregation` (before 3.2). `shape`,
    with `None` in place of a dimension, makes a variable whose contents may
    change size along it (the accumulator's row buffers and lazily filled
    gradient buffers); Keras itself never passes one.
    """

    def creator(next_creator, **kwargs):
        if synchronization is not None:
            kwargs["synchronization"] = synchronization
        if aggregation is not None:
            kwargs["aggregation"] = aggregation
        if shape is not None:
            kwargs["shape"] = tf.TensorShape(shape)
        return next_creator(**kwargs)

    with tf.variable_creator_scope(creator):
        yield


# ---------------------------------------------------------------------- layers
def flatten_layers(model):
    """Every layer nested in `model` (not `model` itself)."""
    return list(model._flatten_layers(include_self=False))


def batch_norm_moments(layer, inputs, mask):
    """Mean and variance Keras' `BatchNormalization` would normalize `inputs` with."""
    return layer._moments(inputs, mask)


# ------------------------------------------------------------ scoped changes
def _replace(owner, name, make_replacement):
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
    restore = _replace(owner, name, make_replacement)
    try:
        yield
    finally:
        restore()


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


# ------------------------------------------------------- the import-time hooks
class _Hooks:
    """What restores each function `install()` replaced."""

    restorers = {}


HOOKS = ("fit", "compute_loss", "symbolic_build", "scalar_logs", "keras2_fit", "keras2_compute_loss")


def _hook_targets():
    targets = {}
    if keras_is_3():
        from keras.src.backend.tensorflow import trainer as tf_trainer

        targets.update({
            "fit": (keras.Model, "fit", _make_fit),
            "compute_loss": (keras.Model, "compute_loss", _make_compute_loss),
            "symbolic_build": (tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", _make_symbolic_build),
            "scalar_logs": (tf_trainer, "reduce_per_replica", _make_reduce_per_replica),
        })
    keras2 = keras2_module()
    if keras2 is not None:
        # Keras 2 (tf_keras, or TF <= 2.15's keras): the same two hooks on its Model.
        targets.update({
            "keras2_fit": (keras2.Model, "fit", _make_fit),
            "keras2_compute_loss": (keras2.Model, "compute_loss", _make_compute_loss),
        })
    return targets


def install(hooks=HOOKS):
    """Installs the named hooks (all by default; idempotent); returns those now installed.

    "fit" and "compute_loss" wrap `keras.Model`'s methods, "symbolic_build" and
    "scalar_logs" are the two multi-worker fixes (see the module docstring).
    """
    unknown = set(hooks) - set(HOOKS)
    if unknown:
        raise ValueError(f"`hooks` must be a subset of {HOOKS}; unknown: {sorted(unknown)}.")
    targets = _hook_targets()
    for label in hooks:
        if label not in targets:
            continue        # no such Keras installed (Keras 2 hooks without tf_keras)
        owner, name, _ = targets[label]
        if not hasattr(owner, name):
            # Not in this Keras (`_maybe_symbolic_build` came with 3.5): nothing to fix.
            continue
        if label not in _Hooks.restorers:
            _Hooks.restorers[label] = _replace(*targets[label])
    return installed_hooks()


def installed_hooks():
    return sorted(_Hooks.restorers)


def uninstall():
    """Restores every function `install()` replaced."""
    for restore in _Hooks.restorers.values():
        restore()
    _Hooks.restorers.clear()


def install_unless_opted_out():
    """What `import accumulator` does: `install()`, unless ACCUMULATOR_KERAS_HOOKS=0."""
    if os.environ.get(HOOKS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        logger.info("%s=%s: accumulator installs no Keras hooks.", HOOKS_ENV, os.environ[HOOKS_ENV])
        return []
    return install()


def _make_fit(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def fit(self, *args, **kwargs):
        from accumulator import fit_hook

        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["callbacks"] = fit_hook.before_fit(self, bound.arguments.get("callbacks"))
        return original(*bound.args, **bound.kwargs)

    return fit


def _make_compute_loss(original):
    @functools.wraps(original)
    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, *args, **kwargs):
        from accumulator import weighting

        training = args[0] if args else kwargs.get("training", True)
        if training:
            weighting.note_batch(self, x, y, y_pred, sample_weight)
        return original(self, x, y, y_pred, sample_weight, *args, **kwargs)

    return compute_loss


def _make_symbolic_build(original):
    # keras#20585, first half: Keras builds the model from the first batch and,
    # when that batch is a `PerReplica`, reduces it eagerly, which multi-worker
    # strategies cannot do outside a `tf.function`. Only shapes matter there, so
    # build from the local replica's batch.
    @functools.wraps(original)
    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = getattr(self, "distribute_strategy", None)
        if iterator is None or not is_multi_worker(strategy):
            return original(self, iterator=iterator, data_batch=data_batch)
        for item in iterator:       # (step, iterator) before Keras 3.10, (step, ?, iterator) since
            batch = next(item[-1])
            data_batch = tf.nest.map_structure(
                lambda v: strategy.experimental_local_results(v)[0]
                if isinstance(v, tf.distribute.DistributedValues) else v,
                batch,
            )
            break
        return original(self, iterator=None, data_batch=data_batch)

    return _maybe_symbolic_build


def _make_reduce_per_replica(original):
    # keras#20585, second half: scalar logs (the losses) have no axis 0 to
    # reduce along; reduce them with axis=None.
    @functools.wraps(original)
    def reduce_per_replica(values, strategy, reduction):
        if not is_multi_worker(strategy) or reduction not in ("auto", "mean"):
            return original(values, strategy, reduction)

        def reduce_one(v):
            if v.shape.rank == 0:
                return strategy.reduce("MEAN", v, axis=None)
            return original(v, strategy, reduction)

        return tf.nest.map_structure(reduce_one, values)

    return reduce_per_replica
