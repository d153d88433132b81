"""The accumulation window: the state and the update rule every `GradientAccumulator` shares.

`WindowState` declares every variable of the state in one place; `AccumulationWindow`
holds the update rule (`_update`: add `weight * grad`; when the window is full, hand the
window's mean to the inner optimizer once and reset). Rows, replicas and saving live in
`window_rows`, `replicas` and `window_saving`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Optional

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, replicas, seam
from tfx_gradient_accumulator.accumulator.rows import lookups, window_rows
from tfx_gradient_accumulator.accumulator.noise import preconditioning, window_noise
from tfx_gradient_accumulator.accumulator.window import window_saving
from tfx_gradient_accumulator.accumulator.window.loop_notes import LoopNotes
from tfx_gradient_accumulator.accumulator.noise.noise_scale import NoiseScaleEstimate
from tfx_gradient_accumulator.accumulator.core.options import (  # noqa: F401  (the validators' names here before options.py)
    AUTO_START_ACCUM_STEPS, DEFAULT_SMOOTHING, LOSS_REDUCTIONS, PARTIAL_WINDOW_MODES, SUMMED_NOISE_SCALE_MESSAGE,
    WindowOptions, refuse_unknown_arguments, validate_accum_steps, validate_auto, validate_loss_reduction,
    validate_measure_noise_scale, validate_merge_duplicate_rows, validate_partial_window,
)
from tfx_gradient_accumulator.accumulator.rows.window_rows import WindowRows  # noqa: F401  (also its public home)

logger = logging.getLogger(__name__)

# What `accumulator.window.weighting` notes for a loss that sums over its samples.
SUMMED_LOSS = "sum"

__all__ = [
    "AccumulationWindow", "DEFAULT_SMOOTHING", "PARTIAL_WINDOW_MODES", "optimizer_chain",
    "validate_accum_steps", "validate_partial_window", "validate_measure_noise_scale",
]


def optimizer_chain(optimizer) -> list:
    """`optimizer` and every optimizer it wraps (`inner_optimizer`, `optimizers`).

    Args:
        optimizer: a Keras 3 or Keras 2 optimizer.

    Returns:
        The optimizers, `optimizer` first.
    """
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


def refuse_nested_accumulation(optimizer) -> None:
    """Refuses an optimizer that already accumulates (ours, or Keras' own steps).

    Args:
        optimizer: the optimizer to wrap.

    Raises:
        TypeError: it (or one it wraps) is a `GradientAccumulator`.
        ValueError: it was built with Keras' own `gradient_accumulation_steps`.
    """
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
    """Whether the noted weight says the loss sums over its samples (`SUMMED_LOSS`)."""
    return isinstance(noted_weight, str) and noted_weight == SUMMED_LOSS


def _signs_of_the_micro_batch(weight, grads):
    """What the window's count waits on: tensors that exist only once the micro-batch does.

    The micro-batch's weight where it is computed from the batch (the loss's
    denominator the `compute_loss` hook hands over: the forward pass, not the
    backward one); else the gradient a backward pass makes first, the last
    variable's (the output layer's, where variables are in the layers' order), not
    the first one's, which waits on the whole pass.
    """
    if tf.is_tensor(weight) and tf.get_static_value(weight) is None:
        return [weight]
    return [g for g in grads if g is not None][-1:]


def _accumulator_dtype(variable):
    """The dtype of `variable`'s window sum: float32 for half-precision variables."""
    # Half-precision sums lose the small gradients accumulation exists for.
    dtype = tf.as_dtype(variable.dtype)
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def _overwrites_with_gradient(variable):
    """Whether `variable`'s "gradient" is its new value (float8 scales): it gets the window's maximum."""
    # Float8 training's scale and amax history (Keras 3): the "gradient" is the new value.
    return bool(getattr(variable, "overwrite_with_gradient", False))


class NotedWeight(threading.local):
    """The loss denominator the `compute_loss` hook handed over for the next micro-batch.

    Per thread, since MirroredStrategy traces each replica's step in its own
    thread, and noted with the graph it was computed in: a weight noted while
    one step was traced is not taken by another (or eagerly).

    Attributes:
        weight: the micro-batch's loss denominator D_k (a float32 tensor), or
            `SUMMED_LOSS` for a loss that sums over its samples; None: none noted.
        samples: the micro-batch's samples n_k (a float32 tensor), or None: the
            noise scale counts in samples, the loss weighs D_k (tokens, for
            sequence outputs).
        graph: the graph being traced when it was noted (None eagerly).
    """

    def __init__(self):
        self.weight = self.samples = self.graph = None

    def hand_over(self, weight, samples=None) -> None:
        """Notes `weight` for this thread's next micro-batch, in the current graph.

        Args:
            weight: the micro-batch's loss denominator (a tensor or a number).
            samples: its samples (a tensor or a number), or None.
        """
        self.weight, self.samples, self.graph = weight, samples, _tf.current_graph()

    def take(self):
        """(weight, samples) noted in this thread and graph, or (None, None); forgets them either way."""
        noted, graph = (self.weight, self.samples), self.graph
        self.weight = self.samples = self.graph = None
        return noted if noted[0] is not None and graph is _tf.current_graph() else (None, None)


