"""`GradientAccumulator`: a Keras 3 optimizer wrapper that trains like a larger batch.

The wrapper keeps a small, explicit state (in the spirit of optax's `MultiSteps`):

* ``micro_step``      how many micro-batches the open window holds;
* ``accum_steps``     how many micro-batches close a window (a variable, so it
                      can change during training without retracing);
* ``weight_sum``      the total weight of the micro-batches in the window;
* ``accumulators``    per variable, the weighted sum of the window's gradients.

and one update rule: add ``weight * grad`` to the accumulators; when the window is
full, hand ``accumulators / weight_sum`` to the inner optimizer exactly once and
reset the window. Everything the inner optimizer does per update (learning-rate
schedules, clipping, weight decay, Adam moments, EMA, loss scaling, iteration
count) therefore happens once per window, on the window's mean gradient.

Under `tf.distribute` the accumulators are replica-local (`ON_READ`): every
micro-step stays on its replica, and the only cross-replica reduction is one
batched all-reduce of the window's sums when it closes (`_tf.py`). The boundary
decision is taken in cross-replica context (a `cond` inside `merge_call`, the
pattern Keras' own `LossScaleOptimizer` uses), because a `cond` in replica
context cannot hold the `merge_call` that Keras' optimizers issue when they
update variables.
"""

from __future__ import annotations

import keras
from keras import ops

from accumulator import _tf, fit_hook, weighting
from accumulator.validation import integer_at_least

PARTIAL_WINDOW_MODES = ("apply", "carry", "drop")

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


def validate_accum_steps(accum_steps, name="accum_steps"):
    """Returns `accum_steps` as an int, or raises naming the parameter."""
    return integer_at_least(accum_steps, name)


def validate_partial_window(mode, name="partial_window"):
    """Returns `mode` if it is one of PARTIAL_WINDOW_MODES, or raises naming the parameter."""
    if mode not in PARTIAL_WINDOW_MODES:
        raise ValueError(f"`{name}` must be one of {PARTIAL_WINDOW_MODES}; received {mode!r}.")
    return mode


def _resolve_optimizer(optimizer):
    if isinstance(optimizer, str):
        try:
            optimizer = keras.optimizers.get(optimizer)
        except ValueError as err:
            raise ValueError(
                f"`optimizer` names no Keras optimizer: {optimizer!r} ({err})"
            ) from None
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            "`optimizer` must be a Keras 3 optimizer instance (for example "
            "`keras.optimizers.Adam()`) or the name of one (for example 'adam'); "
            f"received {optimizer!r} of type {type(optimizer).__name__}."
        )
    if isinstance(optimizer, GradientAccumulator):
        raise TypeError(
            "`optimizer` is already a GradientAccumulator; nest the accumulation "
            "by multiplying `accum_steps` instead."
        )
    return optimizer


def _accumulator_dtype(variable):
    # Half-precision sums lose the small gradients accumulation exists for.
    dtype = keras.backend.standardize_dtype(variable.dtype)
    return "float32" if dtype in ("float16", "bfloat16") else dtype


