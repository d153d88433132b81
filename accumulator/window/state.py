"""The window's state, in two parts: the variables the optimizer saves, and what Python notes.

An `AccumulationWindow` holds one `WindowState` (`self._state`):

- `saved`, a `WindowVariables` (None before `build`): the optimizer variables the
  window makes, saved with the optimizer (checkpoints, `.keras` files, `get_weights`).
  The noise scale's part (`NoiseScaleVariables`) exists only where the window measures it.
- `notes`, a `WindowNotes`: plain Python, never saved: what the steps traced so far
  showed of the gradients (which variables got one, dense or as rows), the loss's
  hand-over of each micro-batch's weight, and what is made once and kept (the eager close).
- beside them, what the window was built for: the model's variables, their indices, the
  `overwrite_with_gradient` ones, the strategy.

`WindowState.build` makes every variable here, in the order `optimizer.variables` lists
them (and checkpoints and `.keras` files of earlier versions hold them): `micro_step`,
`accum_steps`, `weight_sum`; per model variable its `accumulator_<i>`, then (where it
has rows) `rows_<i>_values`, `rows_<i>_indices`, `rows_<i>_count`; then the noise scale's
`noise_scale_squares` (with a preconditioner), `noise_scale_sums`, the estimate's
`noise_scale_state` and the preconditioned estimate's `preconditioned_state`.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, seam
from tfx_gradient_accumulator.accumulator.noise import window_noise
from tfx_gradient_accumulator.accumulator.noise.noise_scale import NoiseScaleEstimate
from tfx_gradient_accumulator.accumulator.rows import lookups
from tfx_gradient_accumulator.accumulator.rows.window_rows import WindowRows
from tfx_gradient_accumulator.accumulator.window.loop_notes import LoopNotes


class NotedWeight(threading.local):
    """The loss denominator the `compute_loss` hook handed over for the next micro-batch.

    Per thread, since MirroredStrategy traces each replica's step in its own
    thread, and noted with the graph it was computed in: a weight noted while
    one step was traced is not taken by another (or eagerly).

    Attributes:
        weight: the micro-batch's loss denominator D_k (a float32 tensor), or
            `window.SUMMED_LOSS` for a loss that sums over its samples; None: none noted.
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


@dataclasses.dataclass(frozen=True, eq=False)
class NoiseScaleVariables:
    """The noise scale's part of the window: made only with `measure_noise_scale`
    (`WindowVariables.noise` is None without it). Read by `accumulator.noise.window_noise`.

    Attributes:
        sums: the open window's sums, one float32 vector (`window_noise.SUM_FIELDS`,
            b_k in samples; replica-local).
        estimate: the smoothed estimate (`NoiseScaleEstimate`, mirrored).
        squares: with a `preconditioner`: the open window's sum_k g_k^2 per coordinate
            of the variables at `layout` (joined flat), to which the close applies P
            once (replica-local); else None.
        preconditioned_estimate: with a `preconditioner`: the estimate of P g's noise
            scale (the one Adam's steps follow); else None.
        preconditioner: the inner optimizer's `Preconditioner` where it has a second
            moment (Adam-like), else None. Not a variable of the window: the inner
            optimizer's, read at the close.
        layout: the measured (not `overwrite_with_gradient`) variables' indices,
            `squares`' order.
    """

    sums: Any
    estimate: NoiseScaleEstimate
    squares: Any = None
    preconditioned_estimate: Optional[NoiseScaleEstimate] = None
    preconditioner: Any = None
    layout: tuple = ()


@dataclasses.dataclass(frozen=True, eq=False)
class WindowVariables:
    """What the window saves: its optimizer variables, made once by `WindowState.build`.

    "Mirrored": one value on every replica; "replica-local": each replica sums its
    own micro-batches, and the sums meet in one all-reduce when the window closes.
    The variables are assigned in place, never replaced (hence frozen).

    Attributes:
        micro_step: int64, micro-batches in the open window (mirrored).
        accum_steps: int64, micro-batches per window (mirrored; a schedule changes
            it between windows without retracing).
        weight_sum: float32, the window's summed micro-batch weights
            (replica-local, summed when read across replicas).
        accumulators: per model variable, the weighted sum of the window's dense
            gradients, float32 for half-precision variables (replica-local; a
            one-row stand-in until the first dense gradient; the running maximum
            for `overwrite_with_gradient` variables). Empty for a pass-through.
        rows: per model variable of rank >= 1, its `WindowRows` (None for scalars and
            `overwrite_with_gradient` variables): the sparse gradients' rows
            (replica-local; `accumulator.rows.window_rows`).
        noise: the noise scale's variables (`NoiseScaleVariables`) with
            `measure_noise_scale`; else None.
    """

    micro_step: Any
    accum_steps: Any
    weight_sum: Any
    accumulators: tuple = ()
    rows: tuple = ()
    noise: Optional[NoiseScaleVariables] = None


