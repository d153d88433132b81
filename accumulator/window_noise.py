"""The window's noise-scale flow: what each micro-step adds to the noise scale's sums, and the close's fold.

`AccumulationWindow` calls `add_micro_batch` from `_accumulate` (replica-local) and
`fold_window` from `_apply_mean_and_reset` (after the reduction), one line each; the
maths are `accumulator.noise_scale` (the estimator) and `accumulator.preconditioning`
(P of an adaptive optimizer). Both norms of a micro-batch come from one pass over its
gradients (`preconditioning.squared_norms`): a micro-step of a small model pays for
its kernels in launches, and the noise scale must not cost more than a quarter of a
micro-step's (`benchmarks/kernel_count.py`).
"""

from __future__ import annotations

import tensorflow as tf

from tfx_gradient_accumulator.accumulator import _tf, preconditioning, replicas
from tfx_gradient_accumulator.accumulator.noise_scale import micro_batch_terms, update_from_windows


def add_micro_batch(state, grads, indices, weight, samples=None) -> None:
    """Replica-local: adds this replica's micro-batch to `state.noise_sums` (none kept: nothing).

    Its terms are R^2 |g|^2, R/w, 1, its size (and R^2 |P g|^2 with a preconditioner),
    R the replicas, as in the window's gradient (see `accumulator.noise_scale`); sizes in
    samples (`samples`, else `weight`), so B_simple is in samples (D_k counts tokens for
    sequences). `overwrite_with_gradient` variables are left out.

    Args:
        state: the window's `WindowState`.
        grads: the micro-batch's gradients.
        indices: their variables' indices in `state.variables`.
        weight: the micro-batch's weight (float32).
        samples: its samples, or None (then `weight`).
    """
    if not state.noise_sums:
        return
    size = tf.cast(weight if samples is None else samples, tf.float32)
    kept = [(g, i) for g, i in zip(grads, indices) if g is not None and i not in state.overwrite_indices]
    squared, preconditioned = preconditioning.squared_norms(
        [g for g, _ in kept], [state.variables[i] for _, i in kept], state.preconditioner)
    terms = micro_batch_terms(None, size, replicas.replicas_in_sync(), squared=squared, preconditioned=preconditioned)
    for total, term in zip(state.noise_sums, terms[:3] + (size,) + terms[3:]):     # `noise_sums`' order
        # On the `tf.Variable` itself: one kernel (a Keras variable's `assign_add` reads and assigns).
        _tf.backing_variable(total).assign_add(term, read_value=False)

def fold_window(state, noise_sums, window_means, window_grads, replica_count, gradient_scale=None,
                loss_scale_divisor=None) -> None:
    """Folds the closing window into the estimates (before the update changes the loss scale
    and the preconditioner).

    Args:
        state: the window's `WindowState`.
        noise_sums: the window's noise sums, reduced over the replicas.
        window_means: the window's mean gradients (dense sums, then rows).
        window_grads: the window's gradients by variable (None: none; `overwrite_with_gradient`
            variables' are left out here).
        replica_count: R.
        gradient_scale: the loss scale the window's sums carry (constant in a window), or None.
        loss_scale_divisor: N where each micro-batch's loss was scaled by S / N (mixed
            float16 under compile's defaults), or None.
    """
    micro_sq_sum, inv_size_sum, micro_count, sample_sum = noise_sums[:4]
    # The window's samples, counted over the replicas as its weight is.
    window_samples = sample_sum / replica_count
    window_sq, _ = preconditioning.squared_norms(window_means, [None] * len(window_means))
    pairs = [(micro_sq_sum, window_sq)]
    if state.preconditioner is not None:
        window_grads = [None if i in state.overwrite_indices else g for i, g in enumerate(window_grads)]
        _, window_preconditioned = preconditioning.squared_norms(window_grads, state.variables, state.preconditioner)
        pairs.append((noise_sums[4], window_preconditioned))
    if gradient_scale is not None:
        # The window's gradients carry the loss scale (constant in a window), each
        # micro-batch's S / N where `loss_scale_divisor` says N.
        square = tf.square(tf.cast(gradient_scale, tf.float32))
        micro_square = square if loss_scale_divisor is None else square / tf.square(loss_scale_divisor)
        pairs = [(micro / micro_square, window / square) for micro, window in pairs]
    estimates = [state.noise_estimate, state.preconditioned_estimate][:len(pairs)]
    if len(pairs) == 1:
        estimates[0].update_from_window(pairs[0][0], inv_size_sum, micro_count, pairs[0][1], window_samples)
    else:
        # Both estimates' scalar arithmetic in one pass (`noise_scale.update_from_windows`).
        update_from_windows(estimates, [micro for micro, _ in pairs], inv_size_sum, micro_count,
                            [window for _, window in pairs], window_samples)
