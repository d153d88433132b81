"""Gradient noise scale B_simple, estimated from the micro-batches of accumulation windows.

B_simple = tr(Sigma) / |G|^2 (McCandlish et al., "An Empirical Model of Large-Batch
Training", 2018, arXiv:1812.06162) predicts the critical batch: below it a larger batch
cuts the updates almost in proportion, above it extra samples are mostly wasted. A window
already holds gradients at two batch sizes (each micro-batch's and the window's), so
`GradientAccumulator(..., measure_noise_scale=True)` estimates it for one squared norm per
micro-batch: `window_estimates` per window, `NoiseScaleEstimate` smoothed over windows.
Its unit is that of the sizes b_k: samples in `fit` (even where the loss weighs tokens),
`micro_batch_weight` in a custom loop. `WindowMoments` keeps the windows' spread, from
which `AutoAccumulation` bounds it.
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core.validation import DEFAULT_SMOOTHING, validate_smoothing

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

def squared_norm(grads: tf.Tensor | tf.IndexedSlices | Sequence | None) -> tf.Tensor:
    """Squared L2 norm, in float32, of a gradient or a list of gradients.

    A `tf.IndexedSlices` counts as the dense tensor it stands for: rows with
    repeated indices are summed before squaring (|a + b|^2, not |a|^2 + |b|^2),
    as in an embedding looked up twice in one batch.

    Args:
        grads: a gradient, a list of them, or None; `None` entries (variables
            without a gradient) count 0.

    Returns:
        A float32 scalar tensor.
    """
    if grads is None:
        return tf.constant(0.0, tf.float32)
    if not isinstance(grads, (list, tuple)):
        grads = [grads]
    flat = []
    for grad in grads:
        if isinstance(grad, tf.IndexedSlices):
            unique, positions = tf.unique(tf.reshape(grad.indices, [-1]))
            grad = tf.math.unsorted_segment_sum(tf.cast(grad.values, tf.float32), positions, tf.size(unique))
        if grad is not None:
            flat.append(tf.reshape(tf.cast(tf.convert_to_tensor(grad), tf.float32), [-1]))
    if not flat:
        return tf.constant(0.0, tf.float32)
    # One pass over them all: a micro-step of a small model pays for its kernels in launches.
    return tf.reduce_sum(tf.square(flat[0] if len(flat) == 1 else tf.concat(flat, axis=0)))


def micro_batch_terms(size: tf.Tensor | float, replicas: int = 1, squared_norms: Sequence = ()) -> tf.Tensor:
    """One replica micro-batch's share of the window's sums, as one float32 vector:
    `[R^2 n for n in squared_norms] + [R / w, 1, w]`, w = `size`.

    Under R replicas a replica's loss is its local sum divided by w = R b (b its
    samples: what `fit` and `tf.nn.compute_average_loss` do), so R grad is its
    mean-loss gradient and w / R its size. A micro-batch of size <= 0 (all sample
    weights zero) adds nothing to the window, and counts nothing here either. One
    vector, so a window adds it to its sums in one kernel.

    Args:
        size: w, the micro-batch's size as the noise scale counts it (samples), times R.
        replicas: R, the accumulator's replica count.
        squared_norms: |grad|^2 of the replica's gradient (of its loss, divided by
            its weight), where a window adds it per micro-batch (none where it keeps
            the squares per coordinate).

    Returns:
        A float32 vector of `len(squared_norms) + 3`: the squared norms times R^2,
        the inverse size, the count and w; zeros if w <= 0.
    """
    size = tf.cast(size, tf.float32)
    # R^2 multiplies only under several replicas: one kernel fewer a micro-step on one device.
    norms = [tf.cast(n, tf.float32) if replicas == 1 else float(replicas) ** 2 * tf.cast(n, tf.float32)
             for n in squared_norms]
    # R / 0 is inf, and the `where` drops it with the rest of an uncounted micro-batch.
    terms = tf.stack(norms + [float(replicas) / size, tf.constant(1.0), size])
    return tf.where(size > 0.0, terms, 0.0)


def window_estimates(micro_sq_norm_sum: tf.Tensor, inv_size_sum: tf.Tensor, micro_count: tf.Tensor,
                     window_sq_norm: tf.Tensor, window_size: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor, tf.Tensor]:
    """Unbiased |G|^2 and tr(Sigma) from one window (the paper's appendix A, for K micro-batches).

    With m = mean_k |g_k|^2 and h = mean_k 1/b_k: trace = (m - |G_B|^2) / (h - 1/B)
    and |G|^2 = |G_B|^2 - trace / B, unbiased for independent samples of any sizes.

    Args:
        micro_sq_norm_sum: sum_k |g_k|^2 over the window's micro-batches (under
            a strategy: over every replica's micro-batches, each with the
            1/replicas loss scaling undone).
        inv_size_sum: sum_k 1 / b_k over the same micro-batches.
        micro_count: K, the number of micro-batches summed.
        window_sq_norm: |G_B|^2, the squared norm of the window's mean gradient.
        window_size: B = sum_k b_k (of sizes b_k > 0).

    Returns:
        `(g2_est, trace_est, valid)`: float32 and bool, shaped like the broadcast
        of the squared norms (scalars, or one per estimate where several share a
        window's sizes: `update_from_windows`). `valid` is false when the window
        gives no estimate: K < 2, h - 1/B <= 0, B = 0, or a non-finite input or
        estimate (a window with an overflowed gradient, skipped by a loss-scale
        optimizer); the two estimates are then 0. Graph-safe: no Python branching
        on tensors.
    """
    g2, trace, valid = _estimates(micro_sq_norm_sum, inv_size_sum, micro_count, window_sq_norm, window_size)
    return tf.where(valid, g2, 0.0), tf.where(valid, trace, 0.0), valid


def _estimates(micro_sq_norm_sum, inv_size_sum, micro_count, window_sq_norm, window_size) -> tuple:
    """`window_estimates` with the estimates of invalid windows left as computed (any value,
    NaN included: a fold's `where` drops them)."""
    f32 = tf.float32
    sq_sum = tf.cast(micro_sq_norm_sum, f32)
    inv_sum = tf.cast(inv_size_sum, f32)
    count = tf.cast(micro_count, f32)
    big_sq = tf.cast(window_sq_norm, f32)
    size = tf.cast(window_size, f32)

    mean_sq = sq_sum / count  # m
    mean_inv = inv_sum / count  # h
    denominator = mean_inv - 1.0 / size  # h - 1/B, > 0 iff K >= 2 (B = 0: -inf)
    trace = (mean_sq - big_sq) / denominator
    g2 = big_sq - trace / size
    # What the window's sizes allow (shared by every estimate of the window), and what the
    # norms give: a non-finite norm (or h) makes g2 + (h - 1/B) non-finite. Values of
    # windows that give none (K = 0, a zero denominator) are whatever they came out as.
    valid = (count >= 2.0) & (denominator > 0.0) & tf.math.is_finite(g2 + denominator)
    return g2, trace, valid


class NoiseScaleEstimate:
    """Smoothed |G|^2, tr(Sigma) and B_simple = tr(Sigma) / |G|^2 over windows.

    McCandlish et al. (2018, arXiv:1812.06162), appendix A: the two unbiased
    per-window estimates are smoothed separately by exponential moving
    averages and B_simple is the ratio of the averages. The averages are
    bias-corrected like Adam's moments (divided by 1 - smoothing^t after t
    valid windows), so `gradient_sq_norm` and `trace` are unbiased from the
    first window on; the correction cancels in the ratio, which is therefore
    exactly the paper's ratio of EMAs. Windows with `valid` false (K = 1,
    non-finite gradients) leave the state untouched, and do not count in t.

    The state is one float64 vector of zeros made by `make_variable(name, dtype,
    shape)`, so its owner (an optimizer) can create, track and checkpoint it, and a
    window folds into it with one read and one write (`FIELDS`): the decayed sums
    sum_i s^(t-i) x_i of the windows' |G|^2 and tr(Sigma) estimates and of 1 (their
    ratios are the bias-corrected EMAs: an EMA and its weight, 1 - s^t, are these
    sums times 1 - s, which cancels), the window count t, and the windows'
    moments (`WindowMoments`, a view of the rest). Under a strategy, make it
    mirrored (`aggregation="only_first_replica"`) and update it after the window's
    reduction, where every replica holds the same values. Without a callback, a
    plain `keras.Variable` is made (handy eagerly and in tests).

    Args:
        make_variable: `make_variable(name, dtype, shape=())` returning a variable
            of zeros; None makes a `keras.Variable`.
        smoothing: the EMA decay, a float in [0, 1). Default 0.99: single
            windows are noisy (the relative noise of g2_est is of order
            B_simple / B, often > 1 below the critical batch, which is where
            one wants the estimate), so it averages over about 100 windows
            (EMA variance (1 - s) / (1 + s): as ~200 independent windows),
            while B_simple drifts over thousands of updates, far slower. Lower
            it for short runs or when B is well above B_simple; raise it
            (0.999) when B is far below B_simple.

    Raises:
        ValueError: `smoothing` is not a float in [0, 1).
    """

    FIELDS = ("decayed_gradient_sq_norm", "decayed_trace", "decayed_count", "window_count")

    def __init__(self, make_variable: Callable[..., tf.Variable] | None = None,
                 smoothing: float = DEFAULT_SMOOTHING):
        self.smoothing = validate_smoothing(smoothing)
        if make_variable is None:
            make_variable = _keras_variable
        self.state = make_variable("state", "float64", (len(self.FIELDS) + len(WindowMoments.FIELDS),))
        self.moments = WindowMoments(decay=self.smoothing, variable=self.state, offset=len(self.FIELDS))

    @property
    def variables(self) -> list:
        """The state variable (the decayed sums, the window count, the windows' moments)."""
        return [self.state]

    def update(self, g2_est: tf.Tensor, trace_est: tf.Tensor, valid: tf.Tensor,
               window_size: tf.Tensor | float = 1.0) -> None:
        """Folds one window's estimates in when `valid`; a no-op otherwise. Graph-safe.

        Args:
            g2_est: the window's estimate of |G|^2.
            trace_est: the window's estimate of tr(Sigma).
            valid: whether the window gives an estimate (`window_estimates`).
            window_size: its size B, the weight of its moments (`WindowMoments`).
        """
        _fold([self], *(tf.reshape(v, [1]) for v in (tf.cast(g2_est, tf.float32), tf.cast(trace_est, tf.float32),
                                                     tf.cast(valid, tf.bool))), window_size)

    def update_from_window(self, micro_sq_norm_sum: tf.Tensor, inv_size_sum: tf.Tensor, micro_count: tf.Tensor,
                           window_sq_norm: tf.Tensor, window_size: tf.Tensor) -> tf.Tensor:
        """`window_estimates(...)` then `update(...)`: one call per closed window.

        Args:
            micro_sq_norm_sum: sum_k |g_k|^2 over the window's micro-batches.
            inv_size_sum: sum_k 1 / b_k.
            micro_count: K, the micro-batches summed.
            window_sq_norm: |G_B|^2, the window's mean gradient's squared norm.
            window_size: B = sum_k b_k.

        Returns:
            `valid`: a bool scalar tensor, whether the window was folded in.
        """
        return update_from_windows([self], [micro_sq_norm_sum], inv_size_sum, micro_count, [window_sq_norm],
                                   window_size)[0]

    def _fields(self) -> dict:
        """The state by `FIELDS` name, as Python floats (eager)."""
        return dict(zip(self.FIELDS, (float(v) for v in self.state.numpy()[:len(self.FIELDS)])))

    def noise_scale_value(self) -> float:
        """`noise_scale` as a Python float, read from the variables without tensor ops (eager)."""
        fields = self._fields()
        if fields["window_count"] == 0:
            return float("nan")
        g2, trace = fields["decayed_gradient_sq_norm"], fields["decayed_trace"]
        if g2 == 0.0:
            return float("nan") if trace == 0.0 else math.copysign(float("inf"), trace)
        return trace / g2

    def _corrected(self, field: int) -> tf.Tensor:
        """The decayed sum at `field` over the decayed count: the bias-corrected EMA, float32; NaN
        before the first valid window."""
        state = tf.convert_to_tensor(self.state)
        seen = state[self.FIELDS.index("window_count")] > 0.0
        value = state[field] / tf.where(seen, state[self.FIELDS.index("decayed_count")], 1.0)
        return tf.cast(tf.where(seen, value, float("nan")), tf.float32)

    @property
    def window_count(self) -> tf.Tensor:
        """t: the number of valid windows folded in (int64)."""
        return tf.cast(tf.convert_to_tensor(self.state)[self.FIELDS.index("window_count")], tf.int64)

    @property
    def gradient_sq_norm(self) -> tf.Tensor:
        """Bias-corrected EMA of |G|^2 (float32); NaN before the first valid window."""
        return self._corrected(self.FIELDS.index("decayed_gradient_sq_norm"))

    @property
    def trace(self) -> tf.Tensor:
        """Bias-corrected EMA of tr(Sigma) (float32); NaN before the first valid window."""
        return self._corrected(self.FIELDS.index("decayed_trace"))

    @property
    def noise_scale(self) -> tf.Tensor:
        """B_simple = EMA(tr Sigma) / EMA(|G|^2), in the units of the micro-batch weights.

        NaN before the first valid window: "not measured yet", which 0 (a
        noise-free gradient, "any batch is too large") or a large number
        would misstate, and which `tf.math.is_nan` or `window_count` tells
        apart. Not clipped: a negative or huge value means EMA(|G|^2) is not
        resolved from 0 yet (windows far below the noise scale): raise the
        smoothing or wait for more windows.
        """
        return self.trace / self.gradient_sq_norm


def update_from_windows(estimates: Sequence, micro_sq_norm_sums: Sequence, inv_size_sum: tf.Tensor,
                        micro_count: tf.Tensor, window_sq_norms: Sequence, window_size: tf.Tensor) -> tf.Tensor:
    """`estimate.update_from_window(...)` for each of `estimates`, of one window, in one pass.

    The raw and the preconditioned noise scale of a window share its sizes and count:
    their arithmetic (`window_estimates`, the EMAs, the moments) runs once over a
    vector holding both, not once per estimate, which halves the close's scalar
    kernels (on a GPU, launches); each estimate's state is read and written once.

    Args:
        estimates: `NoiseScaleEstimate`s of one smoothing.
        micro_sq_norm_sums: per estimate, its sum_k |g_k|^2 (a list, or a vector).
        inv_size_sum: sum_k 1 / b_k (shared).
        micro_count: K (shared).
        window_sq_norms: per estimate, its |G_B|^2 (a list, or a vector).
        window_size: B (shared).

    Returns:
        `valid`: a bool vector, one per estimate, whether the window was folded in.
    """
    def joined(values):
        return tf.cast(values, tf.float32) if tf.is_tensor(values) else tf.stack([tf.cast(v, tf.float32) for v in values])

    g2_est, trace_est, valid = _estimates(
        joined(micro_sq_norm_sums), inv_size_sum, micro_count, joined(window_sq_norms), window_size)
    _fold(estimates, g2_est, trace_est, valid, window_size)
    return valid


def _fold(estimates: Sequence, g2_est: tf.Tensor, trace_est: tf.Tensor, valid: tf.Tensor, size) -> None:
    """Each estimate's state, a row of one matrix, moved by its window when `valid`: the decayed
    sums (decay s, the count +1) and the moments (`WindowMoments.terms`). The terms in float32
    (one window's), the sums in float64 (many windows')."""
    if len({e.smoothing for e in estimates}) != 1:
        raise ValueError("update_from_windows folds estimates of one smoothing.")
    s = estimates[0].smoothing
    ones = tf.ones_like(g2_est)
    rows = tf.cast(tf.stack([g2_est, trace_est, ones, ones] + WindowMoments.terms(g2_est, trace_est, size), axis=1),
                   tf.float64)
    decays = tf.constant([s, s, s, 1.0] + WindowMoments.decays(s), tf.float64)
    old = tf.stack([tf.convert_to_tensor(e.state) for e in estimates])
    new = tf.unstack(tf.where(tf.reshape(valid, [-1, 1]), decays * old + rows, old))
    for estimate, row in zip(estimates, new):
        estimate.state.assign(row)


class WindowMoments:
    """Sums over the windows since the last `reset`: what a confidence bound on B_simple needs.

    Per valid window i, with w_i its size, G_i its |G|^2 estimate and T_i its
    tr(Sigma) estimate: sum w, sum w G, sum w T, sum w G^2, sum w T^2,
    sum w G T, the count n and sum w^2, in a float64 vector (`FIELDS`), mirrored
    like the EMAs, decaying by the EMAs' smoothing per window (so they follow a
    drifting B_simple over the same ~1 / (1 - smoothing) windows; sum w^2 decays
    by its square). Weighting by size weighs each window by about its inverse
    variance (a window's estimates scatter as 1/B); the decayed weights'
    effective count, (sum w)^2 / sum w^2, is what the bound's standard error
    divides by (~(1 + s) / (1 - s) windows at smoothing s, twice the decayed n).
    `AutoAccumulation` resets it when the batch changes, so the sums hold windows
    of one batch only.

    Args:
        make_variable: `make_variable(name, dtype, shape)` returning a variable of
            zeros: the sums' own; or None with `variable`.
        decay: the factor the sums keep per window, in [0, 1).
        variable: a float64 vector holding the sums at `offset` (a
            `NoiseScaleEstimate`'s state), instead of a variable of their own.
        offset: where in `variable` the sums start.
    """

    FIELDS = ("weight", "g2", "trace", "g2_g2", "trace_trace", "g2_trace", "count", "weight_sq")

    def __init__(self, make_variable: Callable[..., tf.Variable] | None = None, decay: float = DEFAULT_SMOOTHING,
                 variable=None, offset: int = 0):
        self.decay = validate_smoothing(decay, "decay")
        self.variable = make_variable("window_moments", "float64", (len(self.FIELDS),)) if variable is None else variable
        self.offset = offset

    @staticmethod
    def terms(g2_est: tf.Tensor, trace_est: tf.Tensor, size) -> list:
        """One window's terms, in `FIELDS` order (in the estimates' dtype and shape)."""
        g, t = tf.convert_to_tensor(g2_est), tf.convert_to_tensor(trace_est)
        w = tf.cast(size, g.dtype) * tf.ones_like(g)
        wg, wt = w * g, w * t
        return [w, wg, wt, wg * g, wt * t, wg * t, tf.ones_like(g), w * w]

    @classmethod
    def decays(cls, decay: float) -> list:
        """What each field keeps per window: `decay`, and its square for sum w^2."""
        return [decay] * (len(cls.FIELDS) - 1) + [decay ** 2]

    def _replaced(self, part: tf.Tensor) -> tf.Tensor:
        """`variable` with the sums replaced by `part`."""
        whole = tf.convert_to_tensor(self.variable)
        return tf.concat([whole[:self.offset], part, whole[self.offset + len(self.FIELDS):]], axis=0)

    def add(self, g2_est: tf.Tensor, trace_est: tf.Tensor, size: tf.Tensor | float, valid: tf.Tensor) -> None:
        """Adds one window when `valid` (graph-safe).

        Args:
            g2_est: its |G|^2 estimate.
            trace_est: its tr(Sigma) estimate.
            size: its size B, w.
            valid: whether it gives an estimate.
        """
        sums = tf.convert_to_tensor(self.variable)[self.offset:self.offset + len(self.FIELDS)]
        terms = self.terms(tf.cast(g2_est, tf.float64), tf.cast(trace_est, tf.float64), size)
        moved = tf.constant(self.decays(self.decay), tf.float64) * sums + tf.stack(terms)
        self.variable.assign(self._replaced(tf.where(tf.cast(valid, tf.bool), moved, sums)))

    def values(self) -> dict:
        """The sums by `FIELDS` name, as Python floats (eager)."""
        sums = self.variable.numpy()[self.offset:self.offset + len(self.FIELDS)]
        return dict(zip(self.FIELDS, (float(v) for v in sums)))

    def reset(self) -> None:
        """Forgets every window (eager or traced)."""
        self.variable.assign(self._replaced(tf.zeros([len(self.FIELDS)], tf.float64)))


def _keras_variable(name: str, dtype: str, shape: tuple = ()):
    """A `keras.Variable` of zeros: the state's default maker."""
    import keras

    return keras.Variable(tf.zeros(shape, dtype), shape=shape, dtype=dtype, trainable=False, name=name)
