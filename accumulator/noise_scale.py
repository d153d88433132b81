"""Gradient noise scale from the micro-batches of accumulation windows.

Why: the *simple gradient noise scale* B_simple = tr(Sigma) / |G|^2 of
McCandlish, Kaplan, Amodei et al., "An Empirical Model of Large-Batch Training"
(2018, arXiv:1812.06162), predicts the *critical batch size*: below it, a
larger batch buys an almost proportional cut in optimizer steps; above it,
extra samples are largely wasted. Here G is the true (full-data) gradient and
Sigma the covariance of the per-example gradients. Gradient accumulation is
how one reaches a large batch, and a window of accumulation already computes
what the estimator needs: the gradients of micro-batches of a small size and
their weighted mean, the gradient of a batch of a large size. So the noise
scale comes almost for free: one squared norm per micro-batch.

The estimator (the paper's appendix A, generalised to K micro-batches of
unequal sizes). A window holds K micro-batches with sizes (weights)
b_1..b_K, their gradients g_k (each the gradient of its micro-batch's *mean*
loss) and the window gradient G_B = sum_k b_k g_k / B, with B = sum_k b_k.
With independent samples, g_k = G + noise of covariance Sigma / b_k, and G_B's
noise has covariance sum_k b_k^2 (Sigma / b_k) / B^2 = Sigma / B, so

    E |g_k|^2  = |G|^2 + tr(Sigma) / b_k
    E |G_B|^2  = |G|^2 + tr(Sigma) / B.

With m = mean_k |g_k|^2 and h = mean_k 1/b_k, E[m] = |G|^2 + h tr(Sigma);
subtracting,  E[m - |G_B|^2] = (h - 1/B) tr(Sigma), hence the unbiased

    trace_est = (m - |G_B|^2) / (h - 1/B)
    g2_est    = |G_B|^2 - trace_est / B.

(Both are linear in m and |G_B|^2, so unbiased; for K = 2 equal
micro-batches they are the paper's two-batch-size estimators of appendix A
with B_small = b, B_big = 2b.)
By the harmonic-arithmetic mean inequality h >= K / B, so h - 1/B > 0 exactly
when K >= 2; a window with K = 1 (say the short window `partial_window="apply"`
closes at the end of an epoch) has no small-batch/large-batch contrast and
gives no estimate: it is skipped, never divided by zero.

Single windows are very noisy (g2_est can be negative when B is below the
noise scale), so, as the paper advises, |G|^2 and tr(Sigma) are smoothed
*separately* by exponential moving averages and B_simple is their ratio
(`NoiseScaleEstimate`), not an average of per-window ratios, which would be
biased and dominated by windows where g2_est is near 0.

Under `tf.distribute`: each replica's share of a micro-batch is a micro-batch
of its own, with its own gradient. The per-micro-step work (one squared norm,
one 1/b, one count) is replica-local, held in replica-local (ON_READ, SUM)
variables next to the accumulators; the three window sums (sum |g_k|^2,
sum 1/b_k, K) are reduced across replicas *once per window*, in the same
batched all-reduce as the gradients and the window weight, so the estimator
adds no all-reduce per micro-step. After that reduction, K counts replica
micro-batches (micro-steps x replicas).

The replicas^2 correction, and the sizes. With R replicas, the accumulator's
window gradient is  sum_r w_r grad_r / (W / R),  W the reduced weight: it
rests on the convention that a replica's loss is its local sum S_r divided by
the replica's weight w_r = R b_r (b_r its local sample count), so that the
replicas' gradients sum to the global mean, as stock Keras optimizers expect.
Keras' `fit` does exactly that: its TensorFlow trainer divides each replica's
mean loss by R, and `accumulator.weighting` notes that loss's denominator,
R b_r, as the weight; so does a custom `strategy.run` loop with
`tf.nn.compute_average_loss(per_example_loss)` (S_r / (R b_r)) or with
`global_batch_size=G` and even shares (S_r / G, G = R b_r), passing that
denominator as `micro_batch_weight`. Under it, replica r's micro-batch has
the mean-loss gradient  g_r = R grad_r  and the size  b_r = w_r / R,  and the
window's size is B = W / R. So the estimator takes |g_k|^2 = R^2 |grad_r|^2,
1/b_k = R / w_r and B = W / R: the accumulator's own R (the one that turns W
into the window's mean), in `fit` and custom loops alike, not a guess about
the loss. It applies whenever R > 1; on one device R = 1 and nothing changes.
Note that B is *not* the reduced weight W itself: in `fit` that counts every
sample R times.

What follows for custom loops:

* Weights that are some constant multiple of the denominators (1 for every
  micro-batch, the default) leave the window gradient exact and put the sizes
  in other units: with weight 1, B_simple is in *global* micro-batches (a
  replica's share counts 1/R), as it is in micro-batches on one device.
* Gradients that are some other constant multiple c of the mean-loss ones (a
  local `reduce_mean` without the 1/R: c = R; it also makes the applied
  window gradient R times the mean, as a stock optimizer's would be) scale
  |G|^2 and tr(Sigma) by c^2, in the scale of the gradient actually applied;
  B_simple, their ratio, is unchanged.
* Passing the *local* sample count as the weight while the loss is divided by
  R b_r (or by G) makes every size R times too small, and B_simple in samples
  R times too small: pass the loss's denominator.
* What no constant fixes is a multiple that varies between micro-batches:
  `compute_average_loss(..., global_batch_size=G)` on a short last batch
  (local share s < G / R) divides by G, not by R s, and with the weight G its
  window gradient is not the large batch's mean either. For exact windows
  and estimates with short batches leave out `global_batch_size` and pass
  `micro_batch_weight=R * s` (what `fit` does).

In `GradientAccumulator(..., measure_noise_scale=True)`, variables marked
`overwrite_with_gradient` (float8 scales, whose "gradient" is a new value)
are left out of both norms, and under a `LossScaleOptimizer` both squared
norms are divided by the loss scale squared (the scale is constant within a
window; a window with a non-finite gradient is skipped).

Limits:

* It estimates the *critical* batch: the batch beyond which steps stop
  getting cheaper, a trade-off between steps and samples. It is not the batch
  that gives the best final accuracy or generalisation, which it says nothing
  about.
* B_simple changes during training (in the paper it typically grows as the
  loss falls, often by an order of magnitude or more over a run). A value is
  a reading at the current point, lagging by about 1 / (1 - smoothing)
  windows; it is no constant to fix once.
* B_simple ignores the curvature (the paper's B_noise = tr(H Sigma) /
  (G^T H G)); the paper finds the two typically differ by a small constant
  factor.
* It assumes the micro-batches of a window are independent samples of the
  same distribution. Sizes are in the units of the weights: with
  `micro_batch_weight` in samples, B_simple is in samples; with token counts
  (masked sequences), in tokens, which are correlated within a sequence; with
  the weight 1 a custom loop passes by default, in *micro-batches*. Pass the
  true sizes for a noise scale in samples.
* Sampling without replacement from a finite dataset of N samples shrinks
  the noise of a batch of b by (N - b) / (N - 1) and correlates the
  micro-batches of a window slightly: negligible unless a window is a
  sizeable share of the data.
"""