@dataclasses.dataclass(eq=False)
class WindowState:
    """Everything an `AccumulationWindow` holds besides its options: declared here, once.

    Optimizer variables, made by `build` and saved with the optimizer.
    "Mirrored": one value on every replica; "replica-local": each replica sums its
    own micro-batches, and the sums meet in one all-reduce when the window closes.

    Attributes:
        micro_step: int64, micro-batches in the open window (mirrored).
        accum_steps: int64, micro-batches per window (mirrored; a schedule changes
            it between windows without retracing).
        weight_sum: float32, the window's summed micro-batch weights
            (replica-local, summed when read across replicas).
        accumulators: per variable, the weighted sum of the window's dense
            gradients, float32 for half-precision variables (replica-local; a
            one-row stand-in until the first dense gradient; the running maximum
            for `overwrite_with_gradient` variables).
        rows: per variable of rank >= 1, its `WindowRows` (None for scalars): the
            sparse gradients' rows (replica-local; `accumulator.rows.window_rows`).
        noise_sums: with `measure_noise_scale`: the open window's sums, one float32 vector
            (`window_noise.SUM_FIELDS`, b_k in samples; replica-local).
        noise_estimate: with `measure_noise_scale`: the smoothed estimate
            (`NoiseScaleEstimate`, mirrored).
        preconditioner: the inner optimizer's `Preconditioner` when it has a second
            moment (Adam-like) and the window measures; `preconditioned_estimate` is
            then the estimate of P g's noise scale (the one Adam's steps follow).
        noise_squares: with a `preconditioner`: the open window's sum_k g_k^2 per coordinate
            of the variables at `noise_layout` (joined flat), to which the close applies P
            once (replica-local; `window_noise`).
        noise_layout: the non-`overwrite_with_gradient` variables' indices, `noise_squares`' order.
        variables: the model's variables the window is for, in order (`build`).
        index_by_id: {id(variable): its index in `variables`}.
        overwrite_indices: the `overwrite_with_gradient` variables' indices.
        strategy: the strategy the window was built under (None before `build`).
        listeners: `AccumBatchNormalization` layers that follow the windows.
        noted_weight: the hook's hand-over of each micro-batch's weight
            (`NotedWeight`: per thread and graph).
        with_grads: (Python, filled while steps are traced, so the same on every
            worker; read when a close is traced) variables that got a gradient
            in any step: what a forced close applies.
        seen_in_window: eagerly, the variables with gradients in this window.
        dense_seen: variables that got dense gradients (they close as sums).
        rows_seen: variables that got sparse gradients kept as rows.
        once_per_batch: {variable index: the rows' count, or None when known only
            at run time}: rows of a lookup made once per batch, summed position by
            position on one device; under R replicas the close sums them into the
            R sets of rows Keras' large batch has (`accumulator.rows.lookups`).
        row_room: {variable index: rows of one micro-batch}: under XLA, the row
            buffers' room is that times the window's length, made outside the step
            (`window_rows.has_room`, `accumulator.rows.row_room`).
        built_accum_steps: the window's length when `build` made the variables (what
            `accum_steps` holds before its initial value is assigned).
        warned_eager_rows: whether the warning on eager sparse gradients was given.
        close_function: the traced eager close (`close_partial_window`), once made.
        loop_notes: what a custom loop is warned of (`accumulator.window.loop_notes`).
    """

    micro_step: Any = None
    accum_steps: Any = None
    weight_sum: Any = None
    accumulators: list = dataclasses.field(default_factory=list)
    rows: list = dataclasses.field(default_factory=list)
    noise_sums: Any = None
    noise_estimate: Optional[NoiseScaleEstimate] = None
    preconditioner: Any = None
    preconditioned_estimate: Optional[NoiseScaleEstimate] = None
    noise_squares: Any = None
    noise_layout: tuple = ()
    variables: list = dataclasses.field(default_factory=list)
    index_by_id: dict = dataclasses.field(default_factory=dict)
    overwrite_indices: frozenset = frozenset()
    strategy: Any = None
    listeners: list = dataclasses.field(default_factory=list)
    noted_weight: NotedWeight = dataclasses.field(default_factory=NotedWeight)
    with_grads: set = dataclasses.field(default_factory=set)
    seen_in_window: set = dataclasses.field(default_factory=set)
    dense_seen: set = dataclasses.field(default_factory=set)
    rows_seen: set = dataclasses.field(default_factory=set)
    once_per_batch: dict = dataclasses.field(default_factory=dict)
    row_room: dict = dataclasses.field(default_factory=dict)
    built_accum_steps: int = 1
    warned_eager_rows: bool = False
    close_function: Any = None
    loop_notes: LoopNotes = dataclasses.field(default_factory=LoopNotes)

    def built(self):
        """Whether `build` made the variables."""
        return self.accum_steps is not None

    def build(self, var_list, new_variable, accum_steps, passthrough, noise_smoothing, preconditioner=None):
        """Makes the variables for `var_list` (the model's trainable variables).

        Args:
            var_list: the variables the window is for, in order.
            new_variable: the optimizer's `_new_variable(shape, dtype, initial, name)`.
            accum_steps: the window's length to start with.
            passthrough: a pass-through never accumulates: it gets no buffers.
            noise_smoothing: the noise-scale estimate's smoothing, or None when not measuring.
            preconditioner: the inner optimizer's `Preconditioner` (measured beside the
                raw noise scale), or None.
        """
        first_replica = tf.VariableAggregation.ONLY_FIRST_REPLICA

        def local(shape, dtype, name, initial=0.0, per_replica=False):
            # Replica-local, summed over the replicas when read across them (replica 0's
            # if `per_replica`). `None` in `shape`: a buffer that changes size along that
            # axis, made with one row (an empty tensor would reach collective reads,
            # which crash on it under MultiWorkerMirroredStrategy). Its `shape` says
            # what it holds (`seam.reports_held_shape`): one row, then its full size.
            with seam.variables_created_as(
                    synchronization=tf.VariableSynchronization.ON_READ, shape=shape if None in shape else None,
                    aggregation=first_replica if per_replica else tf.VariableAggregation.SUM):
                variable = new_variable(shape, dtype, initial, name)
            return seam.reports_held_shape(variable) if None in shape else variable

        var_list = list(var_list)
        with seam.variables_created_as(aggregation=first_replica):
            self.micro_step = new_variable((), tf.int64, 0, "micro_step")
            steps = new_variable((), tf.int64, accum_steps, "accum_steps")
        self.weight_sum = local((), tf.float32, "weight_sum")
        overwrite = frozenset(i for i, v in enumerate(var_list) if _overwrites_with_gradient(v))
        # Scalars and overwrite-with-gradient variables get their buffer now; the
        # others a one-row stand-in, filled on their first dense gradient, and row
        # buffers for sparse gradients, which only gathers produce.
        accumulators, rows = [], []
        for i, v in ([] if passthrough else enumerate(var_list)):
            dtype = _accumulator_dtype(v)
            if i in overwrite or not v.shape.rank:
                accumulators.append(local(tuple(v.shape), dtype, f"accumulator_{i}",
                                          initial=float("-inf") if i in overwrite else 0.0))
                rows.append(None)
                continue
            rest = tuple(v.shape)[1:]
            accumulators.append(local((None,) + rest, dtype, f"accumulator_{i}"))
            # Replica 0's when read across replicas (checkpoints): summing rows of
            # different replicas would mean nothing; `window_saving` saves every replica's.
            rows.append(WindowRows(*[
                local(shape, dt, f"rows_{i}_{part}", per_replica=True)
                for shape, dt, part in (((None,) + rest, dtype, "values"), ((None,), tf.int64, "indices"),
                                        ((), tf.int64, "count"))]))
        if noise_smoothing is not None:
            window_noise.build(self, local, var_list, overwrite, preconditioner)
            with seam.variables_created_as(aggregation=first_replica):
                self.noise_estimate = NoiseScaleEstimate(
                    lambda name, dtype, shape=(): new_variable(shape, dtype, 0, f"noise_scale_{name}"),
                    smoothing=noise_smoothing)
                if self.preconditioner is not None:
                    self.preconditioned_estimate = NoiseScaleEstimate(
                        lambda name, dtype, shape=(): new_variable(shape, dtype, 0, f"preconditioned_{name}"),
                        smoothing=noise_smoothing)
        self.variables, self.index_by_id = var_list, {id(v): i for i, v in enumerate(var_list)}
        self.accumulators, self.rows, self.overwrite_indices = accumulators, rows, overwrite
        self.strategy, self.accum_steps, self.built_accum_steps = tf.distribute.get_strategy(), steps, accum_steps

    def index_of(self, variable) -> int:
        """`variable`'s index in `variables`.

        Args:
            variable: a model variable.

        Returns:
            Its index.

        Raises:
            ValueError: the window was not built for it.
        """
        index = self.index_by_id.get(id(variable))
        if index is None:
            raise ValueError(
                f"Unknown variable {getattr(variable, 'path', None) or variable.name}: this "
                "GradientAccumulator was built for other variables (one optimizer per model; "
                "call `build` with all the variables it will update)."
            )
        return index

    def gradient_kinds(self):
        """{variable path: how the window holds its gradients} (`AccumulationWindow.gradient_kinds`)."""
        kinds = {}
        for i in sorted(self.with_grads):
            if i in self.overwrite_indices:
                kind = "maximum"
            elif i in self.rows_seen:
                kind = lookups.ONCE_PER_BATCH if i in self.once_per_batch else lookups.PER_SAMPLE
                kind = "dense + " + kind if i in self.dense_seen else kind
            else:
                kind = "dense"
            kinds[getattr(self.variables[i], "path", None) or self.variables[i].name] = kind
        return kinds