@keras.saving.register_keras_serializable(package="accumulator")
class GradientAccumulator(keras.optimizers.Optimizer):
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

    Custom loops call `apply_gradients(zip(grads, vars))` or `apply(grads, vars)`
    once per micro-batch, eagerly or inside `tf.function`. `None` gradients are
    left out of the update, `tf.IndexedSlices` (embeddings) are accumulated
    into dense buffers.

    Mixed precision: wrap a `keras.optimizers.LossScaleOptimizer`
    (`GradientAccumulator(LossScaleOptimizer(Adam()))`, and compile with
    `auto_scale_loss=False` so Keras does not wrap the accumulator in a second
    one). The loss scale then stays constant within a window, the window's
    scaled mean is checked once, and a window holding a non-finite gradient is
    skipped as a whole while the scale adapts.

    Partial windows: when an epoch or `fit` ends with a window still open
    (the data ran out mid-window), `partial_window` says what happens to it:
    "apply" (the default) makes one update from the micro-batches it holds,
    weighted by the samples they hold, exactly like the large-batch run's
    short last batch; "carry" keeps it open, so windows run on across epochs
    and into the next `fit` (resuming training in several calls); "drop"
    discards it. `fit` learns of epoch ends through a callback it adds by
    itself (`accumulator.callbacks.EpochWindows`, see `accumulator.fit_hook`);
    custom loops call `close_partial_window()` where their epochs end.

    Args:
        optimizer: the inner optimizer: a `keras.optimizers.Optimizer` instance
            or a name accepted by `keras.optimizers.get` (for example "adam").
        accum_steps: positive int, the micro-batches in one window. 1 makes the
            wrapper a transparent pass-through.
        partial_window: "apply", "carry" or "drop": what the end of an epoch
            and of `fit` does with an open window.
        schedulable: keep the accumulating path even at `accum_steps=1`, so
            that `set_accum_steps` (or `accumulator.callbacks.AccumulationSchedule`)
            can change it during training. Implied by any `accum_steps > 1`.
        name: optional name of the wrapper.
    """

    def __init__(self, optimizer, accum_steps=1, partial_window="apply", schedulable=False,
                 name=None, **kwargs):
        accum_steps = validate_accum_steps(accum_steps)
        validate_partial_window(partial_window)
        optimizer = _resolve_optimizer(optimizer)
        for arg_name, default in _BASE_ARG_DEFAULTS.items():
            if arg_name in kwargs and kwargs.pop(arg_name) != default:
                raise ValueError(
                    f"GradientAccumulator does not take `{arg_name}`; set it on "
                    "the inner optimizer, where it acts once per update."
                )
        kwargs.pop("learning_rate", None)
        if kwargs:
            raise ValueError(
                f"GradientAccumulator got unknown arguments: {sorted(kwargs)}. "
                "It takes `optimizer`, `accum_steps`, `partial_window`, `schedulable` and `name`."
            )
        if keras.backend.backend() != "tensorflow":
            raise RuntimeError(
                "GradientAccumulator needs the TensorFlow backend of Keras 3 "
                f"(KERAS_BACKEND=tensorflow); the active backend is "
                f"{keras.backend.backend()!r}."
            )
        _tf.prepare_for_strategy()
        fit_hook.install()
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer
        self._accum_steps = accum_steps
        self.partial_window = partial_window
        # Indices of the variables that got gradients in any traced or eager
        # call: what a forced close of the window applies.
        self._indices_with_grads = set()
        self._close_function = None
        # Fixed at construction: a traced train step cannot switch paths later.
        self.schedulable = bool(schedulable)
        self._passthrough = accum_steps == 1 and not self.schedulable
        self._seen_in_window = set()
        self._init_window_listeners()

    # ------------------------------------------------------------------ state
    def _init_window_listeners(self):
        # Layers that pool statistics per window (AccumBatchNormalization):
        # they follow `accum_steps` and close their windows with this one.
        # Not a checkpoint dependency (they are saved with their model), so
        # set past TensorFlow's attribute tracking.
        object.__setattr__(self, "_window_listeners", [])

    @keras.src.utils.tracking.no_automatic_dependency_tracking
    def build(self, var_list):
        var_list = list(var_list)
        self._micro_step = self.add_variable(
            shape=(), dtype="int64", initializer="zeros",
            aggregation="only_first_replica", name="micro_step",
        )
        self._accum_steps_var = self.add_variable(
            shape=(), dtype="int64",
            initializer=keras.initializers.Constant(self._accum_steps),
            aggregation="only_first_replica", name="accum_steps",
        )
        # Replica-local: each replica sums its own micro-batches; the sums meet
        # in one batched all-reduce when the window closes.
        self._weight_sum = self._add_local_variable((), "float32", "weight_sum")
        # A pass-through never accumulates: it holds no buffers.
        self._accumulators = [] if self._passthrough else [
            self._add_local_variable(
                v.shape, _accumulator_dtype(v), f"accumulator_{i}"
            )
            for i, v in enumerate(var_list)
        ]
        self.inner_optimizer.build(var_list)
        _tf.check_inner_supports_distribution(self.inner_optimizer)
        super().build(var_list)

    def _add_local_variable(self, shape, dtype, name):
        with keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                initializer="zeros", shape=shape, dtype=dtype, trainable=False,
                synchronization="on_read", aggregation="sum", name=name,
            )
        self._track_variable(variable)
        return variable

    @property
    def variables(self):
        return self._variables + self.inner_optimizer.variables

    @property
    def accum_steps(self):
        """Micro-batches per window. Once built, the variable's value: what a
        schedule set, and what a restored checkpoint or loaded model holds."""
        if self.built and _tf.executing_eagerly():
            return int(self._accum_steps_var.numpy())
        return self._accum_steps

    @property
    def micro_step(self):
        """Micro-batches in the open window (0 right after an update)."""
        return self._micro_step

    @property
    def accumulators(self):
        return list(self._accumulators)

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        # Keras calls this when `fit` ends, before EMA values are written back.
        self.close_partial_window()
        self.inner_optimizer.finalize_variable_values(var_list)

    def close_partial_window(self, mode=None):
        """Applies ("apply"), keeps ("carry") or discards ("drop") an open window.

        Call it between training runs or where a custom loop's epoch ends;
        `fit` calls it with `partial_window` when an epoch and when training
        ends. Returns the number of micro-batches the window held.
        """
        mode = validate_partial_window(mode or self.partial_window, name="mode")
        if not self.built or self._passthrough:
            return 0
        held = int(self._micro_step.numpy())
        if held == 0 or mode == "carry":
            return held
        # Layers pooling statistics per window (AccumBatchNormalization) close theirs too.
        for layer in self._window_listeners:
            layer.close_window(apply=mode == "apply")
        if mode == "drop":
            self._reset_window(range(len(self._accumulators)))
            self._micro_step.assign(0)
            self._seen_in_window = set()
        else:
            if self._close_function is None:
                self._close_function = _tf.make_close_function(self)
            self._close_function()
        return held

    def set_accum_steps(self, accum_steps):
        """Changes the window length from the next window on (no retracing)."""
        accum_steps = validate_accum_steps(accum_steps)
        if self._passthrough and accum_steps != 1:
            raise ValueError(
                "This GradientAccumulator was made with `accum_steps=1` and "
                "`schedulable=False`, a pass-through without buffers; construct "
                "it with `schedulable=True` to change `accum_steps` later."
            )
        if self.built and int(self._micro_step.numpy()):
            raise ValueError(
                "`accum_steps` can change only between windows; close the open "
                "window first (`close_partial_window`)."
            )
        self._accum_steps = accum_steps
        if self.built:
            self._accum_steps_var.assign(accum_steps)
        for layer in self._window_listeners:
            layer.set_accum_steps(accum_steps)

    # ----------------------------------------------------------------- update
    def apply_gradients(self, grads_and_vars, micro_batch_weight=None):
        grads, trainable_variables = zip(*grads_and_vars)
        self.apply(list(grads), list(trainable_variables), micro_batch_weight=micro_batch_weight)
        return self.iterations

    def apply(self, grads, trainable_variables=None, micro_batch_weight=None):
        """One micro-batch. `micro_batch_weight` is the denominator of its loss.

        Leave it `None` in `fit` (found from the compiled loss and the batch)
        and in loops whose micro-batches weigh the same (weight 1); pass the
        sample count, summed sample weight or unmasked-step count otherwise,
        see `accumulator.weighting`.
        """
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the "
                    "optimizer must be built first: call "
                    "`optimizer.build(model.trainable_variables)`."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"`grads` ({len(grads)}) and `trainable_variables` "
                f"({len(trainable_variables)}) must have the same length."
            )
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        if not grads:
            return
        if self._passthrough:
            # Transparent: the inner optimizer sees exactly what it would alone.
            self.inner_optimizer.apply(grads, trainable_variables)
            return
        if micro_batch_weight is None:
            micro_batch_weight = weighting.fit_micro_batch_weight()
        indices = [self._get_variable_index(v) for v in trainable_variables]
        _tf.apply_in_context(self, grads, indices, 1.0 if micro_batch_weight is None else micro_batch_weight)

    def _accumulate(self, grads, indices, weight=1.0):
        """Replica-local: adds `weight * grad` into the window's buffers."""
        weight = ops.cast(weight, "float32")
        for grad, index in zip(grads, indices):
            if grad is None:
                continue
            if _tf.executing_eagerly():
                self._seen_in_window.add(index)
            _tf.add_weighted(self._accumulators[index], grad, weight)
        self._weight_sum.assign_add(weight)

    def _window_is_full(self):
        return self._micro_step >= self._accum_steps_var

    def _apply_window(self, used, sums, weight_sum, replicas):
        """Replica-local: applies the window's mean gradient, then resets it.

        `used` lists the indices of the variables that had a gradient in the
        window, `sums` their accumulated (and, under a strategy, reduced)
        weighted gradients, `weight_sum` the window's weight summed over the
        `replicas`; the other variables get `None`, as in the large batch.
        """
        weight_sum = weight_sum / replicas
        grads = [None] * len(self._trainable_variables)
        for i, total in zip(used, sums):
            variable = self._trainable_variables[i]
            grads[i] = ops.cast(total / ops.cast(weight_sum, total.dtype), variable.dtype)
        self.inner_optimizer.apply(grads, self._trainable_variables)
        self._reset_window(used)

    def _reset_window(self, indices):
        """Empties the buffers at `indices` (the others are empty) and the weight."""
        for i in indices:
            self._accumulators[i].assign(ops.zeros_like(self._accumulators[i].value))
        self._weight_sum.assign(0.0)

    # ------------------------------------------------------------ serializing
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            "accum_steps": self.accum_steps,
            "partial_window": self.partial_window,
            "schedulable": self.schedulable,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
