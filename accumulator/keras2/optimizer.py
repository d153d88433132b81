"""`GradientAccumulator` for Keras 2: `tf_keras` (TF >= 2.16) or `tf.keras` on TF <= 2.15.

The window and update rule are the Keras 3 class's (`accumulator.window.window`); this module
holds what Keras 2 does differently: its optimizer base class (whose public
`skip_gradients_aggregation=True` avoids a second reduction), mixed precision
(`LossScalingGradientAccumulator`), and the refusal of `optimizers.legacy`. Made by
`accumulator.GradientAccumulator(optimizer, ...)` for a Keras 2 optimizer.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, flavours, rebuilding, refusals, replicas
from tfx_gradient_accumulator.accumulator.schedules import callbacks
from tfx_gradient_accumulator.accumulator.window import custom_loop
from tfx_gradient_accumulator.accumulator.window.forwarding import InnerOptimizerForwarding
from tfx_gradient_accumulator.accumulator.core.options import DEFAULT_SMOOTHING, WindowOptions, refuse_unknown_arguments
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow, refuse_nested_accumulation
from tfx_gradient_accumulator.accumulator.keras2.micro_batch_side import Keras2MicroBatchSide

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
    """The Keras 2 optimizer `optimizer` names or is; refuses `optimizers.legacy` and non-optimizers."""
    optimizer = rebuilding.optimizer_of_name(optimizer, keras2.optimizers.get, "Keras 2")
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


def _deserialize_optimizer(spec: dict, custom_objects: dict | None = None):
    """The Keras 2 optimizer `spec` (`optimizers.serialize`'s) describes, never a legacy one."""
    inner = keras2.optimizers.deserialize(
        copy.deepcopy(spec), custom_objects=custom_objects, use_legacy_optimizer=False)
    if isinstance(inner, str):   # Keras 2 deserializes no AdamW, Lion, Adafactor by name
        inner = getattr(keras2.optimizers, spec["class_name"]).from_config(spec["config"])
    return inner


@_register
class GradientAccumulator(InnerOptimizerForwarding, Keras2MicroBatchSide, AccumulationWindow, custom_loop.CustomLoopData,
                          _Optimizer):
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
    `keras.mixed_precision.LossScaleOptimizer(inner)`. Keras 2's `compile` wraps any
    other optimizer of such a model in a `LossScaleOptimizer`, which would check and
    skip single micro-batches; given one, the accumulator is itself one
    (`LossScalingGradientAccumulator`), so `compile` leaves it alone: gradients are
    scaled and unscaled through the inner one, and the window's mean is checked once
    (a window holding a non-finite gradient is skipped as a whole while the scale adapts).

    The window's gradient, already reduced across replicas, reaches the inner
    optimizer through Keras 2's public `skip_gradients_aggregation=True`.

    Args:
        optimizer: a Keras 2 optimizer of TF 2.11+ (not `optimizers.legacy`, whose
            per-variable slot kernels Keras 2 itself replaced in TF 2.11), possibly
            inside a `mixed_precision.LossScaleOptimizer`, or the name of one.
        accum_steps: as for the Keras 3 class.
        partial_window: as for the Keras 3 class.
        schedulable: as for the Keras 3 class.
        measure_noise_scale: as for the Keras 3 class.
        noise_scale_smoothing: as for the Keras 3 class.
        merge_duplicate_rows: as for the Keras 3 class; Keras 2's optimizers sum
            repeated rows themselves, so it changes nothing here.
        loss_reduction: as for the Keras 3 class.
        max_effective_batch_size: as for the Keras 3 class.
        lr_scaling: as for the Keras 3 class.
        name: optional name of the wrapper.
        options: as for the Keras 3 class.
        micro_batch_size: as for the Keras 3 class: `fit`'s batch is the effective
            batch, one update, trained in micro-batches of this many samples inside
            each training step (`accumulator.keras2.fit_micro_batches`; under a
            strategy, global; under mixed_float16, `fit` takes compile's loss scaling
            inside: `accumulator.keras2.micro_batch_scaling`).
        **kwargs: Keras 2's optimizer arguments as a saved config holds them; others
            are refused.

    Raises:
        TypeError: `optimizer` is not a Keras 2 optimizer, or is a legacy one.
        ValueError, TypeError: an option outside its allowed values, or an unknown
            argument (clipping, weight decay and EMA belong to the inner optimizer).
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        """`LossScalingGradientAccumulator` when `optimizer` is a `LossScaleOptimizer`."""
        if cls is GradientAccumulator and isinstance(optimizer, _LossScaleOptimizer):
            cls = LossScalingGradientAccumulator
        return super().__new__(cls)

    def __init__(self, optimizer, accum_steps: int | str = 1, partial_window: str = "apply",
                 schedulable: bool = False, measure_noise_scale: bool = False,
                 noise_scale_smoothing: float = DEFAULT_SMOOTHING, merge_duplicate_rows: bool = False,
                 loss_reduction: str = "auto", max_effective_batch_size: int | None = None,
                 lr_scaling: str = "none", name: str | None = None, options: WindowOptions | None = None,
                 micro_batch_size: int | None = None, **kwargs):
        options = WindowOptions.from_arguments(
            options, accum_steps=accum_steps, partial_window=partial_window, schedulable=schedulable,
            measure_noise_scale=measure_noise_scale, noise_scale_smoothing=noise_scale_smoothing,
            merge_duplicate_rows=merge_duplicate_rows, loss_reduction=loss_reduction,
            max_effective_batch_size=max_effective_batch_size, lr_scaling=lr_scaling,
            micro_batch_size=micro_batch_size)
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

    def build(self, var_list: list) -> None:
        """Builds the window's buffers and the inner optimizer for `var_list` (once).

        Args:
            var_list: the model's trainable variables.
        """
        if self._window_built():
            return
        var_list = list(var_list)
        self._build_window(var_list)
        self._updater.build(var_list)

    # ------------------------------------------------ what AccumulationWindow needs
    def _new_variable(self, shape, dtype, initial, name):
        """A Keras 2 optimizer variable (what `AccumulationWindow` asks of each Keras)."""
        dtype = tf.as_dtype(dtype)
        return self.add_variable(
            shape=shape, dtype=dtype, name=name,
            initializer=lambda shape, dtype: _tf.filled(shape, dtype, initial))

    def _updates_without_reduction(self):
        """Nothing to switch off: Keras 2 takes `skip_gradients_aggregation`."""
        # `_hand_to_updater` passes skip_gradients_aggregation=True: nothing to switch off.
        return contextlib.nullcontext()

    def _window_gradient_scale(self):
        """The loss scale the window's sums carry, if any."""
        # Keras 2 unscales in `compute_gradients` / `get_unscaled_gradients`.
        return None

    # ----------------------------------------------------------------- update
    def compute_gradients(self, loss, var_list, tape=None) -> list:
        """The inner optimizer's `compute_gradients` (a LossScaleOptimizer scales and unscales).

        Args:
            loss: the micro-batch's loss (a tensor, or a callable with `tape` None).
            var_list: the variables.
            tape: the `tf.GradientTape` that recorded the loss.

        Returns:
            `(gradient, variable)` pairs.
        """
        # Through the inner optimizer: a LossScaleOptimizer scales and unscales here.
        return self._updater.compute_gradients(loss, var_list, tape=tape)

    def apply_gradients(self, grads_and_vars, name=None, skip_gradients_aggregation=False,
                        micro_batch_weight=None, **kwargs):
        """One micro-batch, added to the window, which updates once when it is full.

        Args:
            grads_and_vars: `(gradient, variable)` pairs of the micro-batch.
            name: Keras 2's (unused).
            skip_gradients_aggregation: True only without replicas: the accumulator
                reduces across replicas itself, once per window.
            micro_batch_weight: the denominator of its loss; leave it None in `fit`
                and where micro-batches weigh the same.
            **kwargs: `experimental_aggregate_gradients` (Keras 2's older spelling).

        Returns:
            `iterations` (the inner optimizer's updates).

        Raises:
            TypeError: an unknown keyword argument.
            ValueError: gradients already aggregated across several replicas.
        """
        aggregated = skip_gradients_aggregation or not kwargs.pop("experimental_aggregate_gradients", True)
        if kwargs:
            raise TypeError(f"apply_gradients() got unexpected arguments: {sorted(kwargs)}.")
        grads_and_vars = list(grads_and_vars)
        if not grads_and_vars:
            return self.iterations
        grads, variables = (list(part) for part in zip(*grads_and_vars))
        if aggregated and not self.is_passthrough and replicas.replicas_in_sync() > 1:
            raise ValueError(
                "GradientAccumulator reduces gradients across replicas itself, once per "
                "window; pass the replicas' own gradients (skip_gradients_aggregation=False)."
            )
        with tf.init_scope():
            self.build(variables)
        # None: the weight `micro_batches` wrote, where the loop runs in it (`accumulator.window.custom_loop`).
        self._apply_micro_batch(grads, variables, custom_loop.weight_for(self, micro_batch_weight))
        return self.iterations

    def apply(self, grads, trainable_variables=None, micro_batch_weight=None):
        """`apply_gradients(zip(grads, trainable_variables))`, as the Keras 3 class takes it.

        Args:
            grads: the micro-batch's gradients.
            trainable_variables: their variables; None: those the window was built with.
            micro_batch_weight: the denominator of its loss.

        Returns:
            `iterations`.

        Raises:
            ValueError: no `trainable_variables` before the window is built.
        """
        if trainable_variables is None:
            if not self._window_built():
                raise ValueError("Build the optimizer before `apply(grads)` without variables.")
            trainable_variables = self._state.variables
        return self.apply_gradients(zip(grads, trainable_variables), micro_batch_weight=micro_batch_weight)

    def finalize_variable_values(self, var_list: list) -> None:
        """Closes the open window as `partial_window` says, then the inner optimizer's.

        Args:
            var_list: the model's trainable variables.
        """
        # Keras 2's `fit` calls this when training ends, before EMA values are written back.
        self._close_at_training_end()
        self._updater.finalize_variable_values(var_list)

    # ------------------------------------------------------------ forwarding
    # (and `learning_rate`, `exclude_from_weight_decay`: `InnerOptimizerForwarding`)
    @staticmethod
    def _is_loss_scale_optimizer(optimizer):
        """Whether `optimizer` is Keras 2's `LossScaleOptimizer`."""
        return isinstance(optimizer, _LossScaleOptimizer)

    @InnerOptimizerForwarding.iterations.setter
    def iterations(self, value):
        """Sets the inner optimizer's update count."""
        self.inner_optimizer.iterations = value

    @property
    def variables(self):
        """The wrapper's variables, then the inner optimizer's."""
        unused = self._unused_base_variables
        own = [v for v in super().variables if not any(v is u for u in unused)]
        return own + list(self._updater.variables)

    # ------------------------------------------------------------ serializing
    def get_config(self) -> dict:
        """The inner optimizer (serialized), the name and the window's options."""
        return {
            "name": self.name,
            "optimizer": keras2.optimizers.serialize(self._updater),
            "is_legacy_optimizer": False,
            **self._window_config(),
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> GradientAccumulator:
        """Rebuilds a wrapper from `get_config()` (a `LossScalingGradientAccumulator` around a
        `LossScaleOptimizer`), the inner optimizer with `custom_objects` (`core.rebuilding`)."""
        deserialize = functools.partial(_deserialize_optimizer, custom_objects=custom_objects)
        return rebuilding.rebuilt_from_config(cls, config, "optimizer", deserialize)

    def save_own_variables(self, store) -> None:
        """Keras 2's save of the variables (`model.save`), after the open-window check.

        Args:
            store: Keras' store of this object's variables.
        """
        # A custom loop's window still open is reported once (`accumulator.window.loop_notes`).
        if self._window_built():
            self._state.notes.loop_notes.note_saved(self.held_micro_batches)
        super().save_own_variables(store)

    def load_own_variables(self, store) -> None:
        """Restores the state Keras saved (as arrays, under any strategy).

        Args:
            store: Keras' store of this object's variables.
        """
        # As arrays: a replica-local variable's assign under a strategy divides
        # what it is given by the replica count, which an h5 dataset refuses.
        values = self.restorable([np.asarray(store[str(i)]) for i in range(len(store.keys()))])
        if values is None:      # Keras' warning, nothing loaded
            return super().load_own_variables({key: np.asarray(store[key]) for key in store.keys()})
        super().load_own_variables({str(i): value for i, value in enumerate(values)})


# `help()` and `inspect.signature` read a class's own `__new__` (the dispatch above)
# before its `__init__`: show `__init__`'s parameters.
GradientAccumulator.__new__.__signature__ = inspect.signature(GradientAccumulator.__init__)


@_register
class LossScalingGradientAccumulator(GradientAccumulator, _LossScaleOptimizer):
    """A `GradientAccumulator` around a Keras 2 `LossScaleOptimizer`, and itself one.

    Keras 2's `compile` wraps any optimizer that is not a `LossScaleOptimizer`
    in one for `mixed_float16` models; being one keeps the loss scaling inside
    the window. Made by `GradientAccumulator(...)`
    when given a `LossScaleOptimizer`; the loss-scale API is the inner one's.
    """

    def get_scaled_loss(self, loss: tf.Tensor) -> tf.Tensor:
        """The inner `LossScaleOptimizer`'s.

        Args:
            loss: the loss to scale.

        Returns:
            The scaled loss.
        """
        return self.loss_scale_optimizer.get_scaled_loss(loss)

    def get_unscaled_gradients(self, grads: list) -> list:
        """The inner `LossScaleOptimizer`'s.

        Args:
            grads: the scaled gradients.

        Returns:
            The gradients unscaled.
        """
        return self.loss_scale_optimizer.get_unscaled_gradients(grads)

    @property
    def dynamic(self):
        """The inner `LossScaleOptimizer`'s `dynamic`."""
        return self.loss_scale_optimizer.dynamic

    @property
    def loss_scale(self):
        """The inner `LossScaleOptimizer`'s `loss_scale`."""
        return self.loss_scale_optimizer.loss_scale

    @property
    def dynamic_counter(self):
        """The inner `LossScaleOptimizer`'s `dynamic_counter`."""
        return self.loss_scale_optimizer.dynamic_counter

    @property
    def initial_scale(self):
        """The inner `LossScaleOptimizer`'s `initial_scale`."""
        return self.loss_scale_optimizer.initial_scale

    @property
    def dynamic_growth_steps(self):
        """The inner `LossScaleOptimizer`'s `dynamic_growth_steps`."""
        return self.loss_scale_optimizer.dynamic_growth_steps


# Keras 2's own callback classes for what `fit` adds by itself (`accumulator.schedules.callbacks`).
EpochWindows = callbacks.EpochWindows.for_keras(keras2)
AccumulationSchedule = callbacks.AccumulationSchedule.for_keras(keras2)