class WindowReadings:
    """What an `AccumulationWindow` shows of its state (`self._state`, a `WindowState`)."""

    def _untracked(self, **attributes):
        """Sets plain Python attributes past TensorFlow's tracking."""
        # Plain Python state, set past TensorFlow's attribute tracking: the
        # variables are tracked by `add_variable`, the listening layers are
        # saved with their model, not with the optimizer.
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    # The options, read from `self.options` (fixed at construction: a traced train
    # step cannot switch paths later).
    @property
    def is_passthrough(self):
        """True for `accum_steps=1` without `schedulable`: no buffers, no windows."""
        return self.options.is_passthrough

    @property
    def auto(self):
        """With accum_steps="auto": {"max_effective_batch_size", "lr_scaling"}; else None."""
        return self.options.auto_settings

    @property
    def partial_window(self):
        """What an epoch's end does with an open window: "apply", "carry" or "drop"."""
        return self.options.partial_window

    @property
    def schedulable(self):
        """Whether the window keeps its buffers so that `accum_steps` can change."""
        return self.options.schedulable

    @property
    def measure_noise_scale(self):
        """Whether the windows measure the gradient noise scale."""
        return self.options.measure_noise_scale

    @property
    def noise_scale_smoothing(self):
        """The decay of the noise scale's moving averages over windows."""
        return self.options.noise_scale_smoothing

    @property
    def merge_duplicate_rows(self):
        """Whether a sparse gradient's rows are summed per index before the inner update."""
        return self.options.merge_duplicate_rows

    @property
    def loss_reduction(self):
        """How the loss reduces over its samples: "auto", "mean" or "sum"."""
        return self.options.loss_reduction

    @property
    def accum_steps(self):
        """Micro-batches per window. Once built, the variable's value: what a
        schedule set, and what a restored checkpoint or loaded model holds."""
        if self._window_built() and tf.executing_eagerly():
            return int(self._state.accum_steps.numpy())
        return self._accum_steps

    def _window_built(self):
        """Whether the window's state exists (built on the first micro-batch)."""
        state = getattr(self, "_state", None)
        return state is not None and state.built()

    @property
    def micro_step(self):
        """Micro-batches in the open window (0 right after an update)."""
        return self._state.micro_step

    @property
    def accumulators(self):
        """The dense gradient buffers, one per variable (a one-row stand-in until a dense
        gradient comes; each one's `shape` says what it holds)."""
        return list(self._state.accumulators)

    @property
    def window_rows(self):
        """Per variable, the `WindowRows` of its sparse gradients (None for scalars)."""
        return list(self._state.rows)

    @property
    def gradient_kinds(self):
        """{variable path: how the window holds its gradients}, for the variables that
        got one in a step so far: "dense" (a sum), "rows" (a sparse gradient's rows,
        kept apart as the large batch keeps them), "once-per-batch rows" (a lookup
        whose ids do not depend on the sample: one row per id position, the
        micro-batches summed into it; see `accumulator.rows.lookups`), "dense + rows",
        or "maximum" (`overwrite_with_gradient` variables)."""
        return self._state.gradient_kinds()

    @property
    def held_micro_batches(self):
        """Micro-batches in the open window, as an int (0 before the optimizer is built)."""
        if not self._window_built() or self.is_passthrough:
            return 0
        return int(self._state.micro_step.numpy())

    @property
    def noise_scale_estimate(self):
        """The `NoiseScaleEstimate` (smoothed |G|^2, tr Sigma, B_simple as tensors);
        None before the optimizer is built. Needs `measure_noise_scale=True`."""
        self._check_measures_noise_scale()
        return self._state.noise_estimate

    @property
    def noise_scale(self):
        """B_simple, the gradient noise scale, as a Python float, in samples in `fit`
        (also for sequence outputs, whose loss weighs tokens), in units of
        `micro_batch_weight` in a custom loop; NaN before the first window of at
        least two micro-batches. Needs `measure_noise_scale=True`."""
        self._check_measures_noise_scale()
        if self._state.noise_estimate is None:
            return float("nan")
        return self._state.noise_estimate.noise_scale_value()

    @property
    def preconditioned_noise_scale_estimate(self):
        """The `NoiseScaleEstimate` of the preconditioned gradient P g (P the inner
        optimizer's 1 / (sqrt(v_hat) + eps) for Adam); None for optimizers without a
        second moment, or before the optimizer is built. Needs `measure_noise_scale=True`."""
        self._check_measures_noise_scale()
        return self._state.preconditioned_estimate

    @property
    def preconditioned_noise_scale(self):
        """B_simple of the preconditioned gradient, in samples as `noise_scale`; NaN
        without a second moment or before the first window. Needs `measure_noise_scale=True`."""
        estimate = self.preconditioned_noise_scale_estimate
        return float("nan") if estimate is None else estimate.noise_scale_value()

    def _check_measures_noise_scale(self):
        """AttributeError unless the wrapper measures the noise scale."""
        if not self.measure_noise_scale:
            raise AttributeError(
                "This GradientAccumulator does not measure the gradient noise scale; "
                "construct it with `measure_noise_scale=True` (and accum_steps >= 2)."
            )

    def add_window_listener(self, layer) -> None:
        """Makes `layer` follow the windows: closed with partial windows, given every new `accum_steps`.

        Args:
            layer: an `AccumBatchNormalization` (added once however often it is given).
        """
        if not any(layer is known for known in self._state.listeners):
            self._state.listeners.append(layer)