@dataclasses.dataclass(eq=False)
class WindowNotes:
    """What Python notes beside the variables, never saved: learnt while steps are traced
    (the same on every worker), handed over, or made once.

    Attributes:
        with_grads: variables (indices) that got a gradient in any step traced:
            what a forced close applies (read when a close is traced).
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
        warned_eager_rows: whether the warning on eager sparse gradients was given.
        noted_weight: the `compute_loss` hook's hand-over of each micro-batch's
            weight (`NotedWeight`: per thread and graph).
        listeners: `AccumBatchNormalization` layers that follow the windows.
        loop_notes: what a custom loop is warned of (`accumulator.window.loop_notes`).
        close_function: the traced eager close (`close_partial_window`), once made.
    """

    with_grads: set = dataclasses.field(default_factory=set)
    seen_in_window: set = dataclasses.field(default_factory=set)
    dense_seen: set = dataclasses.field(default_factory=set)
    rows_seen: set = dataclasses.field(default_factory=set)
    once_per_batch: dict = dataclasses.field(default_factory=dict)
    row_room: dict = dataclasses.field(default_factory=dict)
    warned_eager_rows: bool = False
    noted_weight: NotedWeight = dataclasses.field(default_factory=NotedWeight)
    listeners: list = dataclasses.field(default_factory=list)
    loop_notes: LoopNotes = dataclasses.field(default_factory=LoopNotes)
    close_function: Any = None


def _accumulator_dtype(variable):
    """The dtype of `variable`'s window sum: float32 for half-precision variables."""
    # Half-precision sums lose the small gradients accumulation exists for.
    dtype = tf.as_dtype(variable.dtype)
    return tf.float32 if dtype in (tf.float16, tf.bfloat16) else dtype


def _overwrites_with_gradient(variable):
    """Whether `variable`'s "gradient" is its new value (float8 scales): it gets the window's maximum."""
    # Float8 training's scale and amax history (Keras 3): the "gradient" is the new value.
    return bool(getattr(variable, "overwrite_with_gradient", False))


@dataclasses.dataclass(eq=False)
class WindowState:
    """Everything an `AccumulationWindow` holds besides its options: declared here, once.

    Attributes:
        saved: the window's variables (`WindowVariables`), saved with the optimizer;
            None before `build`.
        notes: what Python notes beside them, never saved (`WindowNotes`).
        variables: the model's variables the window is for, in order (`build`).
        index_by_id: {id(variable): its index in `variables`}.
        overwrite_indices: the `overwrite_with_gradient` variables' indices.
        strategy: the strategy the window was built under (None before `build`).
        built_accum_steps: the window's length when `build` made the variables (what
            `accum_steps` holds before its initial value is assigned).
    """

    saved: Optional[WindowVariables] = None
    notes: WindowNotes = dataclasses.field(default_factory=WindowNotes)
    variables: list = dataclasses.field(default_factory=list)
    index_by_id: dict = dataclasses.field(default_factory=dict)
    overwrite_indices: frozenset = frozenset()
    strategy: Any = None
    built_accum_steps: int = 1

    def built(self):
        """Whether `build` made the variables."""
        return self.saved is not None

    def build(self, var_list, new_variable, accum_steps, passthrough, noise_smoothing, preconditioner=None):
        """Makes the variables for `var_list` (the model's trainable variables), in the
        order the module's docstring gives.

        Args:
            var_list: the variables the window is for, in order.
            new_variable: the optimizer's `_new_variable(shape, dtype, initial, name)`.
            accum_steps: the window's length to start with.
            passthrough: a pass-through never accumulates: it gets no buffers.
            noise_smoothing: the noise-scale estimate's smoothing, or None when not measuring.
            preconditioner: the inner optimizer's `Preconditioner` (measured beside the
                raw noise scale), or None.
        """
        var_list = list(var_list)
        mirrored, local = _variable_makers(new_variable)
        micro_step, steps = mirrored((), tf.int64, 0, "micro_step"), mirrored((), tf.int64, accum_steps, "accum_steps")
        weight_sum = local((), tf.float32, "weight_sum")
        overwrite = frozenset(i for i, v in enumerate(var_list) if _overwrites_with_gradient(v))
        accumulators, rows = ((), ()) if passthrough else _buffers(local, var_list, overwrite)
        noise = None if noise_smoothing is None else _noise_scale_variables(
            mirrored, local, var_list, overwrite, preconditioner, noise_smoothing)
        self.saved = WindowVariables(micro_step, steps, weight_sum, accumulators, rows, noise)
        self.variables, self.index_by_id = var_list, {id(v): i for i, v in enumerate(var_list)}
        self.overwrite_indices, self.strategy, self.built_accum_steps = overwrite, tf.distribute.get_strategy(), accum_steps

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
        kinds, notes = {}, self.notes
        for i in sorted(notes.with_grads):
            if i in self.overwrite_indices:
                kind = "maximum"
            elif i in notes.rows_seen:
                kind = lookups.ONCE_PER_BATCH if i in notes.once_per_batch else lookups.PER_SAMPLE
                kind = "dense + " + kind if i in notes.dense_seen else kind
            else:
                kind = "dense"
            kinds[getattr(self.variables[i], "path", None) or self.variables[i].name] = kind
        return kinds


