"""`GradientAccumulator` for Keras 2: `tf_keras` (TF >= 2.16) or `tf.keras` on TF <= 2.15.

The window and update rule are the Keras 3 class's (`accumulator.window`); this module
holds what Keras 2 does differently: its optimizer base class (whose public
`skip_gradients_aggregation=True` avoids a second reduction), mixed precision
(`LossScalingGradientAccumulator`), and the refusal of `optimizers.legacy`. Made by
`accumulator.GradientAccumulator(optimizer, ...)` for a Keras 2 optimizer.
"""

from __future__ import annotations

import contextlib
import copy

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import _tf, callbacks, flavours, refusals, replicas
from tfx_gradient_accumulator.accumulator.forwarding import InnerOptimizerForwarding
from tfx_gradient_accumulator.accumulator.options import DEFAULT_SMOOTHING, WindowOptions, refuse_unknown_arguments
from tfx_gradient_accumulator.accumulator.window import AccumulationWindow, refuse_nested_accumulation

keras2 = flavours.keras2_module()
if keras2 is None:
    raise ImportError(
        "accumulator.keras2 needs Keras 2: `pip install tf_keras` (TensorFlow >= 2.16) "
        "or TensorFlow <= 2.15, whose tf.keras is Keras 2."
    )

_Optimizer = keras2.optimizers.Optimizer
_LegacyOptimizer = keras2.optimizers.legacy.Optimizer
_LossScaleOptimizer = keras2.mixed_precision.LossScaleOptimizer
_register = keras2.utils.register_keras_serializable(package="accumulator")


def _resolve_optimizer(optimizer):
    if isinstance(optimizer, str):
        try:
            optimizer = keras2.optimizers.get(optimizer)
        except ValueError as err:
            raise ValueError(refusals.names_no_optimizer("Keras 2", optimizer, err)) from None
    inner = optimizer.inner_optimizer if isinstance(optimizer, _LossScaleOptimizer) else optimizer
    if isinstance(inner, _LegacyOptimizer):
        raise TypeError(
            f"`optimizer` is a legacy Keras 2 optimizer ({type(inner).__module__}."
            f"{type(inner).__name__}, the OptimizerV2 of TF <= 2.10); GradientAccumulator "
            "wraps the optimizers of TF 2.11+: use "
            f"`{keras2.__name__}.optimizers.{type(inner).__name__}` instead of "
            f"`{keras2.__name__}.optimizers.legacy.{type(inner).__name__}`."
        )
    if not isinstance(optimizer, _Optimizer):
        raise TypeError(refusals.not_an_optimizer("Keras 2", keras2.__name__, optimizer))
    refuse_nested_accumulation(optimizer)
    return optimizer


