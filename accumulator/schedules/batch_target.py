"""The batch "auto" grows to: a lower confidence bound on B_simple, and a sample-overhead budget.

Pure Python on the windows' moments (`noise_scale.WindowMoments`), so the rule's statistics
are tested on simulated windows without training. The reasoning (McCandlish et al. 2018's
model, the bound, the grid) is in DEVELOPERS.md, "Design notes by module".
"""

import math
import statistics

# accum_steps "auto" may take: steps of at most 1.5x past 2 (1, 2, 3, 4, 6, 8, 12, 16, 24, ...).
def accum_steps_grid(largest: int) -> list:
    """The accum_steps values up to `largest`: 1, 2, 3, 4, 6, 8, 12, ... (each x1.5 or x1.33).

    Args:
        largest: the largest value wanted.

    Returns:
        The grid, ascending.
    """
    grid, power = [1], 2
    while power <= largest:
        grid += [v for v in (power, power * 3 // 2) if v <= largest and v not in grid]
        power *= 2
    return grid


def one_sided_quantile(confidence: float, degrees_of_freedom: float) -> float:
    """Student's t quantile (Cornish-Fisher expansion; within 1% of the exact one for df >= 5).

    Args:
        confidence: the one-sided level, in (0.5, 1).
        degrees_of_freedom: df > 0.

    Returns:
        t such that P(T <= t) = confidence.
    """
    z = statistics.NormalDist().inv_cdf(confidence)
    df = max(float(degrees_of_freedom), 1.0)
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def exceeds(moments: dict, threshold: float, confidence: float) -> bool:
    """Whether B_simple > `threshold` at `confidence`, from the windows' moments.

    B_simple > c exactly when tr(Sigma) - c |G|^2 > 0: a mean of the windows'
    T_i - c G_i, tested one-sided with the windows' own spread (Fieller's way,
    which stays sound where |G|^2 is barely resolved from 0 and a ratio is not).
    The weighted mean's standard error uses the weights' effective count
    n_eff = (sum w)^2 / sum w^2 (Kish), with n_eff - 1 degrees of freedom.

    Args:
        moments: `WindowMoments.values()` (sums weighted by each window's size).
        threshold: c, in the windows' size unit (samples in `fit`).
        confidence: the one-sided level.

    Returns:
        True when the bound clears `threshold`; False with fewer than 2 windows.
    """
    weight, weight_sq = moments["weight"], moments["weight_sq"]
    if moments["count"] < 2 or weight <= 0 or weight_sq <= 0:
        return False
    n_eff = weight * weight / weight_sq
    c = float(threshold)
    mean = (moments["trace"] - c * moments["g2"]) / weight
    mean_sq = (moments["trace_trace"] - 2 * c * moments["g2_trace"] + c * c * moments["g2_g2"]) / weight
    spread = max(mean_sq - mean * mean, 0.0) / max(n_eff - 1, 1e-12)
    return mean - one_sided_quantile(confidence, max(n_eff - 1, 1.0)) * math.sqrt(spread) > 0.0


def lower_bound(moments: dict, confidence: float, ceiling: float) -> float:
    """The largest c <= `ceiling` that B_simple exceeds at `confidence` (0 when none; bisection).

    Args:
        moments: `WindowMoments.values()`.
        confidence: the one-sided level.
        ceiling: where to stop looking (the largest bound that could change a decision).

    Returns:
        The lower confidence bound on B_simple, capped at `ceiling`; NaN under 2 windows.
    """
    if moments["count"] < 2:
        return float("nan")
    if not exceeds(moments, 0.0, confidence):
        return 0.0
    if exceeds(moments, ceiling, confidence):
        return float(ceiling)
    low, high = 0.0, float(ceiling)
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if exceeds(moments, middle, confidence) else (low, middle)
    return low


def target_accum_steps(bound: float, micro_batch_size: int, max_sample_overhead: float, largest: int,
                       start_batch: float = 0.0) -> int:
    """The largest grid value whose batch costs at most `max_sample_overhead` more samples
    than the starting batch.

    McCandlish et al.'s model: a batch B needs E_min (1 + B / B_noise) samples, so B costs
    (1 + B / B_noise) / (1 + B0 / B_noise) times the samples of the starting batch B0;
    with the bound in place of B_noise, at most 1 + budget when
    B <= (1 + budget) B0 + budget x bound.

    Args:
        bound: the lower confidence bound on B_simple, in samples.
        micro_batch_size: the samples of one micro-batch (all replicas').
        max_sample_overhead: the budget, in (0, 1].
        largest: the largest accum_steps allowed.
        start_batch: B0, the run's starting effective batch, in samples.

    Returns:
        An accum_steps value of the grid, at least 1.
    """
    if not bound >= 0:
        return 1
    allowed = (1 + max_sample_overhead) * start_batch + max_sample_overhead * bound
    fits = [a for a in accum_steps_grid(largest) if a * micro_batch_size <= allowed]
    return fits[-1] if fits else 1


def next_accum_steps(moments: dict, accum_steps: int, micro_batch_size: int, largest: int,
                     max_sample_overhead: float, confidence: float, start_accum_steps: int = 1) -> tuple:
    """One decision of "auto": (the grown accum_steps or None, the bound, the target accum_steps).

    The target is the grid value `target_accum_steps` gives for the lower bound; a growth
    goes toward it by at most a doubling (the next decision rests on windows at the new batch).

    Args:
        moments: `WindowMoments.values()` of the windows at the current batch.
        accum_steps: the current window's length.
        micro_batch_size: the samples of one micro-batch (all replicas').
        largest: the largest accum_steps allowed.
        max_sample_overhead: the budget, in (0, 1].
        confidence: the bound's one-sided level.
        start_accum_steps: the run's first window (the budget counts from its batch).

    Returns:
        `(grown, bound, target)`: `grown` None when the batch stays.
    """
    ceiling = 2 * largest * micro_batch_size / max_sample_overhead
    bound = lower_bound(moments, confidence, ceiling)
    start_batch = start_accum_steps * micro_batch_size
    target = max(target_accum_steps(bound, micro_batch_size, max_sample_overhead, largest, start_batch),
                 accum_steps)
    if target <= accum_steps:
        return None, bound, target
    step = min(target, 2 * accum_steps)
    return max(a for a in accum_steps_grid(step) if a <= step), bound, target