def _variable_makers(new_variable):
    """(mirrored, local): makers of the window's variables from the optimizer's `new_variable`.

    `mirrored(shape, dtype, initial, name)`: one value on every replica, replica 0's
    written. `local(shape, dtype, name, initial=0.0, per_replica=False)`: replica-local,
    summed over the replicas when read across them (replica 0's if `per_replica`). `None`
    in `shape`: a buffer that changes size along that axis, made with one row (an empty
    tensor would reach collective reads, which crash on it under
    MultiWorkerMirroredStrategy); its `shape` says what it holds
    (`seam.reports_held_shape`): one row, then its full size.
    """
    first_replica = tf.VariableAggregation.ONLY_FIRST_REPLICA

    def mirrored(shape, dtype, initial, name):
        with seam.variables_created_as(aggregation=first_replica):
            return new_variable(shape, dtype, initial, name)

    def local(shape, dtype, name, initial=0.0, per_replica=False):
        with seam.variables_created_as(
                synchronization=tf.VariableSynchronization.ON_READ, shape=shape if None in shape else None,
                aggregation=first_replica if per_replica else tf.VariableAggregation.SUM):
            variable = new_variable(shape, dtype, initial, name)
        return seam.reports_held_shape(variable) if None in shape else variable

    return mirrored, local


def _buffers(local, var_list, overwrite):
    """(accumulators, rows): each variable's dense buffer, then its rows' three buffers.

    Scalars and `overwrite_with_gradient` variables get their buffer now (and no
    rows); the others a one-row stand-in, filled on their first dense gradient, and
    row buffers for sparse gradients, which only gathers produce.
    """
    accumulators, rows = [], []
    for i, v in enumerate(var_list):
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
    return tuple(accumulators), tuple(rows)


def _noise_scale_variables(mirrored, local, var_list, overwrite, preconditioner, smoothing):
    """The noise scale's `NoiseScaleVariables`: the open window's replica-local sums (with
    a preconditioner, also its squares per coordinate), then the mirrored estimates.

    The `overwrite_with_gradient` variables are left out; a preconditioner is measured
    only where some variable is left.
    """
    layout = tuple(i for i in range(len(var_list)) if i not in overwrite)
    size = sum(int(np.prod(tuple(var_list[i].shape))) for i in layout)
    preconditioner = preconditioner if size else None
    squares = None if preconditioner is None else local((size,), tf.float32, "noise_scale_squares")
    fields = window_noise.SUM_FIELDS if squares is None else window_noise.SUM_FIELDS[1:]
    sums = local((len(fields),), tf.float32, "noise_scale_sums")

    def estimate(prefix):
        return NoiseScaleEstimate(lambda name, dtype, shape=(): mirrored(shape, dtype, 0, f"{prefix}_{name}"),
                                  smoothing=smoothing)

    raw = estimate("noise_scale")     # made before the preconditioned one: the variables' order
    preconditioned = None if preconditioner is None else estimate("preconditioned")
    return NoiseScaleVariables(sums, raw, squares, preconditioned, preconditioner, layout)
