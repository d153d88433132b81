"""The AutoAccumulation benchmark's analysis on synthetic curves (pure Python, no training)."""

import math

import pytest

from benchmarks import auto_batch_analysis as aba


def curve(points):
    """[(samples, updates, val_loss)] -> the recorded form."""
    return [{"samples": s, "updates": u, "val_loss": v} for s, u, v in points]


def decaying(batch, total=10_000, start=2.0, rate=1.0, floor=0.0, evals=20):
    """A curve whose loss falls with the samples (rate: its speed), evaluated every total/evals samples."""
    return curve([(s, s / batch, floor + (start - floor) * math.exp(-rate * s / total))
                  for s in range(0, total + 1, total // evals)])


def test_first_crossing_interpolates_samples_and_updates_alike():
    c = curve([(0, 0, 2.0), (100, 10, 1.0), (200, 20, 0.5)])
    assert aba.first_crossing(c, 1.5) == {"samples": 50.0, "updates": 5.0}
    assert aba.first_crossing(c, 1.0) == {"samples": 100.0, "updates": 10.0}     # reached at an evaluation
    assert aba.first_crossing(c, 0.75) == {"samples": 150.0, "updates": 15.0}
    assert aba.first_crossing(c, 0.4) is None                                    # never reached
    assert aba.first_crossing(c, 3.0) == {"samples": 0.0, "updates": 0.0}        # reached from the start


def test_first_crossing_is_the_first_not_a_later_one_and_skips_nan():
    c = curve([(0, 0, 2.0), (100, 10, float("nan")), (200, 20, 0.9), (300, 30, 1.4), (400, 40, 0.8)])
    crossing = aba.first_crossing(c, 1.0)
    # Between the last finite point before (0, 2.0) and (200, 0.9): 2.0 -> 0.9 crosses 1.0 at 10/11 of the way.
    assert crossing["samples"] == pytest.approx(200 * (1.0 / 1.1))
    assert crossing["samples"] < 300


def test_target_is_the_lowest_mean_final_loss_over_seeds():
    fixed = {"fixed 32": [curve([(0, 0, 2.0), (10, 1, 0.5)]), curve([(0, 0, 2.0), (10, 1, 0.9)])],
             "fixed 256": [curve([(0, 0, 2.0), (10, 1, 0.6)]), curve([(0, 0, 2.0), (10, 1, 0.6)])]}
    target, source = aba.target(fixed)
    assert (target, source) == (pytest.approx(0.6), "fixed 256")      # 0.7 mean for 32, despite its 0.5 seed
    with pytest.raises(ValueError):
        aba.target({})


def test_needs_counts_the_seeds_that_reach():
    runs = [curve([(0, 0, 2.0), (100, 10, 1.0)]), curve([(0, 0, 2.0), (100, 10, 1.6)])]
    need = aba.needs(runs, 1.5)
    assert need["reached"] == 1 and need["seeds"] == 2 and not aba.all_reached(need)
    assert need["samples"]["mean"] == 50.0 and need["per_seed"][1] is None


def _fixed(target, **batches):
    return {f"fixed {b}": aba.needs([curve(points)], target) for b, points in batches.items()}


def test_verdicts_met_when_auto_is_sample_efficient_with_fewer_updates():
    target = 1.0
    fixed = {"small": aba.needs([decaying(32, rate=3.0)], target),
             "large": aba.needs([decaying(256, rate=1.2)], target)}
    # auto: as fast in samples as the small batch, but its updates count as a batch of 128.
    auto = aba.needs([decaying(128, rate=3.0)], target)
    v = aba.verdicts(auto, fixed)
    assert v["pareto"]["met"] and v["updates"]["met"] and v["samples"]["met"]
    assert v["updates"]["peer"] == "small" and v["updates"]["ratio"] == pytest.approx(0.25)
    assert v["samples"]["ratio"] == pytest.approx(1.0)


def test_verdicts_pareto_missed_when_a_fixed_batch_needs_fewer_of_both():
    target = 1.0
    fixed = {"small": aba.needs([decaying(32, rate=3.0)], target)}
    auto = aba.needs([decaying(16, rate=2.0)], target)        # slower in samples and more updates
    v = aba.verdicts(auto, fixed)
    assert not v["pareto"]["met"] and v["pareto"]["dominated_by"] == ["small"]
    assert not v["samples"]["met"] and v["samples"]["ratio"] == pytest.approx(1.5, rel=0.02)


def test_verdicts_updates_missed_when_saving_under_a_quarter_and_samples_limit():
    target = 1.0
    fixed = {"small": aba.needs([decaying(32, rate=3.0)], target)}
    auto = aba.needs([decaying(40, rate=3.0)], target)            # 20% fewer updates: not 25%
    v = aba.verdicts(auto, fixed)
    assert v["pareto"]["met"] and not v["updates"]["met"] and v["updates"]["ratio"] == pytest.approx(0.8)
    # 10% more samples passes, 12% does not.
    assert aba.verdicts(aba.needs([decaying(128, rate=3.0 / 1.1)], target), fixed)["samples"]["met"]
    assert not aba.verdicts(aba.needs([decaying(128, rate=3.0 / 1.12)], target), fixed)["samples"]["met"]


def test_verdicts_peer_is_the_fixed_batch_with_as_few_samples_and_fewest_updates():
    target = 1.0
    fixed = {"a": aba.needs([decaying(32, rate=3.0)], target),       # most sample-efficient
             "b": aba.needs([decaying(64, rate=2.9)], target),       # fewer samples than auto, fewer updates
             "c": aba.needs([decaying(256, rate=1.2)], target)}      # more samples than auto
    auto = aba.needs([decaying(128, rate=2.8)], target)
    v = aba.verdicts(auto, fixed)
    assert v["updates"]["peer"] == "b" and v["samples"]["peer"] == "a"


def test_verdicts_all_missed_when_auto_misses_the_target_on_a_seed():
    target = 1.0
    fixed = {"small": aba.needs([decaying(32, rate=3.0)] * 2, target)}
    auto = aba.needs([decaying(128, rate=3.0), decaying(128, rate=0.1)], target)
    v = aba.verdicts(auto, fixed)
    assert not any(v[k]["met"] for k in ("pareto", "updates", "samples"))
    assert "1 of 2" in v["pareto"]["why"]


def test_fixed_batches_count_as_reaching_on_most_seeds():
    target = 1.0
    auto = aba.needs([decaying(16, rate=2.0)] * 3, target)          # more samples and more updates
    one_of_three = {"small": aba.needs([decaying(32, rate=3.0)] + [decaying(32, rate=0.1)] * 2, target)}
    v = aba.verdicts(auto, one_of_three)
    assert v["pareto"]["met"] and v["updates"]["peer"] is None        # 1 of 3: not reaching
    two_of_three = {"small": aba.needs([decaying(32, rate=3.0)] * 2 + [decaying(32, rate=0.1)], target)}
    v = aba.verdicts(auto, two_of_three)
    assert not v["pareto"]["met"] and v["pareto"]["dominated_by"] == ["small"]


def test_per_seed_verdicts_count_seeds():
    target = 1.0
    fixed = {"small": [decaying(32, rate=3.0), decaying(32, rate=3.0)]}
    auto = [decaying(128, rate=3.0), decaying(16, rate=2.0)]        # the second seed is dominated
    assert aba.per_seed_verdicts(auto, fixed, target) == {"pareto": 1, "updates": 1, "samples": 1}


def test_goodput_model_recovers_t_micro_and_t_update():
    model = aba.goodput_model({1: 0.003 + 0.010, 2: 0.006 + 0.010, 4: 0.012 + 0.010, 8: 0.024 + 0.010})
    assert model["t_micro"] == pytest.approx(0.003) and model["t_update"] == pytest.approx(0.010)
    with pytest.raises(ValueError):
        aba.goodput_model({1: 0.01})
    per_round = aba.goodput_rounds({1: [0.013, 0.026], 2: [0.016, 0.032], 8: [0.034, 0.068]})
    assert per_round["t_micro"] == pytest.approx([0.003, 0.006]) and per_round["t_update"] == pytest.approx([0.01, 0.02])
    with pytest.raises(ValueError):
        aba.goodput_rounds({1: [0.01], 2: [0.01, 0.02]})


def test_smooth_is_a_trailing_mean_that_keeps_samples_and_updates():
    c = curve([(0, 0, 3.0), (10, 1, 1.0), (20, 2, 2.0), (30, 3, float("nan")), (40, 4, 0.0)])
    smoothed = aba.smooth(c, k=3)
    assert [p["val_loss"] for p in smoothed] == pytest.approx([3.0, 2.0, 2.0, 1.5, 1.0])
    assert [(p["samples"], p["updates"]) for p in smoothed] == [(p["samples"], p["updates"]) for p in c]
    # A one-point dip below the target is not a crossing once smoothed.
    dip = curve([(0, 0, 2.0), (10, 1, 2.0), (20, 2, 0.5), (30, 3, 2.0), (40, 4, 2.0)])
    assert aba.first_crossing(dip, 1.0) is not None and aba.first_crossing(aba.smooth(dip), 1.0) is None
    with pytest.raises(ValueError):
        aba.smooth(c, k=0)
