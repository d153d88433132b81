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

import logging

import keras
import tensorflow as tf
from keras import ops

from accumulator import _tf, seam, weighting
from accumulator.noise_scale import (
    DEFAULT_SMOOTHING, NoiseScaleEstimate, micro_batch_terms, squared_norm, validate_smoothing,
)
from accumulator.validation import integer_at_least

logger = logging.getLogger(__name__)

PARTIAL_WINDOW_MODES = ("apply", "carry", "drop")
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


def validate_accum_steps(accum_steps, name="accum_steps"):
    """Returns `accum_steps` as an int, or raises naming the parameter."""
    return integer_at_least(accum_steps, name)


def validate_partial_window(mode, name="partial_window"):
    """Returns `mode` if it is one of PARTIAL_WINDOW_MODES, or raises naming the parameter."""
    if mode not in PARTIAL_WINDOW_MODES:
        raise ValueError(f"`{name}` must be one of {PARTIAL_WINDOW_MODES}; received {mode!r}.")
    return mode


def validate_measure_noise_scale(measure, name="measure_noise_scale"):
    """Returns `measure` as a bool if it is True or False, or raises naming the parameter."""
    if not isinstance(measure, bool):
        raise ValueError(f"`{name}` must be True or False; received {measure!r}.")
    return measure


def optimizer_chain(optimizer):
    """`optimizer` and every optimizer it wraps (`inner_optimizer`, `optimizers`)."""
    chain, todo = [], [optimizer]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is known for known in chain):
            continue
        chain.append(current)
        todo.append(getattr(current, "inner_optimizer", None))
        try:
            todo.extend(getattr(current, "optimizers", None) or [])
        except AttributeError:
            pass
    return chain


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
    for inner in optimizer_chain(optimizer):
        if isinstance(inner, GradientAccumulator):
            raise TypeError(
                "`optimizer` is already a GradientAccumulator; nest the accumulation "
                "by multiplying `accum_steps` instead."
            )
        if getattr(inner, "gradient_accumulation_steps", None):
            raise ValueError(
                f"`optimizer` ({type(inner).__name__}) was built with Keras' own "
                f"`gradient_accumulation_steps={inner.gradient_accumulation_steps}`, which "
                "would accumulate again inside every window; build it without that "
                "argument and set `accum_steps` on the GradientAccumulator "
                f"(accum_steps={inner.gradient_accumulation_steps} for the same window)."
            )
    return optimizer


def _accumulator_dtype(variable):
    # Half-precision sums lose the small gradients accumulation exists for.
    dtype = keras.backend.standardize_dtype(variable.dtype)
    return "float32" if dtype in ("float16", "bfloat16") else dtype


