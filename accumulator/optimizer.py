"""`GradientAccumulator` for Keras 3: a Keras optimizer that trains like a larger batch.

The window's state and update rule are `accumulator.window.window` (shared with the Keras 2
class); this module holds what is Keras 3's: the optimizer base class,
`LossScaleOptimizer`, the forwarding of the inner optimizer's API, and serialization.
Two Keras 3 parts are mixins of their own: the saving of the window's variables
(`accumulator.window.keras3_saving`) and what `fit`'s micro-batch reads
(`accumulator.batch.micro_batch_side`: `micro_batch_size`, `track_updates`).
Given a Keras 2 optimizer, `GradientAccumulator(...)` makes the Keras 2 class, and
`isinstance` holds for both (`accumulator.core.flavours.OneNameForBothKeras`).
"""

from __future__ import annotations

import functools
import logging

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import flavours, rebuilding, refusals, seam
from tfx_gradient_accumulator.accumulator.window import custom_loop
from tfx_gradient_accumulator.accumulator.batch.micro_batch_side import MicroBatchSide
from tfx_gradient_accumulator.accumulator.window.forwarding import InnerOptimizerForwarding
from tfx_gradient_accumulator.accumulator.window.keras3_saving import Keras3WindowSaving
from tfx_gradient_accumulator.accumulator.core.loss_scaling import WindowLossScaling
from tfx_gradient_accumulator.accumulator.core.options import (  # noqa: F401  (validators re-exported: the public names)
    DEFAULT_SMOOTHING, PARTIAL_WINDOW_MODES, WindowOptions, refuse_unknown_arguments,
    validate_accum_steps, validate_measure_noise_scale, validate_partial_window,
)
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow, optimizer_chain, refuse_nested_accumulation

logger = logging.getLogger(__name__)

# Supported = tested (`make test`): setup.py declares the same range.
OLDEST_KERAS = (3, 8)

_BASE_ARG_DEFAULTS = {
    "weight_decay": None,
    "clipnorm": None,
    "global_clipnorm": None,
    "clipvalue": None,
    "use_ema": False,
    "ema_momentum": 0.99,
    "ema_overwrite_frequency": None,
    "loss_scale_factor": None,
    "gradient_accumulation_steps": None,
}


def _refuse_update_arguments(kwargs):
    """Refuses Keras' update arguments (`clipnorm`, `use_ema`, ...) not at their defaults, and
    unknown ones: they act on updates, so they belong to the inner optimizer."""
    for arg_name, default in _BASE_ARG_DEFAULTS.items():
        if arg_name in kwargs and kwargs.pop(arg_name) != default:
            raise ValueError(
                f"GradientAccumulator does not take `{arg_name}`; set it on "
                "the inner optimizer, where it acts once per update."
            )
    kwargs.pop("learning_rate", None)
    refuse_unknown_arguments(kwargs)


def _refuse_unsupported_keras():
    """Refuses Keras older than `OLDEST_KERAS`, and a Keras backend other than TensorFlow."""
    if flavours.version_tuple(keras.__version__) < OLDEST_KERAS:
        raise RuntimeError(
            f"GradientAccumulator needs Keras >= {'.'.join(map(str, OLDEST_KERAS))} "
            f"(with TensorFlow >= 2.16); this is Keras {keras.__version__}. Older Keras 3 "
            "releases train differently under tf.distribute and mixed precision; "
            "`pip install -U 'keras>=3.8'`."
        )
    if keras.backend.backend() != "tensorflow":
        raise RuntimeError(
            "GradientAccumulator needs the TensorFlow backend of Keras 3 "
            f"(KERAS_BACKEND=tensorflow); the active backend is "
            f"{keras.backend.backend()!r}."
        )


def _resolve_optimizer(optimizer):
    """The Keras 3 optimizer `optimizer` names or is; TypeError/ValueError otherwise."""
    optimizer = rebuilding.optimizer_of_name(optimizer, keras.optimizers.get, "Keras")
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(refusals.not_an_optimizer("Keras 3", "keras", optimizer, " (for example 'adam')"))
    refuse_nested_accumulation(optimizer)
    return optimizer