from __future__ import annotations

import math
import numbers

import tensorflow as tf

DEFAULT_SMOOTHING = 0.99


def validate_smoothing(smoothing, name="smoothing"):
    """Returns `smoothing` as a float if it is a real number in [0, 1); raises ValueError otherwise."""
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
    values = tf.cast(values, tf.float32)
    return tf.reduce_sum(tf.square(values))


def squared_norm(grads):
    """Squared L2 norm, in float32, of a gradient or a list of gradients.

    `None` entries (variables without a gradient) count 0. A `tf.IndexedSlices`
    counts as the dense tensor it stands for: rows with repeated indices are
    summed before squaring (|a + b|^2, not |a|^2 + |b|^2), as in an embedding
    looked up twice in one batch.
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


def micro_batch_terms(grads, weight, replicas=1):
    """One replica micro-batch's share of the window sums: `(R^2 |grad|^2, R/w, 1)`.

    `grads` is the replica's gradient list (of its loss, its local sum divided
    by `weight` = w = R b under `replicas` = R, see the module docstring), so
    R grad is its mean-loss gradient and w / R its size. A micro-batch of
    weight <= 0 (all sample weights zero) adds nothing to the window, and
    counts nothing here either.
    """
    weight = tf.cast(weight, tf.float32)
    counted = weight > 0.0
    zero = tf.zeros_like(weight)
    sq = float(replicas) ** 2 * squared_norm(grads)
    inv = float(replicas) / tf.where(counted, weight, tf.ones_like(weight))
    return tf.where(counted, sq, zero), tf.where(counted, inv, zero), tf.cast(counted, tf.float32)


def window_estimates(micro_sq_norm_sum, inv_size_sum, micro_count, window_sq_norm, window_size):
    """Unbiased |G|^2 and tr(Sigma) from one window; see the module docstring.

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
        make_variable: `make_variable(name, dtype)` returning a scalar variable
            initialised to zero; None makes `keras.Variable`s.
        smoothing: the EMA decay, a float in [0, 1). Default 0.99: single
            windows are noisy (the relative noise of g2_est is of order
            B_simple / B, often > 1 below the critical batch, which is where
            one wants the estimate), so it averages over about 100 windows
            (EMA variance (1 - s) / (1 + s): as ~200 independent windows),
            while B_simple drifts over thousands of updates, far slower. Lower
            it for short runs or when B is well above B_simple; raise it
            (0.999) when B is far below B_simple.
    """

    def __init__(self, make_variable=None, smoothing=DEFAULT_SMOOTHING):
        self.smoothing = validate_smoothing(smoothing)
        if make_variable is None:
            make_variable = _keras_variable
        self._ema_g2 = make_variable("ema_gradient_sq_norm", "float32")
        self._ema_trace = make_variable("ema_trace", "float32")
        self._ema_weight = make_variable("ema_weight", "float32")
        self._window_count = make_variable("window_count", "int64")

    @property
    def variables(self):
        return [self._ema_g2, self._ema_trace, self._ema_weight, self._window_count]

    def update(self, g2_est, trace_est, valid):
        """Folds one window's estimates in when `valid`; a no-op otherwise. Graph-safe."""
        valid = tf.cast(valid, tf.bool)
        # Invalid windows: decay 1 keeps the state, and the estimates (0, or
        # even NaN from a caller) are replaced before they can reach it.
        decay = tf.where(valid, tf.constant(self.smoothing, tf.float32), tf.constant(1.0, tf.float32))
        g2 = tf.where(valid, tf.cast(g2_est, tf.float32), 0.0)
        trace = tf.where(valid, tf.cast(trace_est, tf.float32), 0.0)
        self._ema_g2.assign(decay * self._ema_g2 + (1.0 - decay) * g2)
        self._ema_trace.assign(decay * self._ema_trace + (1.0 - decay) * trace)
        self._ema_weight.assign(decay * self._ema_weight + (1.0 - decay))
        self._window_count.assign_add(tf.cast(valid, tf.int64))

    def update_from_window(self, micro_sq_norm_sum, inv_size_sum, micro_count, window_sq_norm, window_size):
        """`window_estimates(...)` then `update(...)`: one call per closed window; returns `valid`."""
        g2, trace, valid = window_estimates(
            micro_sq_norm_sum, inv_size_sum, micro_count, window_sq_norm, window_size
        )
        self.update(g2, trace, valid)
        return valid

    def noise_scale_value(self):
        """`noise_scale` as a Python float, read from the variables without tensor ops (eager)."""
        if int(self._window_count.numpy()) == 0:
            return float("nan")
        g2 = float(self._ema_g2.numpy())
        trace = float(self._ema_trace.numpy())
        if g2 == 0.0:
            return float("nan") if trace == 0.0 else math.copysign(float("inf"), trace)
        return trace / g2

    def _corrected(self, ema):
        weight = tf.convert_to_tensor(self._ema_weight)
        seen = tf.convert_to_tensor(self._window_count) > 0
        safe = tf.where(seen, weight, tf.ones_like(weight))
        nan = tf.constant(float("nan"), tf.float32)
        return tf.where(seen, tf.convert_to_tensor(ema) / safe, nan)

    @property
    def window_count(self):
        """t: the number of valid windows folded in (int64)."""
        return tf.convert_to_tensor(self._window_count)

    @property
    def gradient_sq_norm(self):
        """Bias-corrected EMA of |G|^2 (float32); NaN before the first valid window."""
        return self._corrected(self._ema_g2)

    @property
    def trace(self):
        """Bias-corrected EMA of tr(Sigma) (float32); NaN before the first valid window."""
        return self._corrected(self._ema_trace)

    @property
    def noise_scale(self):
        """B_simple = EMA(tr Sigma) / EMA(|G|^2), in the units of the micro-batch weights.

        NaN before the first valid window: "not measured yet", which 0 (a
        noise-free gradient, "any batch is too large") or a large number
        would misstate, and which `tf.math.is_nan` or `window_count` tells
        apart. Not clipped: a negative or huge value means EMA(|G|^2) is not
        resolved from 0 yet (windows far below the noise scale): raise the
        smoothing or wait for more windows.
        """
        return self.trace / self.gradient_sq_norm


def _keras_variable(name, dtype):
    import keras

    return keras.Variable(0, shape=(), dtype=dtype, trainable=False, name=name)
