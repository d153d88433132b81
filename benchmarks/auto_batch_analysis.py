"""The figures of the AutoAccumulation benchmark, from its recorded curves (pure Python, no TensorFlow).

A run's curve is a list of evaluation points, each {"samples", "updates",
"val_loss"}: the samples and optimizer updates trained so far and the
validation loss of the weights after that update. `benchmarks.auto_batch`
records them; this module turns them into what the report states:

* every curve read through a trailing mean of `SMOOTHING` evaluations (`smooth`);
* the target: the best fixed effective batch's final validation loss (the
  lowest, over the fixed batches, of their final loss averaged over seeds);
* what each run needs to reach it: the samples and the updates at the curve's
  first crossing of the target, interpolated linearly between the two
  evaluations around it (None: not reached);
* the verdicts on the goal: auto is Pareto-better than every fixed batch (none
  reaches the target with both fewer samples and fewer updates), needs at
  least 25% fewer updates than the fixed batch that needs as few samples, and
  at most 10% more samples than the most sample-efficient fixed batch.

`tests/test_bench_auto_batch.py` runs these on synthetic curves.
"""

import math
import statistics

FEWER_UPDATES = 0.25        # auto needs at most (1 - this) x the updates of its peer
MORE_SAMPLES = 0.10         # ... and at most (1 + this) x the samples of the most sample-efficient


SMOOTHING = 3              # evaluations in the trailing mean the figures are read from


def smooth(curve, k=SMOOTHING):
    """The curve with each validation loss replaced by the mean of the last `k` evaluations up to it.

    One evaluation of a small validation set moves by more than the differences
    read here (a spike at one point, a lucky dip at the next): the target and
    the crossings are read from this trailing mean, the same for every run, so a
    run is neither credited for a dip nor charged for a spike."""
    if k < 1:
        raise ValueError(f"k must be >= 1; received {k}")
    out = []
    for i, point in enumerate(curve):
        window = [p["val_loss"] for p in curve[max(0, i - k + 1):i + 1] if math.isfinite(p["val_loss"])]
        out.append({**point, "val_loss": statistics.fmean(window) if window else float("nan")})
    return out


def first_crossing(curve, target):
    """{"samples", "updates"} where `curve` first reaches `target` (val_loss <= target), or None.

    Linear between the evaluation before the crossing and the first one at or
    below the target; a curve that starts at or below it crosses at its first point."""
    previous = None
    for point in curve:
        loss = point["val_loss"]
        if math.isfinite(loss) and loss <= target:
            if previous is None:
                return {"samples": float(point["samples"]), "updates": float(point["updates"])}
            drop = previous["val_loss"] - loss
            t = 1.0 if drop <= 0 else (previous["val_loss"] - target) / drop
            return {key: previous[key] + t * (point[key] - previous[key]) for key in ("samples", "updates")}
        if math.isfinite(loss):
            previous = point
    return None


def final_loss(curve):
    """The validation loss at the curve's last evaluation."""
    if not curve:
        raise ValueError("an empty curve has no final loss")
    return curve[-1]["val_loss"]


def spread(values):
    """{"mean", "min", "max", "n"} of a list of numbers (None entries are not counted)."""
    values = [float(v) for v in values if v is not None]
    if not values:
        return {"mean": None, "min": None, "max": None, "n": 0}
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "n": len(values)}


def target(fixed_runs):
    """(target loss, the fixed batch it comes from): the lowest mean-over-seeds final loss.

    `fixed_runs`: {label: [curve per seed]}."""
    if not fixed_runs:
        raise ValueError("the target needs at least one fixed batch")
    means = {label: statistics.fmean(final_loss(c) for c in curves) for label, curves in fixed_runs.items()}
    best = min(means, key=means.get)
    return means[best], best


def needs(curves, target_loss):
    """What a configuration needs over its seeds: samples and updates (spread over the seeds
    that reached the target) and how many seeds reached it."""
    crossings = [first_crossing(c, target_loss) for c in curves]
    reached = [c for c in crossings if c is not None]
    return {"samples": spread([c["samples"] for c in reached]), "updates": spread([c["updates"] for c in reached]),
            "reached": len(reached), "seeds": len(curves), "per_seed": crossings}


def all_reached(need):
    return need["seeds"] > 0 and need["reached"] == need["seeds"]


def most_reached(need):
    """A majority of the seeds reached the target (how a fixed batch counts as reaching it)."""
    return need["seeds"] > 0 and 2 * need["reached"] > need["seeds"]


