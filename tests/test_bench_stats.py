"""The benchmarks' statistics helpers (pure Python, no training)."""

import pytest

from benchmarks import stats


def test_quantile_and_summary():
    values = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert stats.quantile(values, 0.0) == 1.0
    assert stats.quantile(values, 0.5) == 3.0
    assert stats.quantile(values, 0.25) == 2.0
    assert stats.quantile([1.0, 2.0], 0.5) == 1.5          # between order statistics
    s = stats.summary(values)
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    with pytest.raises(ValueError):
        stats.quantile([], 0.5)


def test_ratios_are_per_round_not_ratios_of_medians():
    # Round 2 is slow for both contenders (another process took the CPU): per
    # round the ratio is always 0.5; the medians' ratio would say otherwise.
    a = [1.0, 1.0, 10.0]
    b = [2.0, 20.0, 20.0]
    assert stats.per_round_ratios(a, b) == [0.5, 0.05, 0.5]
    r = stats.ratio_summary(a, b)
    assert r["median"] == 0.5 and r["min"] == 0.05 and r["max"] == 0.5
    assert stats.summary(a)["median"] / stats.summary(b)["median"] == 0.05
    assert stats.per_round_differences([3.0, 5.0], [1.0, 1.0]) == [2.0, 4.0]
    with pytest.raises(ValueError):
        stats.per_round_ratios([1.0], [1.0, 2.0])


def test_verdict():
    ratio = {"median": 0.99, "min": 0.95, "max": 1.02}
    assert stats.verdict(ratio, 0.97) == "met"
    assert stats.verdict(ratio, 1.0) == "within noise"
    assert stats.verdict(ratio, 1.05) == "missed"
    # Lower is better (memory over the parameters).
    assert stats.verdict({"median": 1.1, "min": 1.0, "max": 1.3}, 1.2, higher_is_better=False) == "met"
    assert stats.verdict({"median": 1.9, "min": 1.8, "max": 2.0}, 1.2, higher_is_better=False) == "missed"
    assert stats.verdict({"median": 1.3, "min": 1.1, "max": 1.4}, 1.2, higher_is_better=False) == "within noise"


def test_sanity_check_flags_only_a_difference_beyond_the_spread():
    steady = {2: [100, 101, 99, 100, 102], 4: [101, 100, 99, 103, 100], 8: [99, 100, 101, 100, 98]}
    assert stats.sanity_check(steady) is None
    drifting = {2: [100, 101, 99, 100, 102], 4: [80, 81, 79, 80, 82]}
    flag = stats.sanity_check(drifting)
    assert flag["lowest_at"] == 4 and flag["highest_at"] == 2
    assert flag["difference"] == pytest.approx(20.0)
    assert flag["allowed"] == pytest.approx(1.0)       # the larger interquartile range
    # A wide spread covers the same difference.
    noisy = {2: [60, 100, 140, 100, 100], 4: [40, 80, 120, 80, 80]}
    assert stats.sanity_check(noisy, spread="range") is None
    with pytest.raises(ValueError):
        stats.sanity_check(steady, spread="sd")


def test_fmt():
    assert stats.fmt({"median": 1.234, "min": 1.0, "max": 2.0}, 2) == "1.23 [1.00–2.00]"
    assert stats.fmt({"median": 0.05, "min": 0.04, "max": 0.06}, 1, scale=1000) == "50.0 [40.0–60.0]"
