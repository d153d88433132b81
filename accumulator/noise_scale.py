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
import numbers

from typing import TYPE_CHECKING

import tensorflow as tf

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

DEFAULT_SMOOTHING = 0.99


def validate_smoothing(smoothing: float, name: str = "smoothing") -> float:
    """Checks an EMA decay for the noise-scale estimate.

    Args:
        smoothing: the decay, a real number in [0, 1).
        name: the parameter's name, for the error message.

    Returns:
        `smoothing` as a float.

    Raises:
        ValueError: `smoothing` is not a finite real number in [0, 1) (a bool included).
    """
    allowed = "a float in [0, 1) (0 keeps only the last window; 0.99 averages over ~100 windows)"
    if (
        isinstance(smoothing, bool)
        or not isinstance(smoothing, numbers.Real)
        or not math.isfinite(smoothing)
        or not 0.0 <= smoothing < 1.0
    ):
        raise ValueError(f"`{name}` must be {allowed}; received {smoothing!r}.")
    return float(smoothing)


def _dense_sq_norm(values):
    """The squared norm of a dense tensor, in float32."""
    values = tf.cast(values, tf.float32)
    return tf.reduce_sum(tf.square(values))


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
    total = tf.constant(0.0, tf.float32)
    for grad in grads:
        if grad is None:
            continue
        if isinstance(grad, tf.IndexedSlices):
            unique, positions = tf.unique(tf.reshape(grad.indices, [-1]))
            summed = tf.math.unsorted_segment_sum(
                tf.cast(grad.values, tf.float32), positions, tf.size(unique)
            )
            total += _dense_sq_norm(summed)
        else:
            total += _dense_sq_norm(tf.convert_to_tensor(grad))
    return total


