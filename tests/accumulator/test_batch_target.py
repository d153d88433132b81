"""The statistics of accum_steps="auto" on simulated windows with a known noise scale.

Each window's |G|^2 and tr(Sigma) estimates are made as the window makes them
(`noise_scale.window_estimates`, from K micro-batch gradients drawn around a known G
with a known Sigma), then fed to the rule's decision (`AutoAccumulation._decide`)
through a stand-in optimizer whose moments are those `WindowMoments` keeps.
"""

import numpy as np
import pytest

from tfx_gradient_accumulator.accumulator.schedules import batch_target as bt
from tfx_gradient_accumulator.accumulator.schedules.auto_batch import AutoAccumulation
from tfx_gradient_accumulator.accumulator.noise.noise_scale import WindowMoments

MICRO, K, OVERHEAD = 4, 2, 0.1
# The noise scale at which growing from 2 to 3 micro-batches is within the budget
# (3 b <= (1 + overhead) 2 b + overhead x B_simple).
THRESHOLD = (3 * MICRO - (1 + OVERHEAD) * 2 * MICRO) / OVERHEAD


def test_the_grid_steps_by_at_most_one_and_a_half_past_two():
    assert bt.accum_steps_grid(100) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96]


@pytest.mark.parametrize("df, table", [(5, 2.015), (9, 1.833), (20, 1.725), (100, 1.660)])
def test_the_quantile_is_students(df, table):
    assert bt.one_sided_quantile(0.95, df) == pytest.approx(table, abs=2e-3)


def test_the_target_is_the_largest_batch_within_the_overhead_budget():
    assert bt.target_accum_steps(1000.0, 4, 0.1, 64) == 24      # 24 x 4 = 96 <= 100 < 32 x 4
    assert bt.target_accum_steps(1000.0, 4, 0.1, 64, start_batch=32) == 32   # 128 <= 35.2 + 100
    assert bt.target_accum_steps(0.0, 4, 0.1, 64, start_batch=32) == 8       # no more than 1.1 x 32
    assert bt.target_accum_steps(float("nan"), 4, 0.1, 64) == 1
    assert bt.next_accum_steps(_moments_of([(1.0, 5000.0)] * 3, spread=0.01), 2, 4, 64, 0.1, 0.95)[0] == 4
    grown, bound, target = bt.next_accum_steps(_moments_of([(1.0, 5000.0)] * 3, spread=0.01), 3, 4, 64, 0.1, 0.95)
    assert (grown, target) == (6, 64) and bound == pytest.approx(5000.0, rel=0.05)  # at most a doubling


def _moments_of(pairs, spread=0.0, size=8.0):
    """WindowMoments.values() of windows (g2, trace), with a relative jitter."""
    rng = np.random.default_rng(0)
    sums = np.zeros(8)
    for g2, trace in pairs:
        g2, trace = g2 * (1 + spread * rng.standard_normal()), trace * (1 + spread * rng.standard_normal())
        sums += size * np.array([1, g2, trace, g2 * g2, trace * trace, g2 * trace, 1 / size, size])
    return dict(zip(WindowMoments.FIELDS, sums))


def _windows(phi, runs, windows, dim, seed):
    """(g2, trace) estimates, shaped (runs, windows), of windows of K micro-batches of MICRO
    samples drawn around G with Sigma = diag(spectrum): B_simple = tr(Sigma) / |G|^2 = phi."""
    rng = np.random.default_rng(seed)
    spectrum = np.linspace(0.2, 1.8, dim)
    mean = np.full(dim, np.sqrt(spectrum.sum() / phi / dim))
    grads = mean + rng.standard_normal((runs, windows, K, dim)) * np.sqrt(spectrum / MICRO)
    micro_sq = (grads ** 2).sum(-1).mean(-1)
    window_sq = (grads.mean(2) ** 2).sum(-1)
    size = K * MICRO
    trace = (micro_sq - window_sq) / (1 / MICRO - 1 / size)       # noise_scale.window_estimates
    return window_sq - trace / size, trace


class _Estimate:
    """What the rule reads of a `NoiseScaleEstimate`: its moments and its window count."""

    def __init__(self):
        self.sums, self.count = np.zeros(8), 0
        estimate = self

        class Moments:
            def values(self):
                return dict(zip(WindowMoments.FIELDS, estimate.sums))

            def reset(self):
                estimate.sums = np.zeros(8)

        self.moments = Moments()

    @property
    def window_count(self):
        import tensorflow as tf
        return tf.constant(self.count, tf.int64)

    def add(self, g2, trace, decay=0.99):
        size = K * MICRO
        decays = np.array([decay] * 7 + [decay ** 2])
        self.sums = decays * self.sums + size * np.array([1, g2, trace, g2 * g2, trace * trace, g2 * trace, 1 / size,
                                                          size])
        self.count += 1


