"""The one place where this library reaches past Keras' and TensorFlow's public API.

Private names (`PRIVATE_NAMES` says what needs each; `test_seam.py` fails on one used
elsewhere, or gone from the installed Keras/TF): Keras' `_all_reduce_sum_gradients`,
`_flatten_layers`, `_loss_tracker`, `_moments`, `_learning_rate`, `_maybe_symbolic_build`,
`reduce_per_replica`, `get_global_attribute`, `set_global_attribute`, the TensorFlow
trainer's `train_step` (its owner), `_compute_loss`, `_compile_loss` (each output's loss
tracker), `_call_has_training_arg` and the
mask of a tensor (`get_keras_mask`, `set_keras_mask`); TensorFlow's
`strategy_supports_no_merge_call`, `GraphOrParentsInXlaContext`, `_collective_key_base`,
`_set_global_seed`; Keras 2's `_callable_losses`, `_validate_compile`, the losses'
`_allow_sum_over_batch_size` that `_get_reduction` reads, and a tensor's `_keras_mask`
(what its `get_mask` reads: a padded micro-batch's padding masked out, `micro_batch_size`), and `_train_counter` (the steps
`fit` trained, counted once a batch by `micro_batch_size="auto"`). Why each is needed:
DEVELOPERS.md, "Design notes by module". Also the optimizers' second moments that
`accumulator.noise.preconditioning` reads: `_get_variable_index` (Keras 2: `_var_key`,
`_index_dict`) and the slot lists `_velocities`, `_velocity_hats`, `_average_gradients`,
`_accumulators`, `_u` (instance attributes; `test_preconditioning*.py` check them).
The window's buffers that change size state the shape they hold (`reports_held_shape`):
a subclass of their class overrides `shape` and TensorFlow's `_restore_from_tensors`,
reading the declared `_shape` and Keras 3's `_value` (`test_window_shapes.py` checks them).
tf.data's `_input_dataset`, `_batch_size` and `_drop_remainder` (instance attributes of
its datasets) tell the batches a dataset hands on without reading it (`batches_made_by`).
Importing it changes nothing; it imports only `accumulator.core.flavours`. Run-time changes to
Keras are `accumulator.hooks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import itertools
import random

import keras
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import flavours


@dataclasses.dataclass(frozen=True)
class PrivateName:
    """One private Keras/TF name: where it lives, and what needs it."""

    module: str
    path: str
    needed_for: str
    since: tuple = (3, 0)      # the first Keras release that has it
    on_compiled_model: bool = False     # an attribute of a compiled model, not of a module
    keras2: bool = False       # a name of Keras 2 (`keras2_module()`), expected where it is installed

    def expected(self, version=None):
        """Whether this Keras should have it."""
        if self.keras2:
            return flavours.keras2_module() is not None
        return flavours.version_tuple(version or keras.__version__) >= self.since

    def resolve(self):
        """The object, or AttributeError/ImportError naming what is missing."""
        package = flavours.keras2_module() if self.keras2 else keras
        obj = package if self.keras2 else importlib.import_module(self.module)
        if self.on_compiled_model:
            obj = package.Sequential([package.Input((1,)), package.layers.Dense(1)])
            obj.compile(loss="mse")
        for part in self.path.split("."):
            obj = getattr(obj, part)
        return obj

    def __str__(self):
        return f"{self.module}.{'Model().' if self.on_compiled_model else ''}{self.path}"


PRIVATE_NAMES = (
    PrivateName("keras", "optimizers.Optimizer._all_reduce_sum_gradients",
                "tf.distribute: one reduction per window", since=(3, 2)),
    PrivateName("tensorflow", "__internal__.distribute.strategy_supports_no_merge_call",
                "refusing XLA-compiled steps under a multi-replica strategy"),
    PrivateName("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext",
                "refusing XLA-compiled steps under a multi-replica strategy"),
    PrivateName("keras", "layers.Layer._flatten_layers", "finding AccumBatchNormalization layers"),
    PrivateName("keras", "layers.BatchNormalization._moments", "AccumBatchNormalization"),
    PrivateName("keras", "_loss_tracker", "GradientCache: the `loss` that `fit` logs", on_compiled_model=True),
    PrivateName("keras", "optimizer._learning_rate",
                "lr_scaling: the inner optimizer's own learning rate or schedule object",
                on_compiled_model=True),
    PrivateName("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer._maybe_symbolic_build",
                "MultiWorkerMirroredStrategy fix (keras#20585)", since=(3, 5)),
    PrivateName("keras.src.backend.tensorflow.trainer", "reduce_per_replica",
                "MultiWorkerMirroredStrategy fix (keras#20585); micro_batch_size='auto' under a strategy: the "
                "logs of its split step"),
    PrivateName("keras.src.backend.tensorflow.trainer", "TensorFlowTrainer.train_step",
                "micro_batch_size: fit's step split into micro-batches (its owner, where the hook goes)"),
    PrivateName("keras", "_compute_loss", "micro_batch_size: a micro-batch's loss as Keras' step computes it",
                on_compiled_model=True),
    PrivateName("keras.src.backend.common.masking", "set_keras_mask",
                "micro_batch_size: a padded micro-batch's padding masked out of the loss and the metrics"),
    PrivateName("keras.src.backend.common.masking", "get_keras_mask",
                "micro_batch_size: a padded micro-batch's padding masked out of the loss and the metrics"),
    PrivateName("keras", "_call_has_training_arg", "micro_batch_size: the model called as Keras' step calls it",
                on_compiled_model=True),
    PrivateName("keras", "_compile_loss", "micro_batch_size: each output's loss tracker (`<output>_loss`) "
                "weighed by the micro-batch's real rows", on_compiled_model=True),
    PrivateName("tensorflow", "distribute.MirroredStrategy._collective_key_base",
                "AccumulatingTrainer: each MirroredStrategy of a process its own collective keys"),
    PrivateName("tensorflow.python.eager.context", "Context._set_global_seed",
                "AccumulatingTrainer(verify_exactness=True): the run's random state as before the check"),
    PrivateName("keras.src.backend.common.global_state", "get_global_attribute",
                "AccumulatingTrainer(verify_exactness=True): Keras' global seed as before the check"),
    PrivateName("keras.src.backend.common.global_state", "set_global_attribute",
                "AccumulatingTrainer(verify_exactness=True): Keras' global seed as before the check"),
    PrivateName("keras", "optimizers.Optimizer._get_variable_index",
                "preconditioning: an optimizer's second moment of a variable"),
    PrivateName("tf_keras", "optimizers.Optimizer._var_key",
                "preconditioning: a Keras 2 optimizer's second moment of a variable", keras2=True),
    PrivateName("tf_keras", "_callable_losses",
                "Keras 2 GradientCache: weight regularization told from losses added while running",
                on_compiled_model=True, keras2=True),
    PrivateName("tf_keras", "Model._validate_compile",
                "Keras 2 GradientCache of a TFRS model: compile under a strategy before its towers build",
                keras2=True),
    PrivateName("tf_keras", "losses.Loss._get_reduction",
                "Keras 2 GradientCache gathered across replicas: a task's SUM_OVER_BATCH_SIZE loss scored on "
                "the global batch (it reads the loss's `_allow_sum_over_batch_size`)", keras2=True),
    PrivateName("tf_keras", "src.utils.losses_utils.get_mask",
                "Keras 2 micro_batch_size: a padded micro-batch's padding masked out of the loss and the "
                "metrics (the tensor's `_keras_mask`, which it reads)", keras2=True),
    PrivateName("tf_keras", "_train_counter",
                "Keras 2 micro_batch_size='auto': the steps fit trained, which Keras 2's own train function "
                "counts and its TensorBoard and BackupAndRestore callbacks read", on_compiled_model=True, keras2=True),
)


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


# --------------------------------------------------------------- random state
_KERAS_SEED, _KERAS_SEED_GENERATOR = "global_random_seed", "global_seed_generator"


@dataclasses.dataclass(frozen=True)
class RandomState:
    """Every random state a Keras program draws from, as `random_state()` found it."""

    python: object
    numpy: object
    tf_seed: object
    tf_op_seeds: object
    keras_seed: object
    keras_generator: object
    keras_generator_state: object


def random_state() -> RandomState:
    """Python's, NumPy's, TensorFlow's global seed and op-seed generator, Keras' global
    seed and `SeedGenerator` (its object and its state)."""
    from keras.src.backend.common import global_state
    from tensorflow.python.eager import context

    ctx = context.context()
    rng = getattr(ctx, "_rng", None)
    generator = global_state.get_global_attribute(_KERAS_SEED_GENERATOR)
    return RandomState(
        random.getstate(), np.random.get_state(), ctx._seed, rng.getstate() if rng is not None else None,
        global_state.get_global_attribute(_KERAS_SEED), generator,
        None if generator is None else np.array(generator.state.numpy()))


def restore_random_state(state: RandomState, clear_kernel_cache: bool = True) -> None:
    """Puts back what `random_state()` found (also after `keras.backend.clear_session()`).

    Putting back TensorFlow's global seed clears the eager kernel cache, so that stateful
    random kernels (an eager `tf.random.uniform`, a `tf.function`'s own) start again as the
    seed's draws did: every `tf.function` is instantiated again at its next call, a graph
    optimization costing from a fraction of a second to seconds. With
    `clear_kernel_cache=False` and the seed unchanged, only its op-seed generator is put
    back and the cache kept: between the probes of `find_micro_batch`, whose draws nobody
    reads, when the last put-back clears it."""
    from keras.src.backend.common import global_state
    from tensorflow.python.eager import context

    random.setstate(state.python)
    np.random.set_state(state.numpy)
    ctx = context.context()
    if state.tf_seed is None:
        ctx._seed, ctx._rng = None, None
    elif (not clear_kernel_cache and ctx._seed == state.tf_seed and getattr(ctx, "_rng", None) is not None
          and state.tf_op_seeds is not None):
        ctx._rng.setstate(state.tf_op_seeds)
    else:
        ctx._set_global_seed(state.tf_seed)
        if state.tf_op_seeds is not None:
            ctx._rng.setstate(state.tf_op_seeds)
    tf.compat.v1.get_default_graph().seed = state.tf_seed
    global_state.set_global_attribute(_KERAS_SEED, state.keras_seed)
    global_state.set_global_attribute(_KERAS_SEED_GENERATOR, state.keras_generator)
    if state.keras_generator is not None:
        state.keras_generator.state.assign(state.keras_generator_state)


# --------------------------------------------------------------- distribution
_ALL_REDUCE = "_all_reduce_sum_gradients"


def given_learning_rate(optimizer):
    """The learning rate as the optimizer was given it: a variable, a schedule or a callable.

    The public `learning_rate` evaluates a schedule; scaling it needs the schedule itself.
    """
    return optimizer._learning_rate


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
    """What replaces `_all_reduce_sum_gradients`: the gradients unreduced."""
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


def reports_held_shape(variable):
    """Makes a window buffer (made by `variables_created_as(shape=...)` with a `None`
    dimension) state the shape it holds: `variable.shape` is then `tf.shape(variable)`
    wherever it is read eagerly (`model.summary()`'s count, a checkpoint tool, a
    memory estimate), and the declared open shape while a step is traced.

    The buffers change size (a stand-in filled on its first dense gradient, rows that
    grow inside the traced step), so TensorFlow must keep their open static shape:
    a fully defined one would make the traced step check every resize and fold
    `tf.shape` reads into constants, and a checkpoint of another size would not
    restore. Only what the buffer *says* changes: its class becomes a subclass (one
    per class, made once) whose `shape` reads the held shape eagerly. A Keras 3
    variable gets it on the Keras variable; a Keras 2 one (a `tf.Variable`) on each
    local component, whose `_restore_from_tensors` then checks a checkpoint's value
    against the open shape, as before. Nothing else about the variable changes.

    Args:
        variable: a window buffer (Keras 3 variable, or a Keras 2 `tf.Variable`).

    Returns:
        `variable`.
    """
    if isinstance(variable, tf.Variable):
        targets = tf.distribute.get_strategy().experimental_local_results(variable)
    else:
        targets = [variable]
    for target in targets:
        if not getattr(type(target), "_reports_held_shape", False):
            target.__class__ = _held_shape_class(type(target))
    return variable


def declared_shape(variable):
    """The shape a window buffer was declared with (`None` where it changes size), as a
    `tf.TensorShape`; `variable.shape` says what it holds (`reports_held_shape`)."""
    variable = variable if isinstance(variable, tf.Variable) else variable._value
    if isinstance(variable, tf.distribute.DistributedValues):
        variable = variable.values[0]
    return tf.TensorShape(variable._shape)


def _held(component):
    """The shape `component` (a `tf.Variable` or a distributed one) holds, read eagerly
    (replica 0's under a strategy: each replica's rows are its own)."""
    if isinstance(component, tf.distribute.DistributedValues):
        component = component.values[0]
    return tf.TensorShape(tf.raw_ops.VariableShape(input=component.handle).numpy().tolist())


@functools.lru_cache(maxsize=None)
def _held_shape_class(cls):
    """`cls` with a `shape` that reads the held shape eagerly (see `reports_held_shape`)."""
    if issubclass(cls, tf.Variable):
        class HeldShapeVariable(cls):
            _reports_held_shape = True

            @property
            def shape(self):
                declared = super().shape
                return declared if declared.is_fully_defined() or not tf.executing_eagerly() else _held(self)

            def _restore_from_tensors(self, restored_tensors):
                # The parent checks the value against `self.shape`, the held shape here.
                with tf.device(self.device):
                    value = tf.identity(restored_tensors["VARIABLE_VALUE"])
                    return self.assign(value, read_value=False)
    else:
        class HeldShapeVariable(cls):
            _reports_held_shape = True

            @property
            def shape(self):
                # `_value`, not `value`: no cast inside an autocast scope.
                declared = tf.TensorShape(self._value.shape)
                return declared if declared.is_fully_defined() or not tf.executing_eagerly() else _held(self._value)

    HeldShapeVariable.__name__ = cls.__name__      # reprs read as before
    return HeldShapeVariable


# ---------------------------------------------------------------------- layers
_COLLECTIVE_KEY_BASES = itertools.count(1)
COLLECTIVE_KEYS_PER_STRATEGY = 10_000     # group keys a strategy may use before the next one's


def mirrored_strategy(**kwargs):
    """`tf.distribute.MirroredStrategy(**kwargs)` whose collective group keys no other strategy made here shares.

    Two made in one process on the same devices would share collective keys, and the
    second's first all-reduce of another shape would fail ("Shape mismatch in the
    collective instance").
    """
    cls = tf.distribute.MirroredStrategy
    saved = cls._collective_key_base
    cls._collective_key_base = next(_COLLECTIVE_KEY_BASES) * COLLECTIVE_KEYS_PER_STRATEGY
    try:
        return cls(**kwargs)
    finally:
        cls._collective_key_base = saved


def flatten_layers(model):
    """Every layer nested in `model` (not `model` itself)."""
    return list(model._flatten_layers(include_self=False))


def loss_tracker(model):
    """The metric behind the `loss` that `fit` logs for a compiled `model`."""
    return model._loss_tracker


def output_loss_trackers(model):
    """The metrics (`keras.metrics.Mean`) behind each output's `<output>_loss` that `fit`
    logs for a compiled Keras 3 `model` ([] where it logs none)."""
    compiled = getattr(model, "_compile_loss", None)
    return [m for m in (getattr(compiled, "metrics", None) or []) if m is not None]


def keras2_train_counter(model):
    """Keras 2's count of the steps `fit` trained (`Model._train_counter`), which its own train
    function adds to and its callbacks read."""
    return model._train_counter


def keras2_weight_regularization_count(model):
    """How many weight-regularization losses a Keras 2 `model` and its layers hold:
    the callables Keras 2 evaluates each time `losses` is read (not losses added
    while the model runs)."""
    return sum(len(getattr(layer, "_callable_losses", ())) for layer in [model, *model.submodules])


@contextlib.contextmanager
def keras2_losses_scoring_the_global_batch(holder):
    """Context: the Keras 2 loss objects `holder` holds (a TFRS task's, by its
    attributes) take `SUM_OVER_BATCH_SIZE` under a strategy, as Keras 2's compiled
    losses do. Keras 2 refuses that reduction in a replica (a replica's mean of its
    share, summed over the replicas, is not the batch's mean); on a gathered global
    batch the mean is one device's, so it is right there. Put back on exit."""
    keras2 = flavours.keras2_module()
    losses = [value for value in vars(holder).values()
              if keras2 is not None and isinstance(value, keras2.losses.Loss)
              and hasattr(value, "_allow_sum_over_batch_size")]
    before = [loss._allow_sum_over_batch_size for loss in losses]
    for loss in losses:
        loss._allow_sum_over_batch_size = True
    try:
        yield
    finally:
        for loss, value in zip(losses, before):
            loss._allow_sum_over_batch_size = value


def batch_norm_moments(layer, inputs, mask):
    """Mean and variance Keras' `BatchNormalization` would normalize `inputs` with."""
    return layer._moments(inputs, mask)


# ------------------------------------------------------ optimizers' moments
def inner_optimizer(optimizer):
    """The optimizer `optimizer` wraps (a LossScaleOptimizer's, an accumulator's), or None."""
    return getattr(optimizer, "inner_optimizer", None)


def optimizer_variable_index(optimizer, variable):
    """Where `variable` sits in `optimizer`'s per-variable slot lists; None if unknown or not built."""
    try:
        if hasattr(optimizer, "_get_variable_index"):       # Keras 3
            return optimizer._get_variable_index(variable)
        return optimizer._index_dict[optimizer._var_key(variable)]       # Keras 2
    except (AttributeError, KeyError, TypeError):
        return None


def adam_second_moments(optimizer):
    """The per-variable second moments Adam-like `optimizer` divides by: its `v`
    (the running maxima `v_hat` under `amsgrad`); None if it holds none."""
    if getattr(optimizer, "amsgrad", False):
        return getattr(optimizer, "_velocity_hats", None)
    return getattr(optimizer, "_velocities", None)


def adamax_norms(optimizer):
    """Adamax's per-variable exponentially weighted infinity norms `u`; None if it holds none."""
    return getattr(optimizer, "_u", None)


def rmsprop_moments(optimizer):
    """RMSprop's `(velocities, average gradients)`; the second None unless `centered`."""
    averages = getattr(optimizer, "_average_gradients", None) if getattr(optimizer, "centered", False) else None
    return getattr(optimizer, "_velocities", None), averages


def adagrad_accumulators(optimizer):
    """Adagrad's per-variable sums of squared gradients; None if it holds none."""
    return getattr(optimizer, "_accumulators", None)


# ------------------------------------------------------ multi-worker fixes
def multiworker_fixes():
    """`{label: (owner, name, make_replacement)}`: the two Keras 3 functions that stop
    `fit` under `MultiWorkerMirroredStrategy` (keras-team/keras#20585), and what
    replaces each; `accumulator.hooks` installs them."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    return {
        "symbolic_build": (tf_trainer.TensorFlowTrainer, "_maybe_symbolic_build", _make_symbolic_build),
        "scalar_logs": (tf_trainer, "reduce_per_replica", _make_reduce_per_replica),
    }


def _make_symbolic_build(original):
    """Keras' `_maybe_symbolic_build`, fixed for `MultiWorkerMirroredStrategy` (keras#20585)."""
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


def reduce_per_replica(logs, strategy):
    """Keras' reduction of a step's per-replica logs (as its train function reduces them; with
    the scalar logs' fix of `multiworker_fixes` where it is installed)."""
    from keras.src.backend.tensorflow import trainer as tf_trainer       # read now: the fix applies
    return tf_trainer.reduce_per_replica(logs, strategy, reduction="auto")


def _make_reduce_per_replica(original):
    """Keras' `reduce_per_replica`, fixed for scalar logs (keras#20585)."""
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


# tf.data's transformations that hand on each element of their input as it is, one for one
# (the order may change): between a `batch` and the dataset, the batches stay its batches.
_BATCH_KEEPING_DATASETS = ("_PrefetchDataset", "_OptionsDataset", "_ShuffleDataset", "CacheDataset",
                           "_TakeDataset", "_SkipDataset", "_RepeatDataset", "_AssertCardinalityDataset")
_BATCHING_DATASETS = ("_BatchDataset", "_ParallelBatchDataset", "_PaddedBatchDataset")


def batches_made_by(dataset):
    """`(batch_size, drop_remainder, samples)` of the `batch` (or `padded_batch`) whose
    batches `dataset` hands on, where that is known without reading it: the `batch` reached
    through transformations that keep every batch and their number (`_BATCH_KEEPING_DATASETS`,
    each of the same cardinality as its input: a `take` or `repeat` that changes it stops
    the walk), its size and `drop_remainder` constants, and the samples it batched a known
    count; else None. Reads tf.data's `_input_dataset`, `_batch_size`, `_drop_remainder`
    (the same in TF 2.16 to 2.21; `test_micro_batch.py` counts through them)."""
    node = dataset
    while type(node).__name__ in _BATCH_KEEPING_DATASETS:
        source = getattr(node, "_input_dataset", None)
        if not isinstance(source, tf.data.Dataset) or int(node.cardinality()) != int(source.cardinality()):
            return None
        node = source
    if type(node).__name__ not in _BATCHING_DATASETS:
        return None
    source, batch_size, drop_remainder = (getattr(node, name, None)
                                          for name in ("_input_dataset", "_batch_size", "_drop_remainder"))
    if not isinstance(source, tf.data.Dataset) or batch_size is None or drop_remainder is None:
        return None
    batch_size, drop_remainder = tf.get_static_value(batch_size), tf.get_static_value(drop_remainder)
    if batch_size is None or drop_remainder is None:
        return None
    samples = int(source.cardinality())
    if samples < 0 or int(batch_size) < 1:
        return None
    return int(batch_size), bool(drop_remainder), samples


# ------------------------------------------------ fit's step in micro-batches
def train_step_owner():
    """The class that defines Keras 3's `Model.train_step` for the TensorFlow backend."""
    from keras.src.backend.tensorflow import trainer as tf_trainer

    return tf_trainer.TensorFlowTrainer


def call_for_training(model, x):
    """`model(x)` as Keras' own `train_step` calls it."""
    return model(x, training=True) if model._call_has_training_arg else model(x)


def training_loss(model, x, y, y_pred, sample_weight):
    """The loss as Keras' own `train_step` computes it (`compute_loss`, an override's too)."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)


def keras_mask(tensor):
    """The Keras mask `tensor` carries, or None."""
    from keras.src.backend.common import masking

    return masking.get_keras_mask(tensor)


def set_keras_mask(tensor, mask):
    """Gives `tensor` the Keras mask `mask` (what a loss and a metric read from `y_pred`)."""
    from keras.src.backend.common import masking

    masking.set_keras_mask(tensor, mask)


def keras2_mask(tensor):
    """The Keras 2 mask `tensor` carries (its `_keras_mask`), or None."""
    return getattr(tensor, "_keras_mask", None)


def set_keras2_mask(tensor, mask):
    """Gives `tensor` the Keras 2 mask `mask` (what Keras 2's losses and metrics read from `y_pred`)."""
    tensor._keras_mask = mask
