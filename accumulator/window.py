"""The accumulation window: the state and the update rule every `GradientAccumulator` shares.

In the spirit of optax's `MultiSteps`: a small, explicit state (described in one
place, `AccumulationWindow`'s docstring: the step counter, the window length, the
window's weight, a dense sum per variable, the rows of sparse gradients, and the
noise-scale sums) and one update rule: add ``weight * grad`` to the accumulators (append its rows);
when the window is full, hand ``accumulators / weight_sum`` (and the rows divided
by ``weight_sum``, as one `tf.IndexedSlices`) to the inner optimizer exactly once
and reset the window. Everything the inner optimizer does per update
(learning-rate schedules, clipping, weight decay, Adam moments, EMA, loss scaling,
iteration count) therefore happens once per window, on the window's mean gradient.

Sparse gradients are kept as rows, not summed, because Keras 3 applies an
`IndexedSlices` with repeated indices row by row: its Adam squares each
occurrence (g1^2 + g2^2, not (g1 + g2)^2). The large batch's gradient holds one
row per looked-up occurrence; the window's rows are those same rows, so the inner
optimizer makes the update Keras makes for the large batch, whatever it does with
them. `merge_duplicate_rows=True` sums each index's rows first instead: the
densified gradient's mathematics (what `tf_keras` does). The rows cost memory in
proportion to the ids looked up in a window, not to the vocabulary.

`AccumulationWindow` holds that rule in TensorFlow ops only, so the Keras 3
optimizer (`accumulator.optimizer`) and the Keras 2 one (`accumulator.keras2`)
share it, and share the distribution mechanics of `accumulator._tf` (one
batched all-reduce per window). What differs between the Keras versions is what
each subclass supplies, in one place per Keras:

* ``_new_variable(shape, dtype, initial, name)``: a plain optimizer variable;
* ``_hand_to_updater(grads, variables)``: one update of the inner optimizer
  with a gradient that is already reduced across replicas;
* ``_updates_without_reduction()``: a context in which that holds;
* ``_window_gradient_scale()``: the loss scale the accumulated gradients carry
  (1 where they arrive unscaled).
"""

from __future__ import annotations

import logging

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import _tf, lookups, seam
from tfx_gradient_accumulator.accumulator.noise_scale import NoiseScaleEstimate, micro_batch_terms, squared_norm
from tfx_gradient_accumulator.accumulator.options import (  # noqa: F401  (the validators' names here before options.py)
    AUTO_START_ACCUM_STEPS, DEFAULT_SMOOTHING, LOSS_REDUCTIONS, PARTIAL_WINDOW_MODES, SUMMED_NOISE_SCALE_MESSAGE,
    WindowOptions, refuse_unknown_arguments, validate_accum_steps, validate_auto, validate_loss_reduction,
    validate_measure_noise_scale, validate_merge_duplicate_rows, validate_partial_window,
)

logger = logging.getLogger(__name__)

# What `accumulator.weighting` notes for a loss that sums over its samples.
SUMMED_LOSS = "sum"

__all__ = [
    "AccumulationWindow", "DEFAULT_SMOOTHING", "PARTIAL_WINDOW_MODES", "optimizer_chain",
    "validate_accum_steps", "validate_partial_window", "validate_measure_noise_scale",
]


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


def refuse_nested_accumulation(optimizer):
    """Raises if `optimizer` already accumulates (ours, or Keras' own steps)."""
    for inner in optimizer_chain(optimizer):
        if isinstance(inner, AccumulationWindow):
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


def _is_summed(noted_weight):
    return isinstance(noted_weight, str) and noted_weight == SUMMED_LOSS


def _accumulator_dtype(variable):
    # Half-precision sums lose the small gradients accumulation exists for.
    dtype = tf.as_dtype(variable.dtype)
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def _overwrites_with_gradient(variable):
    # Float8 training's scale and amax history (Keras 3): the "gradient" is the new value.
    return bool(getattr(variable, "overwrite_with_gradient", False))


class WindowRows:
    """The rows of one variable's sparse gradients in the open window.

    * ``values``   ``[capacity, *variable.shape[1:]]``: each row times its
                   micro-batch's weight, in the order the micro-batches came;
    * ``indices``  ``[capacity]``: the row of the variable each value is for;
    * ``count``    how many of the ``capacity`` rows the window holds.

    The buffers grow (to exactly the rows held) only when a micro-batch does not
    fit; after the first full window they are written in place. Replica-local
    under a strategy, like the accumulators.
    """

    def __init__(self, values, indices, count):
        self.values, self.indices, self.count = values, indices, count

    @property
    def variables(self):
        return [self.values, self.indices, self.count]