def verdicts(auto, fixed, fewer_updates=FEWER_UPDATES, more_samples=MORE_SAMPLES):
    """The goal's three verdicts for `auto` against `fixed` ({label: needs(...)}), on seed means.

    Auto counts as reaching the target only when every seed does; a fixed
    batch when most of its seeds do (its figures: the mean over those). The
    target is the best fixed batch's own mean final loss, which about half of
    its seeds reach by the end: stricter, it would not count as reaching its
    own target. Both choices lean against auto.
    Returns {"pareto": {...}, "updates": {...}, "samples": {...}}, each with
    "met" (bool) and the figures it was judged on:

    * pareto: the fixed batches that dominate auto (reach the target with
      strictly fewer samples and strictly fewer updates); met when none does;
    * updates: auto's updates against the peer: among the fixed batches that
      need no more samples than auto, the one that needs the fewest updates
      (where none needs as few samples as auto, the most sample-efficient
      fixed batch); met when auto needs <= (1 - fewer_updates) x its updates;
    * samples: auto's samples against the most sample-efficient fixed batch;
      met when <= (1 + more_samples) x its samples.

    Where auto does not reach the target on every seed, all three are missed.
    """
    reached = {label: n for label, n in fixed.items() if most_reached(n)}
    if not all_reached(auto):
        why = f"it reached the target on {auto['reached']} of {auto['seeds']} seeds"
        return {key: {"met": False, "why": why} for key in ("pareto", "updates", "samples")}
    a_samples, a_updates = auto["samples"]["mean"], auto["updates"]["mean"]
    dominating = [label for label, n in reached.items()
                  if n["samples"]["mean"] < a_samples and n["updates"]["mean"] < a_updates]
    result = {"pareto": {"met": not dominating, "dominated_by": dominating}}
    if not reached:
        why = "no fixed batch reached the target on most seeds"
        result["updates"] = {"met": True, "why": why, "peer": None}
        result["samples"] = {"met": True, "why": why, "peer": None}
        return result
    most_efficient = min(reached, key=lambda label: reached[label]["samples"]["mean"])
    as_few = [label for label, n in reached.items() if n["samples"]["mean"] <= a_samples]
    peer = min(as_few, key=lambda label: reached[label]["updates"]["mean"]) if as_few else most_efficient
    update_ratio = a_updates / reached[peer]["updates"]["mean"]
    sample_ratio = a_samples / reached[most_efficient]["samples"]["mean"]
    result["updates"] = {"met": update_ratio <= 1.0 - fewer_updates, "peer": peer, "ratio": update_ratio,
                         "limit": 1.0 - fewer_updates}
    result["samples"] = {"met": sample_ratio <= 1.0 + more_samples, "peer": most_efficient, "ratio": sample_ratio,
                         "limit": 1.0 + more_samples}
    return result


def per_seed_verdicts(auto_curves, fixed_curves, target_loss, **kwargs):
    """The same verdicts seed by seed (each seed's runs against each other): {key: seeds met}."""
    counts = {"pareto": 0, "updates": 0, "samples": 0}
    for i, auto_curve in enumerate(auto_curves):
        one = verdicts(needs([auto_curve], target_loss),
                       {label: needs([curves[i]], target_loss) for label, curves in fixed_curves.items()},
                       **kwargs)
        for key in counts:
            counts[key] += bool(one[key]["met"])
    return counts


def goodput_rounds(seconds_per_update_by_round):
    """`goodput_model` fitted round by round: {accum_steps: [seconds per update, a round each]} ->
    {"t_micro": [...], "t_update": [...]}, a value per round (their spread is the fit's)."""
    rounds = {len(v) for v in seconds_per_update_by_round.values()}
    if len(rounds) != 1:
        raise ValueError(f"rounds do not pair up: {sorted(rounds)}")
    fits = [goodput_model({n: v[r] for n, v in seconds_per_update_by_round.items()}) for r in range(rounds.pop())]
    return {"t_micro": [f["t_micro"] for f in fits], "t_update": [f["t_update"] for f in fits]}


def goodput_model(seconds_per_update):
    """Least squares of time per update = micro-steps x t_micro + t_update over accum_steps.

    `seconds_per_update`: {accum_steps: seconds per update}. Returns
    {"t_micro", "t_update"} in seconds (t_update: what an update costs besides
    its micro-steps: the all-reduce and the inner optimizer's step)."""
    if len(seconds_per_update) < 2:
        raise ValueError("the goodput model needs at least two accum_steps")
    xs = [float(n) for n in seconds_per_update]
    ys = [float(seconds_per_update[n]) for n in seconds_per_update]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return {"t_micro": slope, "t_update": mean_y - slope * mean_x}