def micro_batch_terms(grads: Sequence | None, weight: tf.Tensor | float, replicas: int = 1,
                      squared: tf.Tensor | None = None, preconditioned: tf.Tensor | None = None) -> tuple:
    """One replica micro-batch's share of the window sums: `(R^2 |grad|^2, R/w, 1)`.

    Under R replicas a replica's loss is its local sum divided by its weight
    w = R b (b its samples: what `fit` and `tf.nn.compute_average_loss` do), so
    R grad is its mean-loss gradient and w / R its size. A micro-batch of
    weight <= 0 (all sample weights zero) adds nothing to the window, and
    counts nothing here either.

    Args:
        grads: the replica's gradient list (of its loss, divided by `weight`).
        weight: w, the loss's denominator (`micro_batch_weight`).
        replicas: R, the accumulator's replica count.
        squared: |grad|^2 when the caller has it already (the window computes it in one
            pass with its preconditioned norm); `grads` is then not read.
        preconditioned: |P grad|^2, or None: a fourth term, R^2 |P grad|^2, counted alike.

    Returns:
        `(squared norm, inverse size, count)`, three float32 scalar tensors, and
        the preconditioned squared norm fourth when `preconditioned` is given.
    """
    weight = tf.cast(weight, tf.float32)
    counted = weight > 0.0
    zero = tf.zeros_like(weight)
    norms = [squared_norm(grads) if squared is None else tf.cast(squared, tf.float32)]
    norms += [] if preconditioned is None else [tf.cast(preconditioned, tf.float32)]
    # R^2 multiplies only under several replicas: one kernel fewer a micro-step on one device.
    norms = [n if replicas == 1 else float(replicas) ** 2 * n for n in norms]
    inv = float(replicas) / tf.where(counted, weight, tf.ones_like(weight))
    terms = (tf.where(counted, norms[0], zero), tf.where(counted, inv, zero), tf.cast(counted, tf.float32))
    return terms + tuple(tf.where(counted, n, zero) for n in norms[1:])


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
        window_size: B = sum_k b_k.

    Returns:
        `(g2_est, trace_est, valid)`: float32 scalars and a bool scalar.
        `valid` is false when the window gives no estimate: K < 2, h - 1/B <= 0,
        B <= 0, or a non-finite input (a window with an overflowed gradient,
        skipped by a loss-scale optimizer); the two estimates are then 0.
        Graph-safe: no Python branching on tensors.
    """
    f32 = tf.float32
    sq_sum = tf.cast(micro_sq_norm_sum, f32)
    inv_sum = tf.cast(inv_size_sum, f32)
    count = tf.cast(micro_count, f32)
    big_sq = tf.cast(window_sq_norm, f32)
    size = tf.cast(window_size, f32)

    safe_count = tf.maximum(count, 1.0)
    safe_size = tf.where(size > 0.0, size, tf.ones_like(size))
    mean_sq = sq_sum / safe_count  # m
    mean_inv = inv_sum / safe_count  # h
    denominator = mean_inv - 1.0 / safe_size  # h - 1/B, > 0 iff K >= 2
    valid = (
        (count >= 2.0)
        & (size > 0.0)
        & (denominator > 0.0)
        & tf.math.is_finite(sq_sum)
        & tf.math.is_finite(inv_sum)
        & tf.math.is_finite(big_sq)
    )
    safe_denominator = tf.where(valid, denominator, tf.ones_like(denominator))
    trace = (mean_sq - big_sq) / safe_denominator
    g2 = big_sq - trace / safe_size
    zero = tf.zeros_like(trace)
    return tf.where(valid, g2, zero), tf.where(valid, trace, zero), valid


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

    The state is four zero-initialised scalar variables made by
    `make_variable(name, dtype)`, so their owner (an optimizer) can create,
    track and checkpoint them: `ema_gradient_sq_norm` and `ema_trace`
    (float32, uncorrected EMAs), `ema_weight` (float32, 1 - smoothing^t: the
    EMA of the constant 1, which needs no initialiser but zero) and
    `window_count` (int64, t). Under a strategy, make them mirrored
    (`aggregation="only_first_replica"`) and update them after the window's
    reduction, where every replica holds the same values. Without a callback,
    plain `keras.Variable`s are made (handy eagerly and in tests).

    Args:
        make_variable: `make_variable(name, dtype, shape=())` returning a variable
            of zeros; None makes `keras.Variable`s.
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

    def __init__(self, make_variable: Callable[[str, str], tf.Variable] | None = None,
                 smoothing: float = DEFAULT_SMOOTHING):
        self.smoothing = validate_smoothing(smoothing)
        if make_variable is None:
            make_variable = _keras_variable
        self._ema_g2 = make_variable("ema_gradient_sq_norm", "float32")
        self._ema_trace = make_variable("ema_trace", "float32")
        self._ema_weight = make_variable("ema_weight", "float32")
        self._window_count = make_variable("window_count", "int64")
        self.moments = WindowMoments(make_variable, self.smoothing)

    @property
    def variables(self) -> list:
        """The state variables (the two EMAs, the EMA weight, the window count, the
        windows' moments)."""
        return [self._ema_g2, self._ema_trace, self._ema_weight, self._window_count, self.moments.variable]

    def update(self, g2_est: tf.Tensor, trace_est: tf.Tensor, valid: tf.Tensor,
               window_size: tf.Tensor | float = 1.0) -> None:
        """Folds one window's estimates in when `valid`; a no-op otherwise. Graph-safe.

        Args:
            g2_est: the window's estimate of |G|^2.
            trace_est: the window's estimate of tr(Sigma).
            valid: whether the window gives an estimate (`window_estimates`).
            window_size: its size B, the weight of its moments (`WindowMoments`).
        """
        valid = tf.cast(valid, tf.bool)
        self.moments.add(g2_est, trace_est, window_size, valid)
        # Invalid windows: decay 1 keeps the state, and the estimates (0, or
        # even NaN from a caller) are replaced before they can reach it.
        decay = tf.where(valid, tf.constant(self.smoothing, tf.float32), tf.constant(1.0, tf.float32))
        g2 = tf.where(valid, tf.cast(g2_est, tf.float32), 0.0)
        trace = tf.where(valid, tf.cast(trace_est, tf.float32), 0.0)
        self._ema_g2.assign(decay * self._ema_g2 + (1.0 - decay) * g2)
        self._ema_trace.assign(decay * self._ema_trace + (1.0 - decay) * trace)
        self._ema_weight.assign(decay * self._ema_weight + (1.0 - decay))
        self._window_count.assign_add(tf.cast(valid, tf.int64))

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
        g2, trace, valid = window_estimates(
            micro_sq_norm_sum, inv_size_sum, micro_count, window_sq_norm, window_size
        )
        self.update(g2, trace, valid, window_size)
        return valid

    def noise_scale_value(self) -> float:
        """`noise_scale` as a Python float, read from the variables without tensor ops (eager)."""
        if int(self._window_count.numpy()) == 0:
            return float("nan")
        g2 = float(self._ema_g2.numpy())
        trace = float(self._ema_trace.numpy())
        if g2 == 0.0:
            return float("nan") if trace == 0.0 else math.copysign(float("inf"), trace)
        return trace / g2

    def _corrected(self, ema):
        """`ema` divided by its bias correction; NaN before the first valid window."""
        weight = tf.convert_to_tensor(self._ema_weight)
        seen = tf.convert_to_tensor(self._window_count) > 0
        safe = tf.where(seen, weight, tf.ones_like(weight))
        nan = tf.constant(float("nan"), tf.float32)
        return tf.where(seen, tf.convert_to_tensor(ema) / safe, nan)

    @property
    def window_count(self) -> tf.Tensor:
        """t: the number of valid windows folded in (int64)."""
        return tf.convert_to_tensor(self._window_count)

    @property
    def gradient_sq_norm(self) -> tf.Tensor:
        """Bias-corrected EMA of |G|^2 (float32); NaN before the first valid window."""
        return self._corrected(self._ema_g2)

    @property
    def trace(self) -> tf.Tensor:
        """Bias-corrected EMA of tr(Sigma) (float32); NaN before the first valid window."""
        return self._corrected(self._ema_trace)

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
    their scalar arithmetic (`window_estimates`, the moments, the EMAs) runs once over a
    vector holding both, not once per estimate, which halves the close's scalar kernels
    (on a GPU, launches). The values are the same, bit for bit: every operation is
    elementwise, in the same order. Only the variables' reads and writes stay one per
    variable.

    Args:
        estimates: `NoiseScaleEstimate`s of one smoothing.
        micro_sq_norm_sums: per estimate, its sum_k |g_k|^2.
        inv_size_sum: sum_k 1 / b_k (shared).
        micro_count: K (shared).
        window_sq_norms: per estimate, its |G_B|^2.
        window_size: B (shared).

    Returns:
        `valid`: a bool vector, one per estimate, whether the window was folded in.
    """
    if len({e.smoothing for e in estimates}) != 1:
        raise ValueError("update_from_windows folds estimates of one smoothing.")

    def joined(values, dtype=tf.float32):
        return tf.stack([tf.cast(tf.convert_to_tensor(v), dtype) for v in values])

    g2_est, trace_est, valid = window_estimates(
        joined(micro_sq_norm_sums), inv_size_sum, micro_count, joined(window_sq_norms), window_size)
    smoothing = estimates[0].smoothing
    # `WindowMoments.add`, a row per estimate.
    moments = [e.moments for e in estimates]
    g, t = tf.cast(g2_est, tf.float64), tf.cast(trace_est, tf.float64)
    w = tf.stack([tf.cast(window_size, tf.float64)] * len(estimates))
    terms = tf.stack([w, w * g, w * t, w * g * g, w * t * t, w * g * t, tf.ones_like(w), w * w], axis=1)
    decays = tf.constant([moments[0].decay] * (len(WindowMoments.FIELDS) - 1) + [moments[0].decay ** 2], tf.float64)
    old = joined([m.variable for m in moments], tf.float64)
    new = tf.unstack(tf.where(valid[:, None], decays * old + terms, old))
    # `NoiseScaleEstimate.update`'s EMAs, likewise.
    decay = tf.where(valid, tf.constant(smoothing, tf.float32), tf.constant(1.0, tf.float32))
    g2 = tf.where(valid, g2_est, 0.0)
    trace = tf.where(valid, trace_est, 0.0)
    ema_g2 = tf.unstack(decay * joined([e._ema_g2 for e in estimates]) + (1.0 - decay) * g2)
    ema_trace = tf.unstack(decay * joined([e._ema_trace for e in estimates]) + (1.0 - decay) * trace)
    ema_weight = tf.unstack(decay * joined([e._ema_weight for e in estimates]) + (1.0 - decay))
    counts = tf.unstack(tf.cast(valid, tf.int64))
    for k, estimate in enumerate(estimates):
        moments[k].variable.assign(new[k])
        estimate._ema_g2.assign(ema_g2[k])
        estimate._ema_trace.assign(ema_trace[k])
        estimate._ema_weight.assign(ema_weight[k])
        estimate._window_count.assign_add(counts[k])
    return valid


class WindowMoments:
    """Sums over the windows since the last `reset`: what a confidence bound on B_simple needs.

    Per valid window i, with w_i its size, G_i its |G|^2 estimate and T_i its
    tr(Sigma) estimate: sum w, sum w G, sum w T, sum w G^2, sum w T^2,
    sum w G T, the count n and sum w^2, in one float64 vector variable (`FIELDS`),
    mirrored like the EMAs, decaying by the EMAs' smoothing per window (so they
    follow a drifting B_simple over the same ~1 / (1 - smoothing) windows; sum w^2
    decays by its square). Weighting by size weighs each window by about its
    inverse variance (a window's estimates scatter as 1/B); the decayed weights'
    effective count, (sum w)^2 / sum w^2, is what the bound's standard error
    divides by (~(1 + s) / (1 - s) windows at smoothing s, twice the decayed n).
    `AutoAccumulation` resets it when the batch changes, so the sums hold windows
    of one batch only.

    Args:
        make_variable: `make_variable(name, dtype, shape)` returning a variable of zeros.
        decay: the factor the sums keep per window, in [0, 1).
    """

    FIELDS = ("weight", "g2", "trace", "g2_g2", "trace_trace", "g2_trace", "count", "weight_sq")

    def __init__(self, make_variable: Callable[..., tf.Variable], decay: float = DEFAULT_SMOOTHING):
        self.variable = make_variable("window_moments", "float64", (len(self.FIELDS),))
        self.decay = validate_smoothing(decay, "decay")

    def add(self, g2_est: tf.Tensor, trace_est: tf.Tensor, size: tf.Tensor | float, valid: tf.Tensor) -> None:
        """Adds one window when `valid` (graph-safe).

        Args:
            g2_est: its |G|^2 estimate.
            trace_est: its tr(Sigma) estimate.
            size: its size B, w.
            valid: whether it gives an estimate.
        """
        g, t, w = (tf.cast(value, tf.float64) for value in (g2_est, trace_est, size))
        terms = tf.stack([w, w * g, w * t, w * g * g, w * t * t, w * g * t, tf.ones_like(w), w * w])
        decays = tf.constant([self.decay] * (len(self.FIELDS) - 1) + [self.decay ** 2], tf.float64)
        valid = tf.cast(valid, tf.bool)
        self.variable.assign(tf.where(valid, decays * self.variable + terms, self.variable))

    def values(self) -> dict:
        """The sums by `FIELDS` name, as Python floats (eager)."""
        return dict(zip(self.FIELDS, (float(v) for v in self.variable.numpy())))

    def reset(self) -> None:
        """Forgets every window (eager or traced)."""
        self.variable.assign(tf.zeros_like(self.variable))


def _keras_variable(name: str, dtype: str, shape: tuple = ()):
    """A `keras.Variable` of zeros: the state's default maker."""
    import keras

    return keras.Variable(tf.zeros(shape, dtype), shape=shape, dtype=dtype, trainable=False, name=name)
