"""Pure-Python statistics of the benchmark rounds (no TensorFlow; `tests/test_bench_stats.py`).

A measurement is a list of values, one per interleaved round. Summaries are
medians with their spread (min and max over the rounds, and the interquartile
range); ratios between contenders are taken round by round, then summarized,
so that a slow round (another process on the CPU) slows both sides of its ratio
instead of one side of a ratio of medians.
"""

import math
import statistics


def quantile(values, q):
    """The q-quantile of `values`, linear between order statistics (numpy's default)."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("quantile of no values")
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def summary(values):
    """{median, min, max, q1, q3, n} of a list of per-round values."""
    values = [float(v) for v in values]
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "q1": quantile(values, 0.25), "q3": quantile(values, 0.75), "n": len(values)}


def per_round_ratios(numerator, denominator):
    """numerator[r] / denominator[r] for every round r (the lists must pair up)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"rounds do not pair up: {len(numerator)} vs {len(denominator)}")
    return [a / b for a, b in zip(numerator, denominator)]


def ratio_summary(numerator, denominator):
    """Summary of the per-round ratios (not the ratio of the medians)."""
    return summary(per_round_ratios(numerator, denominator))


def per_round_differences(minuend, subtrahend):
    if len(minuend) != len(subtrahend):
        raise ValueError(f"rounds do not pair up: {len(minuend)} vs {len(subtrahend)}")
    return [a - b for a, b in zip(minuend, subtrahend)]


def verdict(ratio, target, higher_is_better=True):
    """"met", "missed" or "within noise" for a ratio summary against a target.

    Met: the median is on the right side of the target. Missed: every round is
    on the wrong side (the whole min-max range). Within noise: the median is on
    the wrong side but some round reached the target.
    """
    if higher_is_better:
        if ratio["median"] >= target:
            return "met"
        return "missed" if ratio["max"] < target else "within noise"
    if ratio["median"] <= target:
        return "met"
    return "missed" if ratio["min"] > target else "within noise"


def sanity_check(cells, spread="iqr"):
    """Flags a contender whose figure moves with a parameter it does not depend on.

    `cells` maps each value of that parameter (e.g. N) to the per-round values
    of one contender measured at that value (e.g. plain b, whose work does not
    depend on N). Returns None when the medians of the cells lie within the
    largest within-cell spread (interquartile range with spread="iqr", min-max
    with "range"), else a dict saying by how much they differ.
    """
    summaries = {key: summary(values) for key, values in cells.items()}
    medians = [s["median"] for s in summaries.values()]
    if spread == "iqr":
        widths = [s["q3"] - s["q1"] for s in summaries.values()]
    elif spread == "range":
        widths = [s["max"] - s["min"] for s in summaries.values()]
    else:
        raise ValueError(f"spread must be 'iqr' or 'range'; received {spread!r}")
    difference, allowed = max(medians) - min(medians), max(widths)
    if difference <= allowed:
        return None
    low = min(summaries, key=lambda k: summaries[k]["median"])
    high = max(summaries, key=lambda k: summaries[k]["median"])
    return {"difference": difference, "allowed": allowed, "relative": difference / statistics.median(medians),
            "lowest_at": low, "highest_at": high}


def fmt(s, digits=0, scale=1.0):
    """'median [min–max]' of a summary."""
    return (f"{s['median'] * scale:.{digits}f} "
            f"[{s['min'] * scale:.{digits}f}–{s['max'] * scale:.{digits}f}]")
