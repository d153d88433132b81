"""The window's noise-scale flow: what each micro-step adds to the noise scale's sums, and the close's fold.

`AccumulationWindow` calls `add_micro_batch` from `_accumulate` (replica-local) and
`fold_window` from `_apply_mean_and_reset` (after the reduction), one line each; the
maths are `accumulator.noise.noise_scale` (the estimator) and `accumulator.noise.preconditioning`
(P of an adaptive optimizer). A micro-step of a small model pays for its kernels in
launches, and the noise scale must not cost more than a quarter of a micro-step's
(`benchmarks/kernel_count.py`), so a micro-step makes one pass over its gradients and
adds to two variables:

- `sums` (`noise_scale_sums`), one small vector: the sizes, the count, and |g_k|^2 where no
  preconditioner is measured;
- with an adaptive optimizer's preconditioner P, `squares` (`noise_scale_squares`): per coordinate of
  the variables, sum_k g_k^2. P changes only when the window's update is applied, so
  sum_k |P g_k|^2 = sum_i P_i^2 sum_k g_ki^2 reads P once, at the close, not at every
  micro-step: one float32 vector the size of the variables buys that.

Each function takes the window's state and reads its noise scale's variables
(`state.saved.noise`, a `NoiseScaleVariables`, made with the window's other variables by
`accumulator.window.state`; None where the window does not measure: then they do nothing).
What version 0.3 saved in its place loads converted (`from_version_0_3`).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, replicas
from tfx_gradient_accumulator.accumulator.noise import preconditioning
from tfx_gradient_accumulator.accumulator.noise.noise_scale import (
    WindowMoments, micro_batch_terms, squared_norm, update_from_windows,
)

# The fields of `sums`: sum_k R^2 |g_k|^2 (only where the window keeps no
# `squares`), sum_k 1/b_k, K and sum_k b_k.
SUM_FIELDS = ("micro_sq_norm_sum", "inv_size_sum", "micro_count", "sample_sum")


def add_micro_batch(state, grads, indices, weight, samples=None) -> None:
    """Replica-local: adds this replica's micro-batch to the window's sums (none kept: nothing).

    Its terms are R^2 |g|^2 (or g^2 per coordinate, into `squares`), R/w, 1 and
    its size, R the replicas, as in the window's gradient (see
    `noise_scale.micro_batch_terms`); sizes in samples (`samples`, else `weight`), so
    B_simple is in samples (D_k counts tokens for sequences).
    `overwrite_with_gradient` variables are left out.

    Args:
        state: the window's `WindowState` (its noise scale's variables: `state.saved.noise`).
        grads: the micro-batch's gradients.
        indices: their variables' indices in `state.variables`.
        weight: the micro-batch's weight (float32).
        samples: its samples, or None (then `weight`).
    """
    noise = state.saved.noise
    if noise is None:
        return
    size = weight if samples is None else tf.cast(samples, tf.float32)
    kept = {i: g for g, i in zip(grads, indices) if g is not None and i not in state.overwrite_indices}
    norms = []
    if noise.squares is None:
        norms.append(squared_norm(list(kept.values())))
    else:
        squares = preconditioning.joined_squares([kept.get(i) for i in noise.layout],
                                                 [state.variables[i] for i in noise.layout])
        # On the `tf.Variable` itself: one kernel (a Keras variable's `assign_add` reads and assigns).
        _tf.backing_variable(noise.squares).assign_add(tf.where(size > 0.0, squares, 0.0), read_value=False)
    terms = micro_batch_terms(size, replicas.replicas_in_sync(), norms)
    _tf.backing_variable(noise.sums).assign_add(terms, read_value=False)


def sums_to_reduce(state, distribution) -> list:
    """What the close sums over the replicas of the noise scale (none kept: nothing):
    `sums`, and under a strategy with `squares` each replica's
    `squares_sums`, read with P where the squares lie (cross-replica context)."""
    noise = state.saved.noise
    if noise is None:
        return []
    sums = [_tf.backing_variable(noise.sums)]
    if noise.squares is not None and distribution is not None:
        sums.append(distribution.extended.call_for_each_replica(squares_sums, args=(state,)))
    return sums


def squares_sums(state, scale_squared=None) -> tf.Tensor:
    """Replica-local: `[sum_k |g_k|^2, sum_k |P g_k|^2]` of this replica's micro-batches, from
    `squares` (`scale_squared`: P^2 joined, or None to read it now)."""
    noise = state.saved.noise
    if scale_squared is None:
        scale_squared = tf.square(preconditioning.joined_scale(
            noise.preconditioner, [state.variables[i] for i in noise.layout]))
    squares = tf.convert_to_tensor(_tf.backing_variable(noise.squares))
    return tf.stack([tf.reduce_sum(squares), tf.reduce_sum(scale_squared * squares)])


def fold_window(state, noise_sums, window_grads, replica_count, gradient_scale=None,
                loss_scale_divisor=None) -> None:
    """Folds the closing window into the estimates (before the update changes the loss scale
    and the preconditioner).

    Args:
        state: the window's `WindowState`.
        noise_sums: `[sums]`, reduced over the replicas, and under a strategy the
            replicas' `squares_sums` reduced likewise (without one, read here).
        window_grads: the window's gradients by variable (None: none).
        replica_count: R.
        gradient_scale: the loss scale the window's sums carry (constant in a window), or None.
        loss_scale_divisor: N where each micro-batch's loss was scaled by S / N (mixed
            float16 under compile's defaults), or None.
    """
    noise = state.saved.noise
    sums = tf.unstack(tf.convert_to_tensor(noise_sums[0]))
    inv_size_sum, micro_count, sample_sum = sums[-3:]
    # The window's samples, counted over the replicas as its weight is.
    window_samples = sample_sum if replica_count == 1 else sample_sum / replica_count
    kept = [None if i in state.overwrite_indices else g for i, g in enumerate(window_grads)]
    # Per estimate (raw, then preconditioned), the micro-batches' sum and the window's norm.
    if noise.squares is None:
        micro = tf.reshape(sums[0], [1])
        window = tf.reshape(squared_norm([g for g in kept if g is not None]), [1])
    else:
        variables = [state.variables[i] for i in noise.layout]
        # P, read once per window, for the micro-batches' squares and the window's gradient alike.
        scale_squared = tf.square(preconditioning.joined_scale(noise.preconditioner, variables))
        window_squares = preconditioning.joined_squares([kept[i] for i in noise.layout], variables)
        if len(noise_sums) > 1:     # the replicas' `squares_sums`, reduced
            micro = noise_sums[1]
            window = tf.stack([tf.reduce_sum(window_squares), tf.reduce_sum(scale_squared * window_squares)])
        else:
            # Both vectors' sums, plain and with P^2, in one pass: [[micro, window] raw, ... with P].
            both = tf.stack([tf.convert_to_tensor(_tf.backing_variable(noise.squares)), window_squares])
            micro, window = tf.unstack(tf.stack(
                [tf.reduce_sum(both, axis=1), tf.reduce_sum(scale_squared * both, axis=1)], axis=1))
        if replica_count > 1:
            micro = float(replica_count) ** 2 * micro
    if gradient_scale is not None:
        # The window's gradients carry the loss scale (constant in a window), each
        # micro-batch's S / N where `loss_scale_divisor` says N.
        square = tf.square(tf.cast(gradient_scale, tf.float32))
        micro_square = square if loss_scale_divisor is None else square / tf.square(loss_scale_divisor)
        micro, window = micro / micro_square, window / square
    # Both estimates' arithmetic in one pass (`noise_scale.update_from_windows`).
    estimates = [noise.estimate] + ([] if noise.squares is None else [noise.preconditioned_estimate])
    update_from_windows(estimates, micro, inv_size_sum, micro_count, window, window_samples)


def reset(state) -> list:
    """The window's sums emptied (the close's last step); returns the variables to refill with
    zeros in place (`squares`), which the close's refill takes."""
    noise = state.saved.noise
    if noise is None:
        return []
    _tf.backing_variable(noise.sums).assign(tf.zeros(noise.sums.shape, tf.float32))
    return [] if noise.squares is None else [noise.squares]