@keras.saving.register_keras_serializable(package="accumulator")
class GradientAccumulator(InnerOptimizerForwarding, WindowLossScaling, MicroBatchSide, Keras3WindowSaving,
                          AccumulationWindow, custom_loop.CustomLoopData, keras.optimizers.Optimizer,
                          metaclass=flavours.OneNameForBothKeras):
    """Accumulates gradients over `accum_steps` micro-batches, then updates once.

    Wrap any Keras 3 optimizer; training then follows the run with a batch
    `accum_steps` times larger, at the memory cost of the small one:

    ```python
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), accum_steps=4)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=32)   # trains like batch_size=128
    ```

    The inner optimizer sees one call per window with the window's mean
    gradient, so its `iterations`, learning-rate schedule, `clipnorm`,
    `clipvalue`, `global_clipnorm`, `weight_decay`, EMA and moments advance
    once per update. `iterations` of the wrapper is the inner optimizer's
    (updates, not micro-steps); `micro_step` says where the open window stands.
    Variables marked `overwrite_with_gradient` (float8 training's scales and
    amax histories) get the window's element-wise maximum, as one large
    batch's amax would be.

    One number, the effective batch: with `micro_batch_size=b` (and no
    `accum_steps`), `fit`'s batch is the update's batch E and each training
    step splits it:

    ```python
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), micro_batch_size=32)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=128)  # trains like batch_size=128, 32 samples at a time
    ```

    Each batch `fit` draws is one update, trained as ceil(len / b)
    micro-batches in a `tf.while_loop` inside one traced step (one XLA
    program with `jit_compile=True`); the last one is padded to b and its
    padding masked out of the loss and the metrics, so every shape is static.
    Keras' steps, `iterations`, callbacks and the progress bar count updates
    (`accumulator.batch.fit_micro_batches`). Under MirroredStrategy and
    MultiWorkerMirroredStrategy b is global (a multiple of the replicas) and
    the samples' weighting global; under mixed_float16 one loss scale per
    update.

    With `micro_batch_size="auto"` the run finds b itself: it starts with the
    whole batch, and a step that runs out of memory trains the same batch again
    at a smaller even split ceil(E / N) (the weights and the optimizer's state
    untouched by the failed step, its metrics and non-trainable state put back);
    `micro_batch_size` reads the b in use, `micro_batch_changes` each change
    (`accumulator.batch.fit_auto_micro_batch`).

    Custom loops call `apply_gradients(zip(grads, vars))` or `apply(grads, vars)`
    once per micro-batch, eagerly or inside `tf.function`. `None` gradients are
    left out of the update.

    Sparse gradients (`tf.IndexedSlices`, from `Embedding` and other gathers)
    are kept as rows: every looked-up row of every micro-batch, weighted. The
    inner optimizer gets the window's rows as one `tf.IndexedSlices`, the one
    the large batch's gradient would be, so it makes Keras' own large-batch
    update: Keras 3 applies repeated rows one by one (Adam's second moment gets
    g1^2 + g2^2 for a row looked up twice). The window's memory for them grows
    with the ids looked up, not with the vocabulary. Under XLA (`jit_compile=True`,
    Keras' default on one GPU) the rows are kept too, with no option to set: XLA
    compiles only buffers of a fixed size, so their room (one micro-batch's rows
    times the window) is made before the step compiles, from `fit`'s first batch
    or from a step traced with static shapes (`accumulator.rows.row_room`). Refused
    with a message naming the ways out: a step traced for any batch size (no
    count to make the room from), and a later micro-batch with more rows than
    the room (longer sequences), reported at the next point on the host (an
    epoch's end, `close_partial_window`).

    Mixed precision (`mixed_float16`): compile as usual. Where Keras' `compile`
    would put its `LossScaleOptimizer` around the accumulator
    (`auto_scale_loss=True`), the accumulator takes it inside
    (`take_loss_scaling_from`) and stays `model.optimizer`: the same as
    `GradientAccumulator(LossScaleOptimizer(Adam()))` compiled with
    `auto_scale_loss=False`. The loss scale S stays constant within a window,
    each micro-batch's loss is scaled by S / accum_steps (its share of the
    large batch's scaled loss, so its float16 gradients are the large
    batch's), the window's mean is checked once, also against float16's range
    (where the large batch's float16 sum would overflow), and a window holding
    a non-finite gradient is skipped as a whole while the scale adapts: windows
    overflow where the large batch's steps do. `inner_optimizer` is then the
    optimizer inside the LossScaleOptimizer (the one that updates the weights,
    as Keras' callbacks expect) and `loss_scale_optimizer` the LossScaleOptimizer.
    A LossScaleOptimizer written around the accumulator is refused by `fit`.

    Partial windows: when an epoch or `fit` ends with a window still open
    (the data ran out mid-window), `partial_window` says what happens to it:
    "apply" (the default) makes one update from the micro-batches it holds,
    weighted by the samples they hold, exactly like the large-batch run's
    short last batch; "carry" keeps it open, so windows run on across epochs
    and into the next `fit` (resuming training in several calls; `fit` ends
    with `micro_step` micro-batches held, and logs it); "drop" discards it.
    `fit` learns of epoch ends through a callback it adds by itself
    (`accumulator.schedules.callbacks.EpochWindows`, see `accumulator.fit_hook`);
    custom loops call `close_partial_window()` where their epochs end.

    Args:
        optimizer: the inner optimizer: a `keras.optimizers.Optimizer` instance
            (not one built with Keras' own `gradient_accumulation_steps`) or a
            name accepted by `keras.optimizers.get` (for example "adam").
        accum_steps: positive int, the micro-batches in one window. The default,
            1, makes the wrapper a transparent pass-through. Or "auto": the
            window starts at 2 micro-batches and `fit` grows it while the
            measured noise scale says the effective batch is below the critical
            batch (`accumulator.AutoAccumulation`, which `fit` adds itself, with
            the micro-batch read from `fit`'s `batch_size` or the dataset's
            first batch); the rule is kept as `auto_accumulation`, its
            decisions as `auto_accumulation.schedule`, which
            `AccumulationSchedule(schedule, by="update")` replays exactly.
        max_effective_batch_size: with accum_steps="auto" (and only then): the
            effective batch, in samples per update, it may grow to.
        lr_scaling: with accum_steps="auto": "none" (the default), "linear" or
            "sqrt", the rule that multiplies the inner optimizer's learning
            rate as the effective batch grows.
        partial_window: "apply", "carry" or "drop": what the end of an epoch
            and of `fit` does with an open window.
        schedulable: keep the accumulating path even at `accum_steps=1`, so
            that `set_accum_steps` (or `accumulator.schedules.callbacks.AccumulationSchedule`)
            can change it during training. Implied by any `accum_steps > 1`.
        measure_noise_scale: estimate the gradient noise scale B_simple
            (McCandlish et al. 2018, the critical batch size) from the
            windows' micro-batches; see `accumulator.noise.noise_scale`. Read it as
            `optimizer.noise_scale` (a float, NaN until a window of at least
            two micro-batches has closed); in `fit` it is logged as
            `noise_scale` (History, progress bar, TensorBoard). Costs one pass
            over each micro-step's gradients (with an Adam-like optimizer, whose
            preconditioned noise scale is measured too, one float32 vector the
            size of the model's variables, so that P is read once per window)
            and a few scalars in the window's one all-reduce; needs windows, so
            not with a pass-through (`accum_steps=1` without `schedulable`).
        noise_scale_smoothing: the decay, in [0, 1), of the exponential moving
            averages of |G|^2 and tr(Sigma) over windows (0.99: about 100 windows).
        merge_duplicate_rows: False (the default) hands the inner optimizer a
            sparse gradient's rows as the large batch has them, one per lookup,
            so training equals Keras' own large batch. True sums the rows of
            each index first: adaptive optimizers then see (g1 + g2)^2 for a
            row looked up twice, the densified gradient's mathematics (what
            `tf_keras` does, and what the mean gradient of the loss implies).
            Rows of a lookup made once per batch (ids that do not depend on the
            sample, as a position table's `arange`) are one row per id position
            either way, as in the large batch (`accumulator.rows.lookups`).
        loss_reduction: "auto" (the default), "mean" or "sum": how the loss
            reduces over its samples, so the window applies what the large
            batch applies. "auto" reads the compiled loss's reduction in `fit`
            (a "sum" or "none" loss sums, every other reduction is a mean whose
            denominator each micro-batch weighs); a custom loop or a
            `compute_loss` override that does not call `super()` is a mean of
            equal micro-batches unless told: pass "sum" for a loss that sums
            over its samples (`tf.reduce_sum`), `micro_batch_weight` for a
            mean of unequal ones.
        micro_batch_size: None (the default), an int >= 1, or "auto": `fit`'s batch
            is the effective batch, split into micro-batches of this many samples
            inside each training step (see above); "auto": the largest that fits,
            found by the run (Keras 3, one device, `steps_per_execution=1`). Not with `accum_steps` > 1, "auto",
            `schedulable` or `measure_noise_scale`.
        name: optional name of the wrapper.
        options: a `WindowOptions` holding the options above, instead of them
            (not both); the wrapper's `options` is the one it was built with.
        **kwargs: Keras' optimizer arguments as a saved config holds them; those
            that act on updates (`weight_decay`, `clipnorm`, `use_ema`, ...) belong
            to the inner optimizer and are refused unless left at their defaults.

    Raises:
        ValueError, TypeError: an option outside its allowed values (the message
            names it and them), an unknown argument, or an update argument that
            belongs to the inner optimizer, before anything is built.
        RuntimeError: Keras older than 3.8, or a Keras backend other than TensorFlow.
    """

    @staticmethod
    def _keras_of_arguments(optimizer=None, *args, **kwargs):
        # One name for both Keras: a Keras 2 optimizer (or, where tf.keras is
        # Keras 2, an optimizer's name) gets the Keras 2 class.
        if flavours.is_keras2_object(optimizer) or (isinstance(optimizer, str) and flavours.tf_keras_is_keras2()):
            return flavours.keras2_module()
        return None

    @staticmethod
    def _make_keras2_class(keras2):
        from tfx_gradient_accumulator.accumulator import keras2 as keras2_classes

        return keras2_classes.GradientAccumulator

    def __init__(self, optimizer: keras.optimizers.Optimizer | str, accum_steps: int | str = 1,
                 partial_window: str = "apply", schedulable: bool = False,
                 measure_noise_scale: bool = False, noise_scale_smoothing: float = DEFAULT_SMOOTHING,
                 merge_duplicate_rows: bool = False, loss_reduction: str = "auto",
                 max_effective_batch_size: int | None = None, lr_scaling: str = "none",
                 name: str | None = None, options: WindowOptions | None = None,
                 micro_batch_size: int | str | None = None, **kwargs):
        options = WindowOptions.from_arguments(
            options, accum_steps=accum_steps, partial_window=partial_window, schedulable=schedulable,
            measure_noise_scale=measure_noise_scale, noise_scale_smoothing=noise_scale_smoothing,
            merge_duplicate_rows=merge_duplicate_rows, loss_reduction=loss_reduction,
            max_effective_batch_size=max_effective_batch_size, lr_scaling=lr_scaling,
            micro_batch_size=micro_batch_size)
        optimizer = _resolve_optimizer(optimizer)
        _refuse_update_arguments(kwargs)
        _refuse_unsupported_keras()
        super().__init__(learning_rate=0.0, name=name)
        # What receives the window gradient: the given optimizer. Its update-
        # making core (inside a LossScaleOptimizer) is `inner_optimizer`.
        self._updater = optimizer
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            self.loss_scale_optimizer = optimizer
            self.inner_optimizer = optimizer.inner_optimizer
        else:
            self.loss_scale_optimizer = None
            self.inner_optimizer = optimizer
        self._init_window(options)

    # ------------------------------------------------------------------ state
    def build(self, var_list: list) -> None:
        """Builds the window's buffers and the inner optimizer for `var_list`.

        Args:
            var_list: the model's trainable variables.

        Raises:
            NotImplementedError: under a `tf.distribute` strategy, an inner optimizer
                that does not reduce gradients across replicas itself.
        """
        var_list = list(var_list)
        self._build_window(var_list)
        self._updater.build(var_list)
        _check_supports_distribution(self)
        super().build(var_list)
        _warn_where_hooks_are_missing(self)

    # ------------------------------------------------ what AccumulationWindow needs
    def _new_variable(self, shape, dtype, initial, name):
        """A Keras optimizer variable (what `AccumulationWindow` asks of each Keras)."""
        # `None` in `shape`: a buffer that starts empty and changes size along
        # that axis (`AccumulationWindow._build_window`). Keras wants a full
        # shape, so it is made with 1 there; `seam.variables_created_as` gives
        # the `tf.Variable` behind it the open dimension.
        return self.add_variable(
            shape=tuple(1 if d is None else d for d in shape), dtype=tf.as_dtype(dtype).name,
            initializer=keras.initializers.Constant(initial), name=name)

    def _hand_to_updater(self, grads, variables, reduced):
        """The inner optimizer's one update with the window's (reduced) gradient."""
        if reduced and self.loss_scale_optimizer is not None:
            grads = self._beyond_float16_as_non_finite(grads, variables)
        self._counted_update(grads, variables, reduced)   # `MicroBatchSide.track_updates`

    def _updates_without_reduction(self):
        """Context in which the inner optimizers do not all-reduce again."""
        # Keras 3 has no public switch: see `seam.gradients_already_reduced`.
        return seam.gradients_already_reduced(optimizer_chain(self._updater))

    # ------------------------------------------------------------ forwarding
    # (and `iterations`, `learning_rate`, `exclude_from_weight_decay`: `InnerOptimizerForwarding`)
    @staticmethod
    def _is_loss_scale_optimizer(optimizer):
        """Whether `optimizer` is Keras 3's `LossScaleOptimizer`."""
        return isinstance(optimizer, keras.optimizers.LossScaleOptimizer)

    @property
    def variables(self) -> list:
        """The wrapper's variables (the window's), then the inner optimizer's."""
        return super().variables + self._updater.variables

    @property
    def optimizers(self):
        """The inner optimizer's sub-optimizers, where it has them (`MultiOptimizer`)."""
        if not hasattr(self.inner_optimizer, "optimizers"):
            raise AttributeError(f"{type(self.inner_optimizer).__name__} has no sub-optimizers.")
        return self.inner_optimizer.optimizers

    def finalize_variable_values(self, var_list: list) -> None:
        """Closes the open window as `partial_window` says, then the inner optimizer's.

        Args:
            var_list: the model's trainable variables.
        """
        # Keras calls this when `fit` ends, before EMA values are written back.
        self._close_at_training_end()
        self._updater.finalize_variable_values(var_list)

    # ----------------------------------------------------------------- update
    # Not converted by AutoGraph when a user's `tf.function` step calls them (Keras' own
    # optimizers are not either): the window's code runs as written, as in `fit`, and a
    # custom loop's first trace does not spend seconds converting the library.
    @tf.autograph.experimental.do_not_convert
    def apply_gradients(self, grads_and_vars, micro_batch_weight=None) -> tf.Variable:
        """One micro-batch: `apply(grads, vars, micro_batch_weight)`.

        Args:
            grads_and_vars: `(gradient, variable)` pairs of the micro-batch.
            micro_batch_weight: the denominator of its loss (see `apply`).

        Returns:
            `iterations` (the inner optimizer's updates).
        """
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(list(grads), list(trainable_variables), micro_batch_weight=micro_batch_weight)
        return self.iterations

    @tf.autograph.experimental.do_not_convert
    def apply(self, grads, trainable_variables=None, micro_batch_weight=None) -> None:
        """One micro-batch: added to the window, which updates once when it is full.

        Args:
            grads: the micro-batch's gradients (`None` entries are left out).
            trainable_variables: their variables; None: those the optimizer was built with.
            micro_batch_weight: the denominator of its loss. Leave it `None` in `fit`
                (found from the compiled loss and the batch), in a loop over
                `micro_batches(data)` (each micro-batch's samples) and in loops whose
                micro-batches weigh the same (weight 1); pass the sample count,
                summed sample weight or unmasked-step count otherwise.

        Raises:
            ValueError: `grads` without `trainable_variables` before the optimizer is
                built, or lists of different lengths.
        """
        grads, trainable_variables = _paired_with_variables(self, grads, trainable_variables)
        if not self.built:
            self.build(trainable_variables)
            self.built = True
        # None: the weight `micro_batches` wrote, where the loop runs in it (`accumulator.window.custom_loop`).
        self._apply_micro_batch(grads, trainable_variables, custom_loop.weight_for(self, micro_batch_weight))

    # ------------------------------------------------------------ serializing
    def get_config(self) -> dict:
        """The inner optimizer (serialized), the name and the window's options."""
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self._updater),
            **self._window_config(),
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> GradientAccumulator:
        """Rebuilds a wrapper from `get_config()`.

        Args:
            config: what `get_config` returned.
            custom_objects: Keras' custom objects, for the inner optimizer.

        Returns:
            The `GradientAccumulator`.
        """
        deserialize = functools.partial(keras.saving.deserialize_keras_object, custom_objects=custom_objects)
        return rebuilding.rebuilt_from_config(cls, config, "optimizer", deserialize)