class AccumulationWindow(WindowReadings, window_saving.WindowSaving):
    """The window's update rule, on the state `WindowState` declares; mixed into each Keras' optimizer.

    Subclasses call `_init_window(...)` in their constructor and
    `_build_window(var_list)` in their `build`, route each micro-batch through
    `_apply_micro_batch` (which runs `_update`, the whole flow), and supply, in
    one place per Keras, `_new_variable` (a plain optimizer variable),
    `_hand_to_updater` (one inner update with an already reduced gradient),
    `_updates_without_reduction` (a context in which that holds) and
    `_window_gradient_scale` (the loss scale the sums carry). The state is `self._state`
    (`WindowState`); the options are attributes (`partial_window`, ...). What it
    shows is `WindowReadings`; saving, `window_saving.WindowSaving`.
    ``fit_callback`` (set by `accumulating_compile`) makes the window callback
    every `fit` uses; None: a plain `EpochWindows`.
    """

    # ------------------------------------------------------------------ setup
    def _init_window(self, options: WindowOptions):
        """Sets up the (unbuilt) window from its checked options."""
        # The options, checked once (`accumulator.core.options`); each is also a read-only
        # property of its own name (`partial_window`, `schedulable`, ...: `WindowReadings`).
        self._untracked(options=options)
        self._accum_steps = options.accum_steps
        # accum_steps="auto": the rule (`AutoAccumulation`) is made by the first `fit`
        # (`accumulator.fit_hook`), which knows the micro-batch, and kept here: its
        # decisions carry on into a later `fit` and into a `TrainingBackup`.
        self.auto_accumulation = None
        # Makes the window callback `fit` puts first (set by `accumulating_compile`).
        self.fit_callback = None
        self._untracked(_state=WindowState())

    def _build_window(self, var_list):
        """Creates the window's variables for `var_list` (the model's trainable variables)."""
        measuring = self.measure_noise_scale and not self.is_passthrough
        self._state.build(var_list, self._new_variable, self._accum_steps, self.is_passthrough,
                          self.noise_scale_smoothing if measuring else None,
                          preconditioning.preconditioner_of(self.inner_optimizer) if measuring else None)

    # ------------------------------------------------------- between windows
    def close_partial_window(self, mode: str | None = None) -> int:
        """Applies ("apply"), keeps ("carry") or discards ("drop") an open window.

        Call it between training runs or where a custom loop's epoch ends;
        `fit` calls it with `partial_window` when an epoch and when training
        ends.

        Args:
            mode: "apply", "carry" or "drop"; None: the optimizer's `partial_window`.

        Returns:
            The number of micro-batches the window held.

        Raises:
            ValueError: `mode` is not one of those.
        """
        mode = validate_partial_window(mode or self.partial_window, name="mode")
        if not self._window_built() or self.is_passthrough:
            return 0
        s = self._state
        window_rows.refuse_overflowed_room(s)
        held = int(s.micro_step.numpy())
        if mode == "carry" or (held == 0 and mode == "apply"):   # "drop" also empties a failed step's writes
            return held
        # Layers pooling statistics per window (AccumBatchNormalization) close theirs too.
        for layer in s.listeners:
            layer.close_window(apply=mode == "apply")
        if not s.with_grads:     # restored here, no step traced yet: close what it holds
            s.with_grads |= window_saving.held_after_a_restore(s)
        if mode == "drop":
            self._reset_window(range(len(s.accumulators)), [i for i, rows in enumerate(s.rows) if rows is not None])
            s.micro_step.assign(0)
            s.seen_in_window = set()
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

    def _close_now(self):
        """Closes the open window eagerly, under the strategy it was built in."""
        s = self._state
        if s.close_function is None:
            strategy = s.strategy

            def close_in_each_replica():
                self._update([], [], close_only=True)

            def close():
                strategy.run(close_in_each_replica)

            s.close_function = tf.function(close)
        s.close_function()

    def set_accum_steps(self, accum_steps: int) -> None:
        """Changes the window length from the next window on (no retracing).

        Args:
            accum_steps: the new micro-batches per window.

        Raises:
            TypeError: `accum_steps` is not an integer.
            ValueError: `accum_steps` < 1, a pass-through (`accum_steps=1` without
                `schedulable`) asked for more, or a window is open.
        """
        accum_steps = validate_accum_steps(accum_steps)
        if self.is_passthrough and accum_steps != 1:
            raise ValueError(
                "This GradientAccumulator was made with `accum_steps=1` and "
                "`schedulable=False`, a pass-through without buffers; construct "
                "it with `schedulable=True` to change `accum_steps` later."
            )
        if self._window_built() and int(self._state.micro_step.numpy()):
            raise ValueError(
                "`accum_steps` can change only between windows; close the open "
                "window first (`close_partial_window`)."
            )
        self._accum_steps = accum_steps
        if self._window_built():
            self._state.accum_steps.assign(accum_steps)
            window_rows.grow_rooms(self._state, accum_steps)
        for layer in self._state.listeners:
            layer.set_accum_steps(accum_steps)

    def make_row_room(self, rows) -> dict:
        """Under XLA: room for per-sample sparse rows, made outside the compiled step
        (`accumulator.rows.row_room`, before `fit` compiles; `window_rows.has_room` as a step
        of static shapes is traced). `rows`: (variable, rows of one micro-batch) pairs.
        Returns {variable path: rows of one micro-batch} of every room the window has."""
        s = self._state
        for variable, count in rows:
            index = s.index_of(variable)
            if s.rows[index] is not None:
                window_rows.note_room(s, index, count)
        window_rows.grow_rooms(s, int(s.accum_steps.numpy()))
        return {getattr(s.variables[i], "path", None) or s.variables[i].name: n for i, n in s.row_room.items()}

    # ------------------------------------------------------- the update rule
    def note_micro_batch_weight(self, weight, samples=None):
        """Hands over the loss denominator D_k of the micro-batch whose gradients come next.

        The `compute_loss` hook calls it (`accumulator.window.weighting.note_batch`);
        `_apply_micro_batch` takes it, in the same thread and graph
        (`WindowState.noted_weight`). An explicit `micro_batch_weight` wins.

        Args:
            weight: the micro-batch's loss denominator.
            samples: its samples (the noise scale's unit), or None: `weight`.
        """
        self._state.noted_weight.hand_over(weight, samples)

    def _apply_micro_batch(self, grads, variables, micro_batch_weight=None):
        """One micro-batch of `grads` for `variables` (built optimizer), weighed by
        `micro_batch_weight` or else by what the `compute_loss` hook handed over."""
        noted, noted_samples = self._state.noted_weight.take()
        indices = [self._state.index_of(v) for v in variables]
        if not grads:
            return
        if self.is_passthrough:
            # Transparent: the inner optimizer sees exactly what it would alone. Its
            # count waits for the gradients: the step Keras runs on a dataset of
            # unknown size that has run out makes no update and counts none.
            with tf.control_dependencies([g.values if isinstance(g, tf.IndexedSlices) else g
                                          for g in grads if g is not None]):
                self._hand_to_updater(grads, variables, reduced=False)
            return
        self._state.loop_notes.note_step(micro_batch_weight, noted, summed=self.loss_reduction == "sum")
        weight, divisor = self._micro_batch_weights(micro_batch_weight, noted)
        samples = None
        if micro_batch_weight is None and noted_samples is not None and not _is_summed(noted):
            # The noise scale counts samples; a zero weight (no sample counted) stays zero.
            samples = tf.where(tf.cast(weight, tf.float32) > 0.0, tf.cast(noted_samples, tf.float32), 0.0)
        self._update(grads, indices, weight, divisor=divisor, samples=samples)

    def _micro_batch_weights(self, micro_batch_weight, noted_weight):
        """(what the micro-batch's gradient is multiplied by, what it adds to the divisor).

        A loss that is a mean (S_k / D_k, `accumulator.window.weighting`) weighs D_k in
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
            return 1.0, tf.cast(tf.equal(self._state.micro_step, 0), tf.float32)
        if micro_batch_weight is None:
            micro_batch_weight = 1.0 if noted_weight is None or _is_summed(noted_weight) else noted_weight
        return micro_batch_weight, micro_batch_weight

    def _update(self, grads, indices, weight=1.0, close_only=False, divisor=None, samples=None):
        """The window's whole flow: add a micro-batch, count it, and when the window is
        full close it: reduce it over the replicas, apply its mean, reset it.

        `close_only`: no micro-batch; close the window as it stands (a partial
        window's "apply"). Under a strategy, counting and closing run in
        cross-replica context, so the inner optimizer's own `merge_call` never
        sits inside a replica-context `cond`; the mean is applied in each replica.
        Without a strategy, `accumulator.core.replicas` is not entered.
        """
        s, distributed = self._state, tf.distribute.has_strategy()
        if distributed:
            replicas.refuse_cross_replica_context()
        with_grads = {i for g, i in zip(grads, indices) if g is not None}
        s.with_grads |= with_grads
        if close_only:
            with_grads = set(s.with_grads)
        else:
            # 1. Add: each replica adds `weight * grad` to its own buffers.
            self._accumulate(grads, indices, weight, weight if divisor is None else divisor, samples)

        def count_and_close(distribution):      # `distribution`: None without a strategy
            if close_only:
                full = s.micro_step > 0
            else:
                # 2. Count, once the micro-batch exists: when the data runs out, `fit`
                # calls the step once more, and only ops that wait on the data fail.
                # Not on the whole backward pass: the close's condition is then known
                # (and on a GPU copied to the host) while the gradients are computed.
                _tf.assign_add_after(s.micro_step, 1, after=_signs_of_the_micro_batch(weight, grads))
                full = s.micro_step >= s.accum_steps
            tf.cond(full, lambda: self._close(distribution, sorted(with_grads | s.seen_in_window)), lambda: None)

        if distributed:
            replicas.in_cross_replica_context(count_and_close)
        else:
            count_and_close(None)

    def _accumulate(self, grads, indices, weight=1.0, divisor=1.0, samples=None):
        """Replica-local: adds `weight * grad` into the window's buffers, and `divisor`
        to the window's weight (see `_micro_batch_weights`); `samples` (None: `weight`)
        to the noise scale's sizes.

        A dense buffer gets its full shape on its first dense gradient, outside any
        graph (`_tf.fill_to`; a restored one keeps its sums). Sparse gradients go
        to their rows (`window_rows.keeps_rows`); `overwrite_with_gradient`
        variables keep the window's running maximum.
        """
        s, weight = self._state, tf.cast(weight, tf.float32)
        for grad, index in zip(grads, indices):
            if grad is None:
                continue
            if tf.executing_eagerly():
                s.seen_in_window.add(index)
            if index in s.overwrite_indices:
                _tf.keep_maximum(s.accumulators[index], grad)
            elif isinstance(grad, tf.IndexedSlices) and window_rows.keeps_rows(
                    s, index, grad, self.merge_duplicate_rows or self.inner_sums_repeated_rows,
                    self.keeps_rows_across_replicas):
                s.rows_seen.add(index)
                s.rows[index].add(grad, weight, index in s.once_per_batch, s.strategy)
            else:
                _tf.fill_to(s.accumulators[index], tuple(s.variables[index].shape), s.strategy)
                s.dense_seen.add(index)
                _tf.add_weighted(s.accumulators[index], grad, weight)
        _tf.backing_variable(s.weight_sum).assign_add(tf.cast(divisor, tf.float32), read_value=False)   # one kernel
        window_noise.add_micro_batch(s, grads, indices, weight, samples)

    # Whether the inner optimizer sums repeated rows of a sparse gradient itself
    # (Keras 2's do; Keras 3's apply them one by one).
    inner_sums_repeated_rows = False

    # Whether rows are kept under several replicas: only where the class saves
    # them itself (`window_state`), since a checkpoint reads replica 0's alone.
    keeps_rows_across_replicas = True

    def _close(self, distribution, used):
        """Closes the window (a `cond` branch, cross-replica context under a strategy).

        Which of the variables `used` close as dense sums and which as rows is
        decided as the close is traced: the buffers filled so far (also by a
        restored checkpoint) and the sparse gradients seen, the same on every
        worker. Without a strategy the local buffers are the sums (divided in
        place later: no second copy). Under one they are summed over the
        replicas in one batched all-reduce; the sums of Keras' scaled losses then
        carry each replica's 1/replicas, which the weight, summed the same way,
        divides out. Maxima (`overwrite_with_gradient`) are reduced in the replicas.
        """
        s = self._state
        dense = [i for i in used if i in s.dense_seen or (
            s.rows[i] is None or s.variables[i].shape[0] != 1) and _tf.is_filled(
                s.accumulators[i], tuple(s.variables[i].shape), s.strategy)]
        rows = [i for i in used if i in s.rows_seen]
        sums = [_tf.backing_variable(s.accumulators[i]) for i in dense]
        weight = _tf.backing_variable(s.weight_sum)
        noise = window_noise.sums_to_reduce(s, distribution)
        if distribution is None:
            # 4. Apply the window's mean and 5. reset.
            self._apply_mean_and_reset(dense, rows, sums, weight, noise)
        else:
            # 3. Reduce: the sums and the weight, in one all-reduce; 4, 5 in each replica.
            summed = [k for k, i in enumerate(dense) if i not in s.overwrite_indices]
            first = s.variables[0]
            reduced = replicas.sum_over_replicas(
                distribution,
                [(sums[k], s.variables[dense[k]]) for k in summed] + [(weight, first)] + [(n, first) for n in noise])
            for k, total in zip(summed, reduced):
                sums[k] = total
            weight, noise = reduced[len(summed)], reduced[len(summed) + 1:]
            replicas.in_each_replica(distribution, self._updates_without_reduction,
                                     self._apply_mean_and_reset, dense, rows, sums, weight, noise)
        s.micro_step.assign(0)
        s.seen_in_window = set()

    def _apply_mean_and_reset(self, dense, rows, sums, weight_sum, noise_sums=()):
        """Replica-local: hands the inner optimizer the window's mean gradient once, then
        empties the window.

        `dense` lists the variables with dense sums in the window, `sums` those
        sums (reduced; for `overwrite_with_gradient` variables, their maxima),
        `rows` the variables with sparse rows (gathered across the replicas),
        `weight_sum` the window's weight summed over the replicas; the other
        variables get `None`, as in the large batch. `noise_sums` are the
        window's (reduced) noise-scale sums when it measures.
        """
        s = self._state
        replica_count = replicas.replicas_in_sync() if tf.distribute.has_strategy() else 1
        weight_sum = weight_sum / replica_count
        divisor = self._loss_scale_divisor()
        if divisor is not None:
            # Each micro-batch's loss was scaled by S / N: the mean at S for the unscaling.
            weight_sum = weight_sum / divisor
        grads = [None] * len(s.variables)
        summed = [(i, total) for i, total in zip(dense, sums) if i not in s.overwrite_indices]
        for i, total in zip(dense, sums):
            if i in s.overwrite_indices:
                grads[i] = tf.cast(replicas.maximum_over_replicas(total), s.variables[i].dtype)
        # In place where the sums lie in local buffers: no second copy (see _tf.divide_in_place).
        means = _tf.divide_in_place([total for _, total in summed], weight_sum)
        for (i, _), mean in zip(summed, means):
            grads[i] = tf.cast(mean, s.variables[i].dtype)
        row_means = [s.rows[i].mean(s.variables[i], weight_sum, s.once_per_batch.get(i), self.merge_duplicate_rows)
                     for i in rows]
        for i, mean in zip(rows, row_means):
            # A variable with dense and sparse gradients in one window gets their sum.
            grads[i] = mean if grads[i] is None else window_rows.add_rows(grads[i], mean)
        if s.noise_estimate is not None:
            window_noise.fold_window(s, noise_sums, grads, replica_count,
                                    self._window_gradient_scale(), self._loss_scale_divisor())
        self._hand_to_updater(grads, s.variables, reduced=True)
        # Refill once the update has read the means: reading the variables it
        # wrote orders the refill after it (automatic control dependencies).
        self._reset_window(dense, rows, after=[
            tf.convert_to_tensor(_tf.backing_variable(s.variables[i])) for i, _ in summed])

    def _reset_window(self, indices, row_indices=(), after=()):
        """Empties the buffers at `indices` and the rows at `row_indices` (the
        others are empty) and the weight. Row buffers keep their capacity."""
        s, indices = self._state, list(indices)
        squares = window_noise.reset(s)
        _tf.fill_one_after_another(
            [s.accumulators[i] for i in indices] + squares,
            [float("-inf") if i in s.overwrite_indices else 0.0 for i in indices] + [0.0] * len(squares),
            after=after,
        )
        for i in row_indices:
            s.rows[i].reset(i in s.row_room)
        s.weight_sum.assign(0.0)

    def _window_config(self):
        """The window's options for `get_config`, with its length now."""
        # The options as built, with the window's length now (a schedule may have changed it).
        config = self.options.get_config()
        if not self.options.auto:
            config["accum_steps"] = self.accum_steps
        return config

    # ------------------------------------------------ what each Keras supplies
    def _new_variable(self, shape, dtype, initial, name):
        """Each Keras: a plain optimizer variable (`None` in `shape`: a buffer that grows)."""
        raise NotImplementedError

    def _hand_to_updater(self, grads, variables, reduced):
        """Each Keras: one update of the inner optimizer with an already reduced gradient."""
        raise NotImplementedError

    def _updates_without_reduction(self):
        """Each Keras: a context in which the inner optimizer does not all-reduce again."""
        raise NotImplementedError

    def _window_gradient_scale(self):
        """Each Keras: the loss scale the window's sums carry (None: unscaled)."""
        raise NotImplementedError

    def _loss_scale_divisor(self):
        """N where each micro-batch's loss is scaled by the window's scale / N (None: by
        the window's scale, or unscaled)."""
        return None