# What version 0.3 saved of the noise scale where this version saves `noise_squares`,
# `noise_sums` and one state vector per estimate: four scalar sums, the raw estimate's
# five variables, with a preconditioner its sum and the preconditioned estimate's five.
_SUMS_0_3 = ("micro_sq_norm_sum", "inv_size_sum", "micro_count", "sample_sum")
_ESTIMATE_0_3 = ("ema_gradient_sq_norm", "ema_trace", "ema_weight", "window_count", "window_moments")


def from_version_0_3(state, variables, values) -> list | None:
    """`values`, an optimizer's variables as version 0.3 saved them, in this version's layout;
    None where they are not that (a count or a shape differs).

    The estimates carry over (0.3 kept EMAs; these are the decayed sums, the EMAs over
    1 - smoothing). The open window's sums carry over without a preconditioner; with one,
    0.3 kept no squares per coordinate, so a window open when it was saved is left out of
    the estimate (its inverse-size sum set to inf: the window gives none) while it trains
    on as saved.

    Args:
        state: the window's `WindowState`, built.
        variables: the optimizer's `variables`.
        values: one array per variable of the 0.3 layout, in its order.
    """
    measured = state.saved.noise
    if measured is None:
        return None
    estimates = [e for e in (measured.estimate, measured.preconditioned_estimate) if e is not None]
    noise = [v for v in (measured.squares, measured.sums) if v is not None] + [e.state for e in estimates]
    positions = [i for i, v in enumerate(variables) if any(v is n for n in noise)]
    first, preconditioned = positions[0], len(estimates) == 2
    old_count = len(_SUMS_0_3) + len(_ESTIMATE_0_3) + preconditioned * (1 + len(_ESTIMATE_0_3))
    if positions != list(range(first, first + len(noise))) or len(values) != len(variables) - len(noise) + old_count:
        return None
    old = [np.asarray(v) for v in values[first:first + old_count]]
    # 0.3's order: the four sums, the raw estimate, then the preconditioned sum and estimate.
    raw_end = len(_SUMS_0_3) + len(_ESTIMATE_0_3)
    sums, scalars = old[:len(_SUMS_0_3)], old[:len(_SUMS_0_3)] + old[raw_end:raw_end + 1]
    parts = [old[len(_SUMS_0_3):raw_end]] + ([old[raw_end + 1:]] if preconditioned else [])
    if any(v.shape != () for v in scalars + [p for part in parts for p in part[:-1]]) or any(
            part[-1].shape != (len(WindowMoments.FIELDS),) for part in parts):
        return None
    new = []
    if measured.squares is not None:
        new.append(np.zeros(measured.squares.shape, np.float32))
        inv = np.float32(np.inf) if sums[2] > 0 else sums[1]
        new.append(np.array([inv, sums[2], sums[3]], np.float32))
    else:
        new.append(np.array(sums, np.float32))
    for estimate, (ema_g2, ema_trace, ema_weight, count, moments) in zip(estimates, parts):
        kept = 1.0 - estimate.smoothing
        new.append(np.concatenate([[ema_g2 / kept, ema_trace / kept, ema_weight / kept, count], moments]))
    return list(values[:first]) + new + list(values[first + old_count:])