class AccumulationWindow:
    """The window state and update rule; mixed into each Keras' optimizer class.

    Subclasses call `_init_window(...)` in their constructor and
    `_build_window(var_list)` in their `build`, route each micro-batch through
    `_apply_micro_batch` (which runs `_update`, the whole flow), and supply the
    four methods listed in the module docstring.

    The state, all of it (the one place it is described). Optimizer variables,
    saved with the optimizer:

    * ``_micro_step``       int64, micro-batches in the open window (mirrored);
    * ``_accum_steps_var``  int64, micro-batches per window (mirrored; a schedule
                            changes it between windows without retracing);
    * ``_weight_sum``       float32, the window's summed micro-batch weights
                            (replica-local, summed when read across replicas);
    * ``_accumulators``     per variable, the weighted sum of the window's dense
                            gradients, float32 for half-precision variables
                            (replica-local; a one-row stand-in until the first
                            dense gradient; the running maximum for
                            `overwrite_with_gradient` variables);
    * ``_rows``             per variable of rank >= 1, its `WindowRows` (None for
                            scalars): the sparse gradients' rows (replica-local);
    * ``_noise_sums``       with `measure_noise_scale`: sum_k R^2 |g_k|^2,
                            sum_k 1/b_k and K of the open window (replica-local);
    * ``_noise_estimate``   with `measure_noise_scale`: the smoothed estimate
                            (`NoiseScaleEstimate`, mirrored).

    Python, set at construction or build: ``_vars`` (the variables, in order),
    ``_index_by_id``, ``_overwrite_indices``, ``_window_strategy`` (the strategy
    the window was built under), ``_passthrough`` (``accum_steps=1`` without
    `schedulable`: no buffers), ``_window_listeners`` (`AccumBatchNormalization`
    layers that follow the windows), ``fit_callback`` (set by `accumulating_compile`:
    makes the window callback every `fit` uses; None: a plain `EpochWindows`).

    Python, filled while steps are traced (so the same on every worker), read
    when a close is traced: ``_indices_with_grads`` (variables that got a
    gradient in any step: what a forced close applies), ``_seen_in_window``
    (eagerly, this window's), ``_dense_seen`` and ``_rows_seen`` (which
    variables got dense or sparse gradients: how each closes), and
    ``_once_per_batch`` ({variable index: the rows' count, or None when known
    only at run time}: the variables whose rows come from a lookup made once
    per batch, summed position by position across the window on one device;
    under R replicas each replica keeps its micro-batches' rows, and the close
    sums them into the R sets of rows Keras' large batch has, one per replica's
    share of the batch; see `accumulator.lookups`).
    """

    # ------------------------------------------------------------------ setup
    def _init_window(self, options: WindowOptions):
        # The options, checked once (`accumulator.options`); each also an attribute
        # of its own name (`partial_window`, `schedulable`, ...), read-only by use.
        self._untracked(options=options)
        self._accum_steps = options.accum_steps
        # accum_steps="auto": {"max_effective_batch_size", "lr_scaling"}; the rule
        # (`AutoAccumulation`) is made by the first `fit` (`accumulator.fit_hook`),
        # which knows the micro-batch, and kept here: its decisions carry on into a
        # later `fit` and into a `TrainingBackup`.
        self.auto = options.auto_settings
        self.auto_accumulation = None
        self.loss_reduction = options.loss_reduction
        self.merge_duplicate_rows = options.merge_duplicate_rows
        self.partial_window = options.partial_window
        # Indices of the variables that got gradients in any traced or eager
        # call: what a forced close of the window applies.
        self._indices_with_grads = set()
        self._close_function = None
        self._warned_eager_rows = False
        # Fixed at construction: a traced train step cannot switch paths later.
        self.schedulable = options.schedulable
        self._passthrough = options.is_passthrough
        self.measure_noise_scale = options.measure_noise_scale
        self.noise_scale_smoothing = options.noise_scale_smoothing
        self._seen_in_window = set()
        # Makes the window callback `fit` puts first (set by `accumulating_compile`).
        self.fit_callback = None
        self._untracked(_window_listeners=[], _vars=[], _index_by_id={}, _accumulators=[],
                        _overwrite_indices=frozenset(), _window_strategy=None,
                        _noise_estimate=None, _noise_sums=[], _rows=[], _rows_seen=set(), _dense_seen=set(),
                        _once_per_batch={})

    def _untracked(self, **attributes):
        # Plain Python state, set past TensorFlow's attribute tracking: the
        # variables are tracked by `add_variable`, the listening layers are
        # saved with their model, not with the optimizer.
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    def _build_window(self, var_list):
        """Creates the window's variables for `var_list` (the model's trainable variables)."""
        var_list = list(var_list)
        first_replica = tf.VariableAggregation.ONLY_FIRST_REPLICA
        with seam.variables_created_as(aggregation=first_replica):
            self._micro_step = self._new_variable((), tf.int64, 0, "micro_step")
            self._accum_steps_var = self._new_variable((), tf.int64, self._accum_steps, "accum_steps")
        # Replica-local: each replica sums its own micro-batches; the sums meet
        # in one batched all-reduce when the window closes.
        self._weight_sum = self._new_local_variable((), tf.float32, "weight_sum")
        overwrite = frozenset(i for i, v in enumerate(var_list) if _overwrites_with_gradient(v))
        # A pass-through never accumulates: it holds no buffers. Scalars and
        # overwrite-with-gradient variables get their buffer now; the others a
        # one-row stand-in, filled on their first dense gradient (`_ensure_dense`),
        # and row buffers for sparse gradients, which only gathers produce.
        accumulators, rows = [], []
        for i, v in ([] if self._passthrough else enumerate(var_list)):
            dtype = _accumulator_dtype(v)
            if i in overwrite or not v.shape.rank:
                accumulators.append(self._new_local_variable(
                    tuple(v.shape), dtype, f"accumulator_{i}",
                    initial=float("-inf") if i in overwrite else 0.0))
                rows.append(None)
                continue
            rest = tuple(v.shape)[1:]
            accumulators.append(self._new_local_variable((None,) + rest, dtype, f"accumulator_{i}"))
            # Replica 0's when read across replicas (checkpoints): summing rows
            # of different replicas would mean nothing. `window_state` saves
            # every replica's rows (Keras 3's saving calls it).
            rows.append(WindowRows(*[
                self._new_local_variable(shape, dt, f"rows_{i}_{part}", per_replica=True)
                for shape, dt, part in (((None,) + rest, dtype, "values"), ((None,), tf.int64, "indices"),
                                        ((), tf.int64, "count"))]))
        if self.measure_noise_scale:
            # Per replica, next to the accumulators: sum_k R^2 |g_k|^2, sum_k 1/b_k
            # and K, reduced with them once per window.
            noise_sums = [self._new_local_variable((), tf.float32, f"noise_scale_{name}")
                          for name in ("micro_sq_norm_sum", "inv_size_sum", "micro_count")]
            # The smoothed estimate: mirrored, updated after the window's reduction.
            with seam.variables_created_as(aggregation=first_replica):
                estimate = NoiseScaleEstimate(
                    lambda name, dtype: self._new_variable((), dtype, 0, f"noise_scale_{name}"),
                    smoothing=self.noise_scale_smoothing,
                )
            self._untracked(_noise_estimate=estimate, _noise_sums=noise_sums)
        self._untracked(_vars=var_list, _index_by_id={id(v): i for i, v in enumerate(var_list)},
                        _accumulators=accumulators, _rows=rows, _overwrite_indices=overwrite,
                        _window_strategy=tf.distribute.get_strategy())

    def _new_local_variable(self, shape, dtype, name, initial=0.0, per_replica=False):
        """A replica-local variable, summed over the replicas when read across them
        (replica 0's value if `per_replica`). `None` in `shape`: a buffer that
        changes size along that axis, made with one row (an empty tensor would
        reach collective reads, which crash on it under MultiWorkerMirroredStrategy)."""
        aggregation = (tf.VariableAggregation.ONLY_FIRST_REPLICA if per_replica
                       else tf.VariableAggregation.SUM)
        with seam.variables_created_as(
            synchronization=tf.VariableSynchronization.ON_READ, aggregation=aggregation,
            shape=shape if None in shape else None,
        ):
            return self._new_variable(shape, dtype, initial, name)

    # ------------------------------------------------------------- the state
    @property
    def is_passthrough(self):
        """True for `accum_steps=1` without `schedulable`: no buffers, no windows."""
        return self._passthrough

    @property
    def accum_steps(self):
        """Micro-batches per window. Once built, the variable's value: what a
        schedule set, and what a restored checkpoint or loaded model holds."""
        if self._window_built() and _tf.executing_eagerly():
            return int(self._accum_steps_var.numpy())
        return self._accum_steps

    def _window_built(self):
        return getattr(self, "_accum_steps_var", None) is not None

    @property
    def micro_step(self):
        """Micro-batches in the open window (0 right after an update)."""
        return self._micro_step

    @property
    def accumulators(self):
        """The dense gradient buffers, one per variable (a one-row stand-in until a dense
        gradient comes: `tf.shape(buffer)`, not Keras' `shape`, tells which)."""
        return list(self._accumulators)

    @property
    def window_rows(self):
        """Per variable, the `WindowRows` of its sparse gradients (None for scalars)."""
        return list(self._rows)

    @property
    def gradient_kinds(self):
        """{variable path: how the window holds its gradients}, for the variables that
        got one in a step so far: "dense" (a sum), "rows" (a sparse gradient's rows,
        kept apart as the large batch keeps them), "once-per-batch rows" (a lookup
        whose ids do not depend on the sample: one row per id position, the
        micro-batches summed into it; see `accumulator.lookups`), "dense + rows",
        or "maximum" (`overwrite_with_gradient` variables)."""
        kinds = {}
        for i in sorted(self._indices_with_grads):
            variable = self._vars[i]
            if i in self._overwrite_indices:
                kind = "maximum"
            elif i in self._rows_seen:
                kind = lookups.ONCE_PER_BATCH if i in self._once_per_batch else lookups.PER_SAMPLE
                kind = "dense + " + kind if i in self._dense_seen else kind
            else:
                kind = "dense"
            kinds[getattr(variable, "path", None) or variable.name] = kind
        return kinds

    @property
    def held_micro_batches(self):
        """Micro-batches in the open window, as an int (0 before the optimizer is built)."""
        if not self._window_built() or self._passthrough:
            return 0
        return int(self._micro_step.numpy())

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

    # ---------------------------------------------------------------- state
    def set_weights(self, weights):
        """Sets the wrapper's and the inner optimizers' state, in `variables` order."""
        if not (self._window_built() or getattr(self, "built", False)):
            raise ValueError("Build the optimizer (or train one step) before `set_weights()`.")
        variables = self.variables
        if len(weights) != len(variables):
            raise ValueError(
                f"`weights` must hold {len(variables)} arrays (the wrapper's and the inner "
                f"optimizer's variables, as `get_weights()` returns them); received {len(weights)}."
            )
        for variable, weight in zip(variables, weights):
            shape = tuple(weight.shape) if hasattr(weight, "shape") else tuple(np.shape(weight))
            # The window's buffers take any size along their open (None) axis.
            expected = _tf.backing_variable(variable).shape
            if not expected.is_compatible_with(shape):
                raise ValueError(
                    f"`weights` entry for {variable.name} has shape {shape}; "
                    f"expected {tuple(expected.as_list())}."
                )
        self.restore_window_state(weights)

    def get_weights(self):
        """The wrapper's and the inner optimizers' state as NumPy arrays, in `variables` order."""
        return self.window_state()

    def window_state(self):
        """Every variable's value as NumPy arrays, in `variables` order, for saving.

        The window is saved as one device would hold it, so a window saved under
        one number of replicas resumes under another: under R replicas each
        micro-batch weighs R times its samples (its gradient carries Keras' 1/R
        loss scaling), so the weight read across the replicas is divided by R.
        The rows of sparse gradients are every replica's, concatenated in replica
        order (a checkpoint reading the variables sees replica 0's alone).
        `restore_window_state` undoes both. (The noise-scale sums of an open
        window stay per replica micro-batch: a window resumed under another
        number of replicas mixes the two in its one estimate.)
        """
        if self._window_strategy is None:   # not built: no window, no replicas
            return [np.asarray(v.numpy()) for v in self.variables]
        seen = [rows for i, rows in enumerate(self._rows) if i in self._rows_seen]
        state = {id(v): np.asarray(v.numpy()) for v in self.variables if id(v) not in
                 {id(r.values) for r in seen} | {id(r.indices) for r in seen} | {id(r.count) for r in seen}}
        for rows, (values, indices) in zip(seen, _tf.rows_of_every_replica(
                [rows.variables for rows in seen], self._window_strategy)):
            state.update({id(rows.values): values, id(rows.indices): indices,
                          id(rows.count): np.int64(len(indices))})
        state[id(self._weight_sum)] = state[id(self._weight_sum)] / self._window_strategy.num_replicas_in_sync
        return [state[id(v)] for v in self.variables]

    def restore_window_state(self, state):
        """Assigns `state` (as `window_state` returns it) to `variables`; rows go to replica 0."""
        if self._window_strategy is None:   # not built: no window, no replicas
            for variable, value in zip(self.variables, state):
                _tf.backing_variable(variable).assign(value, read_value=False)
            return
        value_of = {id(v): np.asarray(value) for v, value in zip(self.variables, state)}
        weight = value_of[id(self._weight_sum)]
        value_of[id(self._weight_sum)] = weight * np.asarray(self._window_strategy.num_replicas_in_sync, weight.dtype)
        rows_variables = set()
        replica_ids = _tf.local_replica_ids(self._window_strategy)
        for rows in self._rows:
            if rows is None:
                continue
            rows_variables.update(map(id, rows.variables))
            _tf.place_rows_on_first_replica(
                rows.values, rows.indices, rows.count, value_of[id(rows.values)],
                value_of[id(rows.indices)][:int(value_of[id(rows.count)])],
                self._window_strategy, replica_ids)
        for variable in self.variables:
            if id(variable) not in rows_variables:
                _tf.backing_variable(variable).assign(value_of[id(variable)], read_value=False)

    # ------------------------------------------------------- between windows
    def close_partial_window(self, mode=None):
        """Applies ("apply"), keeps ("carry") or discards ("drop") an open window.

        Call it between training runs or where a custom loop's epoch ends;
        `fit` calls it with `partial_window` when an epoch and when training
        ends. Returns the number of micro-batches the window held.
        """
        mode = validate_partial_window(mode or self.partial_window, name="mode")
        if not self._window_built() or self._passthrough:
            return 0
        held = int(self._micro_step.numpy())
        if held == 0 or mode == "carry":
            return held
        # Layers pooling statistics per window (AccumBatchNormalization) close theirs too.
        for layer in self._window_listeners:
            layer.close_window(apply=mode == "apply")
        if mode == "drop":
            self._reset_window(range(len(self._accumulators)),
                               [i for i, rows in enumerate(self._rows) if rows is not None])
            self._micro_step.assign(0)
            self._seen_in_window = set()
        else:
            self._close_now()
        return held

    def _close_at_training_end(self):
        """What `finalize_variable_values` does first: close the open window."""
        held = self.close_partial_window()
        if held and self.partial_window == "carry":
            logger.warning(
                "Training ended with %d micro-batch(es) held in an open window "
                "(partial_window='carry'); they are applied by the next fit or by "
                "close_partial_window('apply'), and are not in the weights yet.", held,
            )

    def set_accum_steps(self, accum_steps):
        """Changes the window length from the next window on (no retracing)."""
        accum_steps = validate_accum_steps(accum_steps)
        if self._passthrough and accum_steps != 1:
            raise ValueError(
                "This GradientAccumulator was made with `accum_steps=1` and "
                "`schedulable=False`, a pass-through without buffers; construct "
                "it with `schedulable=True` to change `accum_steps` later."
            )
        if self._window_built() and int(self._micro_step.numpy()):
            raise ValueError(
                "`accum_steps` can change only between windows; close the open "
                "window first (`close_partial_window`)."
            )
        self._accum_steps = accum_steps
        if self._window_built():
            self._accum_steps_var.assign(accum_steps)
        for layer in self._window_listeners:
            layer.set_accum_steps(accum_steps)

    # ------------------------------------------------------- the update rule
    def _apply_micro_batch(self, grads, trainable_variables, micro_batch_weight, noted_weight):
        """One micro-batch of `grads` for `trainable_variables` (built optimizer)."""
        indices = [self._variable_index(v) for v in trainable_variables]
        if not grads:
            return
        if self._passthrough:
            # Transparent: the inner optimizer sees exactly what it would alone. Its
            # count waits for the gradients: the step Keras runs on a dataset of
            # unknown size that has run out makes no update and counts none.
            with tf.control_dependencies([g.values if isinstance(g, tf.IndexedSlices) else g
                                          for g in grads if g is not None]):
                self._hand_to_updater(grads, trainable_variables, reduced=False)
            return
        weight, divisor = self._micro_batch_weights(micro_batch_weight, noted_weight)
        self._update(grads, indices, weight, divisor=divisor)

    def _micro_batch_weights(self, micro_batch_weight, noted_weight):
        """(what the micro-batch's gradient is multiplied by, what it adds to the divisor).

        A loss that is a mean (S_k / D_k, `accumulator.weighting`) weighs D_k in
        both: the window's gradient is sum(D_k g_k) / sum(D_k). A loss that sums
        over its samples (reduction "sum" or "none": S_k) weighs 1, and the
        window divides by 1, not by its micro-batches: its gradient is sum(g_k),
        the large batch's sum. Under R replicas each replica adds 1 at the
        window's start, and the close divides the reduced weight by R.
        """
        summed = self.loss_reduction == "sum" or (
            self.loss_reduction == "auto" and micro_batch_weight is None and _is_summed(noted_weight))
        if summed:
            if self.measure_noise_scale:
                raise ValueError(SUMMED_NOISE_SCALE_MESSAGE)
            if micro_batch_weight is not None:
                raise ValueError(
                    "`micro_batch_weight` is for losses that are means; this GradientAccumulator "
                    "has loss_reduction='sum' (the window sums the micro-batches' gradients, "
                    "as the large batch sums its samples'): leave it out.")
            return 1.0, tf.cast(tf.equal(self._micro_step, 0), tf.float32)
        if micro_batch_weight is None:
            micro_batch_weight = 1.0 if noted_weight is None or _is_summed(noted_weight) else noted_weight
        return micro_batch_weight, micro_batch_weight

    def _update(self, grads, indices, weight=1.0, close_only=False, divisor=None):
        """The window's whole flow: add a micro-batch, count it, and when the window is
        full close it: reduce it over the replicas, apply its mean, reset it.

        `close_only`: no micro-batch; close the window as it stands (a partial
        window's "apply"). Under a strategy, counting and closing run in
        cross-replica context, so the inner optimizer's own `merge_call` never
        sits inside a replica-context `cond`; the mean is applied in each replica.
        """
        _tf.refuse_cross_replica_context()
        with_grads = {i for g, i in zip(grads, indices) if g is not None}
        self._indices_with_grads |= with_grads
        if close_only:
            with_grads = set(self._indices_with_grads)
        else:
            # 1. Add: each replica adds `weight * grad` to its own buffers.
            self._accumulate(grads, indices, weight, weight if divisor is None else divisor)

        def count_and_close(distribution):      # `distribution`: None without a strategy
            if close_only:
                full = self._micro_step > 0
            else:
                # 2. Count, once the micro-batch exists: when the data runs out, `fit`
                # calls the step once more, and only ops that wait on the data fail.
                _tf.assign_add_after(self._micro_step, 1, after=[weight] + [g for g in grads if g is not None][:1])
                full = self._micro_step >= self._accum_steps_var

            def close():
                dense, rows = self._window_kinds(sorted(with_grads | self._seen_in_window))
                # 3. Reduce: the sums and the weight, in one all-reduce (none on one device).
                sums, weight_sum, noise_sums = self._window_sums(distribution, dense)
                # 4. Apply the window's mean and 5. reset, in each replica.
                _tf.in_each_replica(distribution, self._updates_without_reduction,
                                    self._apply_mean_and_reset, dense, rows, sums, weight_sum, noise_sums)
                self._micro_step.assign(0)
                self._seen_in_window = set()

            tf.cond(full, close, lambda: None)

        _tf.in_cross_replica_context(count_and_close)

    def _close_now(self):
        """Closes the open window eagerly, under the strategy it was built in."""
        if self._close_function is None:
            strategy = self._window_strategy

            def close_in_each_replica():
                self._update([], [], close_only=True)

            def close():
                strategy.run(close_in_each_replica)

            self._close_function = tf.function(close)
        self._close_function()

    def _variable_index(self, variable):
        index = self._index_by_id.get(id(variable))
        if index is None:
            raise ValueError(
                f"Unknown variable {getattr(variable, 'path', None) or variable.name}: this "
                "GradientAccumulator was built for other variables (one optimizer per model; "
                "call `build` with all the variables it will update)."
            )
        return index

    def _accumulate(self, grads, indices, weight=1.0, divisor=1.0):
        """Replica-local: adds `weight * grad` into the window's buffers, and `divisor`
        to the window's weight (see `_micro_batch_weights`).

        `overwrite_with_gradient` variables keep the window's running maximum.
        """
        weight = tf.cast(weight, tf.float32)
        for grad, index in zip(grads, indices):
            if grad is None:
                continue
            if _tf.executing_eagerly():
                self._seen_in_window.add(index)
            if index in self._overwrite_indices:
                _tf.keep_maximum(self._accumulators[index], grad)
            elif isinstance(grad, tf.IndexedSlices) and self._keeps_rows(index, grad):
                self._rows_seen.add(index)
                rows = self._rows[index]
                if index in self._once_per_batch and _tf.replicas_in_sync() == 1:
                    _tf.add_rows_in_place(rows.values, rows.indices, rows.count, grad, weight,
                                          self._window_strategy)
                else:
                    _tf.append_rows(rows.values, rows.indices, rows.count, grad, weight)
            else:
                self._ensure_dense(index)
                _tf.add_weighted(self._accumulators[index], grad, weight)
        self._weight_sum.assign_add(tf.cast(divisor, tf.float32))
        if self._noise_sums:
            # This replica's micro-batch: R^2 |g|^2, R/w and 1 (R the replicas,
            # as in the window gradient; see `accumulator.noise_scale`).
            terms = micro_batch_terms(
                [g for g, i in zip(grads, indices) if i not in self._overwrite_indices],
                weight, _tf.replicas_in_sync(),
            )
            for total, term in zip(self._noise_sums, terms):
                total.assign_add(term)

    def _keeps_rows(self, index, grad):
        """Whether a sparse gradient `grad` for variable `index` goes to its row buffers.

        Rows of a lookup made once per batch (`accumulator.lookups`, decided here
        from the traced program and remembered, for eager steps, in
        `_once_per_batch`) are summed position by position in buffers of a size
        fixed when the step is traced: kept everywhere, XLA included.

        Not where the buffers cannot be used: under XLA (`jit_compile=True`),
        which cannot compile buffers that change size, and, for a class whose
        checkpoints would read replica 0's rows alone, under several replicas.
        There a sparse gradient is summed densely, which makes the same update
        where repeated rows are summed anyway (`merge_duplicate_rows=True`, or an
        inner optimizer that sums them itself); otherwise it is refused.
        """
        if self._rows[index] is None:
            return False
        kind = lookups.kind_of_rows(grad.indices)
        if kind == lookups.ONCE_PER_BATCH:
            self._once_per_batch[index] = grad.indices.shape.num_elements()
        elif kind == lookups.PER_SAMPLE:
            self._once_per_batch.pop(index, None)
        elif index not in self._once_per_batch and not self._warned_eager_rows:
            self._warned_eager_rows = True
            logger.warning(
                "GradientAccumulator got a sparse gradient in an eager step (no tf.function, or "
                "run_eagerly=True): with no traced program to read, it cannot tell a lookup made "
                "once per batch (a position table's arange) from a lookup per sample, and keeps "
                "every micro-batch's rows apart. A once-per-batch lookup then trains unlike the "
                "large batch with Adam-like optimizers; run the step in a tf.function.")
        xla = seam.in_xla_context()
        if index in self._once_per_batch and (not xla or self._once_per_batch[index] is not None):
            return True
        if not xla and (_tf.replicas_in_sync() == 1 or self.keeps_rows_across_replicas):
            return True
        if self.merge_duplicate_rows or self.inner_sums_repeated_rows:
            return False
        variable = self._vars[index]
        raise ValueError(
            f"GradientAccumulator got a sparse gradient (tf.IndexedSlices, from an Embedding or "
            f"another gather) for {getattr(variable, 'path', None) or variable.name} inside an "
            "XLA-compiled step (jit_compile=True; Keras' default jit_compile='auto' turns XLA on "
            "for one GPU). Keras 3 applies the large batch's repeated rows one by one, and the "
            "window hands them over that way only outside XLA (its row buffers change size). "
            "Compile with jit_compile=False for Keras' large-batch update, or construct the "
            "GradientAccumulator with merge_duplicate_rows=True to sum each index's rows first "
            "(the densified gradient), which XLA compiles.")

    # Whether the inner optimizer sums repeated rows of a sparse gradient itself
    # (Keras 2's do; Keras 3's apply them one by one).
    inner_sums_repeated_rows = False

    # Whether rows are kept under several replicas: only where the class saves
    # them itself (`window_state`), since a checkpoint reads replica 0's alone.
    keeps_rows_across_replicas = True

    def _ensure_dense(self, index):
        """Fills variable `index`'s dense buffer with zeros if it is still a stand-in.

        Runs when a micro-step is traced (or eagerly), outside any graph, so the
        buffer exists before the step does; a buffer restored from a checkpoint
        already holds its sums and is left as it is.
        """
        variable = self._vars[index]
        _tf.fill_to(self._accumulators[index], tuple(variable.shape), self._window_strategy)
        self._dense_seen.add(index)

    def _window_kinds(self, used):
        """`used` split into the variables with dense sums and those with rows.

        Decided when the window's close is traced: the buffers filled so far
        (also by a restored checkpoint) and the sparse gradients seen, the same
        on every worker.
        """
        dense = [i for i in used if i in self._dense_seen or (
            self._rows[i] is None or self._vars[i].shape[0] != 1) and _tf.is_filled(
                self._accumulators[i], tuple(self._vars[i].shape), self._window_strategy)]
        rows = [i for i in used if i in self._rows_seen]
        return dense, rows

    def _window_sums(self, distribution, dense):
        """The window's dense sums (at `dense`), weight and noise-scale sums.

        Without a strategy, the local buffers themselves (divided in place later:
        no second copy). Under one, summed over the replicas in one batched
        all-reduce; the sums of Keras' scaled losses then carry each replica's
        1/replicas, which the weight, summed the same way, divides out. Maxima
        (`overwrite_with_gradient` variables) are reduced in the replicas.
        """
        local = [_tf.backing_variable(self._accumulators[i]) for i in dense]
        weight = _tf.backing_variable(self._weight_sum)
        noise = [_tf.backing_variable(total) for total in self._noise_sums]
        if distribution is None:
            return local, weight, noise
        summed = [k for k, i in enumerate(dense) if i not in self._overwrite_indices]
        first = self._vars[0]
        reduced = _tf.sum_over_replicas(
            distribution,
            [(local[k], self._vars[dense[k]]) for k in summed] + [(weight, first)] + [(n, first) for n in noise])
        sums = list(local)
        for k, total in zip(summed, reduced):
            sums[k] = total
        return sums, reduced[len(summed)], reduced[len(summed) + 1:]

    def _apply_mean_and_reset(self, dense, rows, sums, weight_sum, noise_sums=()):
        """Replica-local: hands the inner optimizer the window's mean gradient once, then
        empties the window.

        `dense` lists the variables with dense sums in the window, `sums` those
        sums (reduced; for `overwrite_with_gradient` variables, their maxima),
        `rows` the variables with sparse rows (gathered here across the
        replicas), `weight_sum` the window's weight summed over the replicas;
        the other variables get `None`, as in the large batch. `noise_sums`
        are the window's (reduced) noise-scale sums when it measures.
        """
        weight_sum = weight_sum / _tf.replicas_in_sync()
        grads = [None] * len(self._vars)
        summed = [(i, total) for i, total in zip(dense, sums) if i not in self._overwrite_indices]
        for i, total in zip(dense, sums):
            if i in self._overwrite_indices:
                grads[i] = tf.cast(_tf.maximum_over_replicas(total), self._vars[i].dtype)
        # In place where the sums lie in local buffers: no second copy (see _tf.divide_in_place).
        means = _tf.divide_in_place([total for _, total in summed], weight_sum)
        for (i, _), mean in zip(summed, means):
            grads[i] = tf.cast(mean, self._vars[i].dtype)
        row_means = [self._mean_rows(i, weight_sum) for i in rows]
        for i, mean in zip(rows, row_means):
            # A variable with dense and sparse gradients in one window gets their sum.
            grads[i] = mean if grads[i] is None else _tf.add_rows(grads[i], mean)
        if self._noise_estimate is not None:
            # The window's size: its weight over the replicas (see accumulator.noise_scale).
            self._update_noise_scale(noise_sums, means + row_means, weight_sum)
        self._hand_to_updater(grads, self._vars, reduced=True)
        # Refill once the update has read the means: reading the variables it
        # wrote orders the refill after it (automatic control dependencies).
        self._reset_window(dense, rows, after=[
            tf.convert_to_tensor(_tf.backing_variable(self._vars[i])) for i, _ in summed])

    def _mean_rows(self, index, weight_sum):
        """Variable `index`'s rows of the window, from every replica, divided by its weight.

        The `tf.IndexedSlices` the large batch's gradient would be: one row per
        looked-up occurrence, in the order of the samples (of replica 0's
        samples, then replica 1's, as Keras gathers them), or, with
        `merge_duplicate_rows`, one row per index.
        """
        variable, rows = self._vars[index], self._rows[index]
        shape = tf.constant(tuple(variable.shape), tf.int64)
        count = self._once_per_batch.get(index)     # known when traced, for XLA
        if _tf.replicas_in_sync() == 1:
            # Divided where they lie (see _tf.divide_in_place): no second copy of the
            # rows next to the buffer while the inner optimizer runs.
            _tf.divide_in_place([_tf.backing_variable(rows.values)], weight_sum)
            slices = tf.IndexedSlices(*_tf.read_rows(rows.values, rows.indices, rows.count, count), shape)
        else:
            slices = _tf.gather_over_replicas(tf.IndexedSlices(
                *_tf.read_rows(rows.values, rows.indices, rows.count), shape))
            if count is not None:
                slices = _tf.rows_of_replicas_of_the_large_batch(
                    slices, count, _tf.replicas_in_sync(), tuple(variable.shape)[1:])
            slices = tf.IndexedSlices(slices.values / tf.cast(weight_sum, slices.values.dtype),
                                      slices.indices, slices.dense_shape)
        if self.merge_duplicate_rows:
            slices = _tf.merge_duplicate_rows(slices)
        return tf.IndexedSlices(tf.cast(slices.values, variable.dtype), slices.indices, slices.dense_shape)

    def _update_noise_scale(self, noise_sums, window_means, window_weight):
        """Folds the closing window into the estimate (before the update changes the loss scale)."""
        micro_sq_sum, inv_size_sum, micro_count = noise_sums
        window_sq = squared_norm(window_means)
        scale = self._window_gradient_scale()
        if scale is not None:
            # The window's gradients carry the loss scale (constant in a window).
            scale = tf.cast(scale, tf.float32)
            micro_sq_sum = micro_sq_sum / tf.square(scale)
            window_sq = window_sq / tf.square(scale)
        self._noise_estimate.update_from_window(
            micro_sq_sum, inv_size_sum, micro_count, window_sq, window_weight)

    def _reset_window(self, indices, row_indices=(), after=()):
        """Empties the buffers at `indices` and the rows at `row_indices` (the
        others are empty) and the weight. Row buffers keep their capacity."""
        indices = list(indices)
        _tf.fill_one_after_another(
            [self._accumulators[i] for i in indices],
            [float("-inf") if i in self._overwrite_indices else 0.0 for i in indices],
            after=after,
        )
        for i in row_indices:
            self._rows[i].count.assign(0)
        self._weight_sum.assign(0.0)
        for total in self._noise_sums:
            total.assign(0.0)

    def _window_config(self):
        # The options as built, with the window's length now (a schedule may have changed it).
        config = self.options.get_config()
        if not self.options.auto:
            config["accum_steps"] = self.accum_steps
        return config

    # ------------------------------------------------ what each Keras supplies
    def _new_variable(self, shape, dtype, initial, name):
        raise NotImplementedError

    def _hand_to_updater(self, grads, variables, reduced):
        raise NotImplementedError

    def _updates_without_reduction(self):
        raise NotImplementedError

    def _window_gradient_scale(self):
        raise NotImplementedError