def _overwrites_with_gradient(variable):
    # Float8 training's scale and amax history: the "gradient" is the new value.
    return bool(getattr(variable, "overwrite_with_gradient", False))


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
    Variables marked `overwrite_with_gradient` (float8 training's scales and
    amax histories) get the window's element-wise maximum, as one large
    batch's amax would be.

    Custom loops call `apply_gradients(zip(grads, vars))` or `apply(grads, vars)`
    once per micro-batch, eagerly or inside `tf.function`. `None` gradients are
    left out of the update, `tf.IndexedSlices` (embeddings) are accumulated
    into dense buffers.

    Mixed precision: wrap a `keras.optimizers.LossScaleOptimizer`
    (`GradientAccumulator(LossScaleOptimizer(Adam()))`, and compile with
    `auto_scale_loss=False`; `fit` refuses a LossScaleOptimizer that Keras put
    around the accumulator). The loss scale then stays constant within a
    window, the window's scaled mean is checked once, and a window holding a
    non-finite gradient is skipped as a whole while the scale adapts.
    `inner_optimizer` is then the optimizer inside the LossScaleOptimizer (the
    one that updates the weights, as Keras' callbacks expect) and
    `loss_scale_optimizer` the LossScaleOptimizer.

    Partial windows: when an epoch or `fit` ends with a window still open
    (the data ran out mid-window), `partial_window` says what happens to it:
    "apply" (the default) makes one update from the micro-batches it holds,
    weighted by the samples they hold, exactly like the large-batch run's
    short last batch; "carry" keeps it open, so windows run on across epochs
    and into the next `fit` (resuming training in several calls; `fit` ends
    with `micro_step` micro-batches held, and logs it); "drop" discards it.
    `fit` learns of epoch ends through a callback it adds by itself
    (`accumulator.callbacks.EpochWindows`, see `accumulator.fit_hook`);
    custom loops call `close_partial_window()` where their epochs end.

    Args:
        optimizer: the inner optimizer: a `keras.optimizers.Optimizer` instance
            (not one built with Keras' own `gradient_accumulation_steps`) or a
            name accepted by `keras.optimizers.get` (for example "adam").
        accum_steps: positive int, the micro-batches in one window. The default,
            1, makes the wrapper a transparent pass-through.
        partial_window: "apply", "carry" or "drop": what the end of an epoch
            and of `fit` does with an open window.
        schedulable: keep the accumulating path even at `accum_steps=1`, so
            that `set_accum_steps` (or `accumulator.callbacks.AccumulationSchedule`)
            can change it during training. Implied by any `accum_steps > 1`.
        measure_noise_scale: estimate the gradient noise scale B_simple
            (McCandlish et al. 2018, the critical batch size) from the
            windows' micro-batches; see `accumulator.noise_scale`. Read it as
            `optimizer.noise_scale` (a float, NaN until a window of at least
            two micro-batches has closed); in `fit` it is logged as
            `noise_scale` (History, progress bar, TensorBoard). Costs one
            squared norm per micro-step and a few scalars in the window's one
            all-reduce; needs windows, so not with a pass-through
            (`accum_steps=1` without `schedulable`).
        noise_scale_smoothing: the decay, in [0, 1), of the exponential moving
            averages of |G|^2 and tr(Sigma) over windows (0.99: about 100 windows).
        name: optional name of the wrapper.
    """

    def __init__(self, optimizer, accum_steps=1, partial_window="apply", schedulable=False,
                 measure_noise_scale=False, noise_scale_smoothing=DEFAULT_SMOOTHING,
                 name=None, **kwargs):
        accum_steps = validate_accum_steps(accum_steps)
        validate_partial_window(partial_window)
        measure_noise_scale = validate_measure_noise_scale(measure_noise_scale)
        noise_scale_smoothing = validate_smoothing(noise_scale_smoothing, "noise_scale_smoothing")
        if measure_noise_scale and accum_steps == 1 and not schedulable:
            raise ValueError(
                "`measure_noise_scale=True` needs windows of several micro-batches: the "
                "noise scale compares the micro-batches' gradients with their window's, "
                "and `accum_steps=1` (without `schedulable=True`) makes a pass-through "
                "with windows of 1, which give no estimate. Use accum_steps >= 2."
            )
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
                "It takes `optimizer`, `accum_steps`, `partial_window`, `schedulable`, "
                "`measure_noise_scale`, `noise_scale_smoothing` and `name`."
            )
        if seam.version_tuple(keras.__version__) < OLDEST_KERAS:
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
        self._accum_steps = accum_steps
        self.partial_window = partial_window
        # Indices of the variables that got gradients in any traced or eager
        # call: what a forced close of the window applies.
        self._indices_with_grads = set()
        self._close_function = None
        # Fixed at construction: a traced train step cannot switch paths later.
        self.schedulable = bool(schedulable)
        self._passthrough = accum_steps == 1 and not self.schedulable
        self.measure_noise_scale = measure_noise_scale
        self.noise_scale_smoothing = noise_scale_smoothing
        self._seen_in_window = set()
        # {epoch: accum_steps} that `fit` follows (set by `accumulating_compile`).
        self.epoch_schedule = None
        self._untracked(_window_listeners=[], _vars=[], _index_by_id={}, _accumulators=[],
                        _overwrite_indices=frozenset(), _window_strategy=None,
                        _noise_estimate=None, _noise_sums=[])

    # ------------------------------------------------------------------ state
    def _untracked(self, **attributes):
        # Plain Python state, set past TensorFlow's attribute tracking: the
        # variables are tracked by `add_variable`, the listening layers are
        # saved with their model, not with the optimizer.
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    def build(self, var_list):
        var_list = list(var_list)
        first_replica = tf.VariableAggregation.ONLY_FIRST_REPLICA
        with seam.variables_created_as(aggregation=first_replica):
            self._micro_step = self.add_variable(
                shape=(), dtype="int64", initializer="zeros", name="micro_step")
            self._accum_steps_var = self.add_variable(
                shape=(), dtype="int64",
                initializer=keras.initializers.Constant(self._accum_steps), name="accum_steps")
        # Replica-local: each replica sums its own micro-batches; the sums meet
        # in one batched all-reduce when the window closes.
        self._weight_sum = self._add_local_variable((), "float32", "weight_sum")
        overwrite = frozenset(i for i, v in enumerate(var_list) if _overwrites_with_gradient(v))
        # A pass-through never accumulates: it holds no buffers.
        accumulators = [] if self._passthrough else [
            self._add_local_variable(
                v.shape, _accumulator_dtype(v), f"accumulator_{i}",
                initial=float("-inf") if i in overwrite else 0.0,
            )
            for i, v in enumerate(var_list)
        ]
        if self.measure_noise_scale:
            # Per replica, next to the accumulators: sum_k R^2 |g_k|^2, sum_k 1/b_k
            # and K, reduced with them once per window.
            noise_sums = [self._add_local_variable((), "float32", f"noise_scale_{name}")
                          for name in ("micro_sq_norm_sum", "inv_size_sum", "micro_count")]
            # The smoothed estimate: mirrored, updated after the window's reduction.
            with seam.variables_created_as(aggregation=first_replica):
                estimate = NoiseScaleEstimate(
                    lambda name, dtype: self.add_variable(
                        shape=(), dtype=dtype, initializer="zeros", name=f"noise_scale_{name}"),
                    smoothing=self.noise_scale_smoothing,
                )
            self._untracked(_noise_estimate=estimate, _noise_sums=noise_sums)
        self._untracked(_vars=var_list, _index_by_id={id(v): i for i, v in enumerate(var_list)},
                        _accumulators=accumulators, _overwrite_indices=overwrite,
                        _window_strategy=tf.distribute.get_strategy())
        self._updater.build(var_list)
        _tf.check_supports_distribution(self)
        super().build(var_list)
        if not self._passthrough and "fit" not in seam.installed_hooks():
            logger.warning(
                "accumulator's Keras hooks are not installed (%s=0 or seam.uninstall()): "
                "in `fit`, windows do not close at epoch ends unless you pass "
                "accumulator.callbacks.EpochWindows(), and micro-batches weigh 1 each.",
                seam.HOOKS_ENV,
            )

    def _add_local_variable(self, shape, dtype, name, initial=0.0):
        with seam.variables_created_as(
            synchronization=tf.VariableSynchronization.ON_READ, aggregation=tf.VariableAggregation.SUM
        ):
            return self.add_variable(
                shape=shape, dtype=dtype, initializer=keras.initializers.Constant(initial), name=name)

    @property
    def variables(self):
        return super().variables + self._updater.variables

    def set_weights(self, weights):
        """Sets the wrapper's and the inner optimizers' state, in `variables` order."""
        variables = self.variables
        if not self.built:
            raise ValueError("Build the optimizer (or train one step) before `set_weights()`.")
        if len(weights) != len(variables):
            raise ValueError(
                f"`weights` must hold {len(variables)} arrays (the wrapper's and the inner "
                f"optimizer's variables, as `get_weights()` returns them); received {len(weights)}."
            )
        for variable, weight in zip(variables, weights):
            if tuple(variable.shape) != tuple(ops.shape(weight)):
                raise ValueError(
                    f"`weights` entry for {variable.name} has shape {tuple(ops.shape(weight))}; "
                    f"expected {tuple(variable.shape)}."
                )
            variable.assign(weight)

    def get_weights(self):
        return [ops.convert_to_numpy(v) for v in self.variables]

    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Forwarded to the optimizers that apply weight decay (the inner ones)."""
        targets = [o for o in optimizer_chain(self.inner_optimizer)
                   if not isinstance(o, (GradientAccumulator, keras.optimizers.LossScaleOptimizer))]
        for optimizer in targets:
            optimizer.exclude_from_weight_decay(var_list=var_list, var_names=var_names)

    @property
    def optimizers(self):
        """The inner optimizer's sub-optimizers, where it has them (`MultiOptimizer`)."""
        if not hasattr(self.inner_optimizer, "optimizers"):
            raise AttributeError(f"{type(self.inner_optimizer).__name__} has no sub-optimizers.")
        return self.inner_optimizer.optimizers

    @property
    def is_passthrough(self):
        """True for `accum_steps=1` without `schedulable`: no buffers, no windows."""
        return self._passthrough

    @property
    def accum_steps(self):
        """Micro-batches per window. Once built, the variable's value: what a
        schedule set, and what a restored checkpoint or loaded model holds."""
        if self.built and _tf.executing_eagerly():
            return int(self._accum_steps_var.numpy())
        return self._accum_steps

    @property
    def noise_scale_estimate(self):
        """The `NoiseScaleEstimate` (smoothed |G|^2, tr Sigma, B_simple as tensors);
        None before the optimizer is built. Needs `measure_noise_scale=True`."""
        self._check_measures_noise_scale()
        return self._noise_estimate

    @property
    def noise_scale(self):
        """B_simple, the gradient noise scale, as a Python float, in the units of
        the micro-batch weights (samples in `fit`); NaN before the first window of
        at least two micro-batches. Needs `measure_noise_scale=True`."""
        self._check_measures_noise_scale()
        if self._noise_estimate is None:
            return float("nan")
        return self._noise_estimate.noise_scale_value()

    def _check_measures_noise_scale(self):
        if not self.measure_noise_scale:
            raise AttributeError(
                "This GradientAccumulator does not measure the gradient noise scale; "
                "construct it with `measure_noise_scale=True` (and accum_steps >= 2)."
            )

    @property
    def micro_step(self):
        """Micro-batches in the open window (0 right after an update)."""
        return self._micro_step

    @property
    def accumulators(self):
        return list(self._accumulators)

    @property
    def iterations(self):
        # The update-making optimizer's count (a LossScaleOptimizer's own
        # counter is not it before Keras 3.4).
        return self.inner_optimizer.iterations

    @iterations.setter
    def iterations(self, value):
        # Keras < 3.4 sets the base class's own counter as `self.iterations`;
        # the wrapper counts nothing itself, so it is kept aside, unused.
        object.__setattr__(self, "_own_iterations", value)

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    def scale_loss(self, loss):
        return self._updater.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        # Keras calls this when `fit` ends, before EMA values are written back.
        held = self.close_partial_window()
        if held and self.partial_window == "carry":
            logger.warning(
                "Training ended with %d micro-batch(es) held in an open window "
                "(partial_window='carry'); they are applied by the next fit or by "
                "close_partial_window('apply'), and are not in the weights yet.", held,
            )
        self._updater.finalize_variable_values(var_list)

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

        Leave it `None` in `fit` (found from the compiled loss and the batch,
        see `accumulator.weighting`) and in loops whose micro-batches weigh the
        same (weight 1); pass the sample count, summed sample weight or
        unmasked-step count otherwise.
        """
        grads = list(grads)
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, the "
                    "optimizer must be built first: call "
                    "`optimizer.build(model.trainable_variables)`."
                )
            trainable_variables = self._vars
        trainable_variables = list(trainable_variables)
        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"`grads` ({len(grads)}) and `trainable_variables` "
                f"({len(trainable_variables)}) must have the same length."
            )
        if not self.built:
            self.build(trainable_variables)
            self.built = True
        indices = [self._variable_index(v) for v in trainable_variables]
        noted = weighting.take_noted_weight()
        if not grads:
            return
        if self._passthrough:
            # Transparent: the inner optimizer sees exactly what it would alone.
            self._updater.apply(grads, trainable_variables)
            return
        if micro_batch_weight is None:
            micro_batch_weight = 1.0 if noted is None else noted
        _tf.apply_in_context(self, grads, indices, micro_batch_weight)

    def _variable_index(self, variable):
        index = self._index_by_id.get(id(variable))
        if index is None:
            raise ValueError(
                f"Unknown variable {getattr(variable, 'path', None) or variable.name}: this "
                "GradientAccumulator was built for other variables (one optimizer per model; "
                "call `build` with all the variables it will update)."
            )
        return index

    def _accumulate(self, grads, indices, weight=1.0):
        """Replica-local: adds `weight * grad` into the window's buffers.

        `overwrite_with_gradient` variables keep the window's running maximum.
        """
        weight = ops.cast(weight, "float32")
        for grad, index in zip(grads, indices):
            if grad is None:
                continue
            if _tf.executing_eagerly():
                self._seen_in_window.add(index)
            if index in self._overwrite_indices:
                _tf.keep_maximum(self._accumulators[index], grad)
            else:
                _tf.add_weighted(self._accumulators[index], grad, weight)
        self._weight_sum.assign_add(weight)
        if self._noise_sums:
            # This replica's micro-batch: R^2 |g|^2, R/w and 1 (R the replicas,
            # as in the window gradient; see `accumulator.noise_scale`).
            terms = micro_batch_terms(
                [g for g, i in zip(grads, indices) if i not in self._overwrite_indices],
                weight, _tf.replicas_in_sync(),
            )
            for total, term in zip(self._noise_sums, terms):
                total.assign_add(term)

    def _window_is_full(self):
        return self._micro_step >= self._accum_steps_var

    def _apply_window(self, used, sums, weight_sum, replicas, noise_sums=()):
        """Replica-local: applies the window's mean gradient, then resets it.

        `used` lists the indices of the variables that had a gradient in the
        window, `sums` their accumulated (and, under a strategy, reduced)
        weighted gradients (for `overwrite_with_gradient` variables, their
        maxima), `weight_sum` the window's weight summed over the `replicas`;
        the other variables get `None`, as in the large batch. `noise_sums`
        are the window's (reduced) noise-scale sums when it measures.
        """
        weight_sum = weight_sum / replicas
        grads = [None] * len(self._vars)
        means = []
        for i, total in zip(used, sums):
            variable = self._vars[i]
            if i in self._overwrite_indices:
                grads[i] = ops.cast(_tf.maximum_over_replicas(total), variable.dtype)
            else:
                mean = total / ops.cast(weight_sum, total.dtype)
                means.append(mean)
                grads[i] = ops.cast(mean, variable.dtype)
        if self._noise_estimate is not None:
            # The window's size: its weight over the replicas (see accumulator.noise_scale).
            self._update_noise_scale(noise_sums, means, weight_sum)
        self._updater.apply(grads, self._vars)
        self._reset_window(used)

    def _update_noise_scale(self, noise_sums, window_means, window_weight):
        """Folds the closing window into the estimate (before the update changes the loss scale)."""
        micro_sq_sum, inv_size_sum, micro_count = noise_sums
        window_sq = squared_norm(window_means)
        if self.loss_scale_optimizer is not None:
            # The window's gradients carry the loss scale (constant in a window).
            scale = ops.cast(self.loss_scale_optimizer.scale_loss(1.0), "float32")
            micro_sq_sum = micro_sq_sum / ops.square(scale)
            window_sq = window_sq / ops.square(scale)
        self._noise_estimate.update_from_window(
            micro_sq_sum, inv_size_sum, micro_count, window_sq, window_weight)

    def _reset_window(self, indices):
        """Empties the buffers at `indices` (the others are empty) and the weight."""
        for i in indices:
            accumulator = self._accumulators[i]
            empty = float("-inf") if i in self._overwrite_indices else 0.0
            accumulator.assign(ops.full(accumulator.shape, empty, accumulator.dtype))
        self._weight_sum.assign(0.0)
        for total in self._noise_sums:
            total.assign(0.0)

    # ------------------------------------------------------------ serializing
    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self._updater),
            "accum_steps": self.accum_steps,
            "partial_window": self.partial_window,
            "schedulable": self.schedulable,
            "measure_noise_scale": self.measure_noise_scale,
            "noise_scale_smoothing": self.noise_scale_smoothing,
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)