@_register
class GradientAccumulator(InnerOptimizerForwarding, AccumulationWindow, _Optimizer):
    """Accumulates gradients over `accum_steps` micro-batches, then updates once (Keras 2).

    ```python
    import tf_keras as keras          # or tf.keras with TF_USE_LEGACY_KERAS=1, or TF <= 2.15
    from tfx_gradient_accumulator.accumulator import GradientAccumulator

    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), accum_steps=4)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=32)   # trains like batch_size=128
    ```

    Arguments, behaviour and guarantees are those of the Keras 3 class
    (`accumulator.optimizer.GradientAccumulator`): one inner update per
    window on the window's mean gradient (schedules, clipping, weight decay,
    EMA, moments and `iterations` once per window), exact weighting of uneven
    micro-batches in `fit`, `partial_window`, `schedulable`,
    `measure_noise_scale`, one all-reduce per window under `tf.distribute`.
    Custom loops call `apply_gradients(zip(grads, vars))` once per
    micro-batch (with `micro_batch_weight=` where micro-batches differ).

    Mixed precision (`mixed_float16`): wrap
    `keras.mixed_precision.LossScaleOptimizer(inner)`; see the module docstring.

    Args:
        optimizer: a Keras 2 optimizer of TF 2.11+ (not `optimizers.legacy`),
            possibly inside a `mixed_precision.LossScaleOptimizer`, or the name
            of one.
        accum_steps, partial_window, schedulable, measure_noise_scale,
        noise_scale_smoothing, merge_duplicate_rows, loss_reduction, max_effective_batch_size,
        lr_scaling, name, options: as for the Keras 3 class. Keras 2's optimizers sum
            repeated rows themselves, so `merge_duplicate_rows` changes nothing here.
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        if cls is GradientAccumulator and isinstance(optimizer, _LossScaleOptimizer):
            cls = LossScalingGradientAccumulator
        return super().__new__(cls)

    def __init__(self, optimizer, accum_steps=1, partial_window="apply", schedulable=False,
                 measure_noise_scale=False, noise_scale_smoothing=DEFAULT_SMOOTHING,
                 merge_duplicate_rows=False, loss_reduction="auto", max_effective_batch_size=None,
                 lr_scaling="none", name=None, options=None, **kwargs):
        options = WindowOptions.from_arguments(
            options, accum_steps=accum_steps, partial_window=partial_window, schedulable=schedulable,
            measure_noise_scale=measure_noise_scale, noise_scale_smoothing=noise_scale_smoothing,
            merge_duplicate_rows=merge_duplicate_rows, loss_reduction=loss_reduction,
            max_effective_batch_size=max_effective_batch_size, lr_scaling=lr_scaling)
        optimizer = _resolve_optimizer(optimizer)
        kwargs.pop("is_legacy_optimizer", None)     # in every Keras 2 optimizer config
        refuse_unknown_arguments(kwargs, "set clipping, weight decay and EMA on the inner optimizer.")
        super().__init__(name=name or "GradientAccumulator")
        # The base class's own update counter: unused (`iterations` is the inner
        # optimizer's), and left out of `variables`, whose names must be unique (h5).
        self._untracked(_unused_base_variables=list(super().variables))
        self._updater = optimizer
        self._init_window(options)

    @property
    def inner_optimizer(self):
        """The optimizer that makes the updates (inside a LossScaleOptimizer, the inner one)."""
        if isinstance(self._updater, _LossScaleOptimizer):
            return self._updater.inner_optimizer
        return self._updater

    @property
    def loss_scale_optimizer(self):
        """The given LossScaleOptimizer, or None."""
        return self._updater if isinstance(self._updater, _LossScaleOptimizer) else None

    # Keras 2's optimizers merge repeated rows themselves, so summing a sparse
    # gradient densely is its large batch's update too; under several replicas
    # that is what the window does, since a Keras 2 checkpoint (tf.train.Checkpoint,
    # BackupAndRestore) would read replica 0's rows alone.
    keeps_rows_across_replicas = False
    inner_sums_repeated_rows = True

    def build(self, var_list):
        if self._window_built():
            return
        var_list = list(var_list)
        self._build_window(var_list)
        self._updater.build(var_list)

    # ------------------------------------------------ what AccumulationWindow needs
    def _new_variable(self, shape, dtype, initial, name):
        dtype = tf.as_dtype(dtype)
        return self.add_variable(
            shape=shape, dtype=dtype, name=name,
            initializer=lambda shape, dtype: _tf.filled(shape, dtype, initial))

    def _hand_to_updater(self, grads, variables, reduced):
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if pairs:
            self._updater.apply_gradients(pairs, skip_gradients_aggregation=reduced)

    def _updates_without_reduction(self):
        # `_hand_to_updater` passes skip_gradients_aggregation=True: nothing to switch off.
        return contextlib.nullcontext()

    def _window_gradient_scale(self):
        # Keras 2 unscales in `compute_gradients` / `get_unscaled_gradients`.
        return None

    # ----------------------------------------------------------------- update
    def compute_gradients(self, loss, var_list, tape=None):
        # Through the inner optimizer: a LossScaleOptimizer scales and unscales here.
        return self._updater.compute_gradients(loss, var_list, tape=tape)

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                        micro_batch_weight=None, **kwargs):
        """One micro-batch. `micro_batch_weight` is the denominator of its loss (see
        `accumulator.weighting`); leave it None in `fit` and where micro-batches weigh the same."""
        aggregated = skip_gradients_aggregation or not kwargs.pop("experimental_aggregate_gradients", True)
        if kwargs:
            raise TypeError(f"apply_gradients() got unexpected arguments: {sorted(kwargs)}.")
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, variables = (list(part) for part in zip(*grads_and_vars))
        if aggregated and not self._passthrough and replicas.replicas_in_sync() > 1:
            raise ValueError(
                "GradientAccumulator reduces gradients across replicas itself, once per "
                "window; pass the replicas' own gradients (skip_gradients_aggregation=False)."
            )
        with tf.init_scope():
            self.build(variables)
        self._apply_micro_batch(grads, variables, micro_batch_weight)
        return self.iterations

    def apply(self, grads, trainable_variables=None, micro_batch_weight=None):
        """`apply_gradients(zip(grads, trainable_variables))`, as the Keras 3 class takes it."""
        if trainable_variables is None:
            if not self._window_built():
                raise ValueError("Build the optimizer before `apply(grads)` without variables.")
            trainable_variables = self._state.variables
        return self.apply_gradients(zip(grads, trainable_variables), micro_batch_weight=micro_batch_weight)

    def finalize_variable_values(self, var_list):
        # Keras 2's `fit` calls this when training ends, before EMA values are written back.
        self._close_at_training_end()
        self._updater.finalize_variable_values(var_list)

    # ------------------------------------------------------------ forwarding
    # (and `learning_rate`, `exclude_from_weight_decay`: `InnerOptimizerForwarding`)
    @staticmethod
    def _is_loss_scale_optimizer(optimizer):
        return isinstance(optimizer, _LossScaleOptimizer)

    @InnerOptimizerForwarding.iterations.setter
    def iterations(self, value):
        self.inner_optimizer.iterations = value

    @property
    def variables(self):
        """The wrapper's variables, then the inner optimizer's."""
        unused = self._unused_base_variables
        own = [v for v in super().variables if not any(v is u for u in unused)]
        return own + list(self._updater.variables)

    # ------------------------------------------------------------ serializing
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras2.optimizers.serialize(self._updater),
            "is_legacy_optimizer": False,
            **self._window_config(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        spec = config.pop("optimizer")
        inner = keras2.optimizers.deserialize(
            copy.deepcopy(spec), custom_objects=custom_objects, use_legacy_optimizer=False)
        if isinstance(inner, str):   # Keras 2 deserializes no AdamW, Lion, Adafactor by name
            inner = getattr(keras2.optimizers, spec["class_name"]).from_config(spec["config"])
        return cls(inner, **config)

    def load_own_variables(self, store):
        # As arrays: a replica-local variable's assign under a strategy divides
        # what it is given by the replica count, which an h5 dataset refuses.
        super().load_own_variables({key: np.asarray(store[key]) for key in store.keys()})


@_register
class LossScalingGradientAccumulator(GradientAccumulator, _LossScaleOptimizer):
    """A `GradientAccumulator` around a Keras 2 `LossScaleOptimizer`, and itself one.

    Keras 2's `compile` wraps any optimizer that is not a `LossScaleOptimizer`
    in one for `mixed_float16` models; being one keeps the loss scaling inside
    the window (see the module docstring). Made by `GradientAccumulator(...)`
    when given a `LossScaleOptimizer`; the loss-scale API is the inner one's.
    """

    def get_scaled_loss(self, loss):
        return self.loss_scale_optimizer.get_scaled_loss(loss)

    def get_unscaled_gradients(self, grads):
        return self.loss_scale_optimizer.get_unscaled_gradients(grads)

    @property
    def dynamic(self):
        return self.loss_scale_optimizer.dynamic

    @property
    def loss_scale(self):
        return self.loss_scale_optimizer.loss_scale

    @property
    def dynamic_counter(self):
        return self.loss_scale_optimizer.dynamic_counter

    @property
    def initial_scale(self):
        return self.loss_scale_optimizer.initial_scale

    @property
    def dynamic_growth_steps(self):
        return self.loss_scale_optimizer.dynamic_growth_steps


# Keras 2's own callback classes for what `fit` adds by itself (`accumulator.callbacks`).
EpochWindows = callbacks.EpochWindows.for_keras(keras2)
AccumulationSchedule = callbacks.AccumulationSchedule.for_keras(keras2)