class _Optimizer:
    def __init__(self):
        self.noise_scale_estimate, self.accum_steps, self.noise_scale = _Estimate(), 2, float("nan")


def _first_growths(phi, runs=200, windows=100, dim=1000, seed=0):
    """Per run, the window at which the rule (its defaults) first grew, or -1; and the
    windows between its first and second growths where there were two."""
    g2, trace = _windows(phi, runs, windows, dim, seed)
    first, gaps = np.full(runs, -1), []
    for run in range(runs):
        rule, optimizer = AutoAccumulation(MICRO, 64, start_accum_steps=2), _Optimizer()
        growths = []
        for window in range(windows):
            optimizer.noise_scale_estimate.add(g2[run, window], trace[run, window])
            rule._decide(window + 1, optimizer)
            if window + 1 in rule.schedule:
                growths.append(window)
                optimizer.accum_steps = rule.schedule[window + 1]
        first[run] = growths[0] if growths else -1
        gaps += [b - a for a, b in zip(growths, growths[1:])]
    return first, gaps


def test_few_false_growths_below_the_threshold():
    """At 0.8x the noise scale that justifies the next batch, <= 5% of runs grow in 100 windows."""
    first, _ = _first_growths(0.8 * THRESHOLD)
    assert (first >= 0).mean() <= 0.05


def test_growth_within_sixty_windows_at_twice_the_threshold_and_none_within_the_gate():
    first, gaps = _first_growths(2.0 * THRESHOLD)
    assert ((first >= 0) & (first < 60)).mean() >= 0.90
    assert gaps and min(gaps) >= 10              # no second growth before min_windows new windows


def test_the_retired_rule_grows_falsely():
    """Control: the rule before (margin 2 x the current batch on a 0.99 EMA after 3 windows,
    patience 3) grows at 0.8x the threshold in most runs."""
    g2, trace = _windows(0.8 * THRESHOLD, 100, 100, 1000, 1)
    grew = 0
    for run in range(100):
        ema_g, ema_t, streak = 0.0, 0.0, 0
        for window in range(100):
            ema_g, ema_t = 0.99 * ema_g + 0.01 * g2[run, window], 0.99 * ema_t + 0.01 * trace[run, window]
            phi = ema_t / ema_g if ema_g else float("inf")
            streak = streak + 1 if window >= 2 and phi >= 2 * 2 * MICRO else 0
            if streak >= 3:
                grew += 1
                break
    assert grew / 100 > 0.5


def test_window_moments_keep_what_the_rule_reads():
    import tensorflow as tf
    moments = WindowMoments(lambda name, dtype, shape=(): tf.Variable(tf.zeros(shape, dtype)), decay=0.9)
    stand_in = _Estimate()
    for g2, trace, valid in [(1.0, 30.0, True), (2.0, 10.0, False), (0.5, 40.0, True)]:
        moments.add(g2, trace, K * MICRO, valid)
        if valid:
            stand_in.add(g2, trace, decay=0.9)
    assert moments.values() == pytest.approx(stand_in.moments.values())
    moments.reset()
    assert set(moments.values().values()) == {0.0}


def test_the_bound_is_calibrated_on_decayed_windows():
    """Past ~1 / (1 - smoothing) windows the decayed weights count (sum w)^2 / sum w^2 ~ 199
    windows, not sum w ~ 100: the bound then misses the true noise scale in about
    1 - confidence of runs (0.025), where the decayed count alone would make it ~4x rarer."""
    phi, runs, windows = 2.0 * THRESHOLD, 400, 300
    g2, trace = _windows(phi, runs, windows, 1000, 3)
    misses = {"n_eff": 0, "decayed count": 0}
    for run in range(runs):
        estimate = _Estimate()
        for window in range(windows):
            estimate.add(g2[run, window], trace[run, window])
        moments = estimate.moments.values()
        misses["n_eff"] += bt.lower_bound(moments, 0.975, 10 * phi) > phi
        decayed_only = dict(moments, weight_sq=moments["weight"] ** 2 / (moments["count"] * 1.0))
        misses["decayed count"] += bt.lower_bound(decayed_only, 0.975, 10 * phi) > phi
    assert 0.01 <= misses["n_eff"] / runs <= 0.05
    assert misses["decayed count"] < misses["n_eff"] / 2