def _paired_with_variables(optimizer, grads, trainable_variables):
    """`apply`'s gradients and their variables as two lists of one length (where no variables
    are given, those the built `optimizer` holds); ValueError otherwise."""
    grads = list(grads)
    if trainable_variables is None:
        if not optimizer.built:
            raise ValueError(
                "When passing `grads` without `trainable_variables`, the "
                "optimizer must be built first: call "
                "`optimizer.build(model.trainable_variables)`."
            )
        trainable_variables = optimizer._state.variables
    trainable_variables = list(trainable_variables)
    if len(grads) != len(trainable_variables):
        raise ValueError(
            f"`grads` ({len(grads)}) and `trainable_variables` "
            f"({len(trainable_variables)}) must have the same length."
        )
    return grads, trainable_variables


def _warn_where_hooks_are_missing(optimizer):
    """Warns where `optimizer`'s options need the Keras hooks and they are not installed."""
    hooked = getattr(seam.train_step_owner().train_step, "accumulator_hook", False)
    if optimizer.options.micro_batch_size is not None and not hooked:
        logger.warning(
            "accumulator's Keras hooks are not installed: `fit` trains each batch whole, not in "
            "micro-batches of %s (micro_batch_size).", optimizer.options.micro_batch_size)
    if not optimizer.is_passthrough and not getattr(keras.Model.fit, "accumulator_hook", False):
        logger.warning(
            "accumulator's Keras hooks are not installed (ACCUMULATOR_KERAS_HOOKS=0 or "
            "tfx_gradient_accumulator.accumulator.hooks.uninstall()): in `fit`, windows do not close "
            "at epoch ends unless you pass tfx_gradient_accumulator.EpochWindows(), and micro-batches "
            "weigh 1 each."
        )


def _check_supports_distribution(optimizer):
    """Raises, before training, where the wrapper cannot run under the active strategy."""
    if not tf.distribute.has_strategy():
        return
    if not any(seam.reduces_gradients_itself(o) for o in optimizer_chain(optimizer._updater)):
        raise NotImplementedError(
            "GradientAccumulator under tf.distribute needs an inner Keras optimizer that "
            "reduces gradients across replicas itself (every built-in Keras >= 3.8 "
            f"optimizer does); {type(optimizer._updater).__name__} does not. Use a "
            "keras.optimizers.Optimizer subclass, or train without a strategy."
        )
