"""The figures of the AutoAccumulation benchmark, from its recorded curves (pure Python, no TensorFlow).

A run's curve is a list of evaluation points, each {"samples", "updates",
"val_loss"}: the samples and optimizer updates trained so far and the
validation loss after that update. What the report states (the rules fixed in
`benchmarks/auto_batch_tasks.md` before any run):

* every curve read through a trailing mean of `SMOOTHING` evaluations (`smooth`);
* per configuration, the seed-mean curve (evaluation by evaluation);
* the target: the lowest final loss of the fixed configurations' mean curves;
* the samples and updates at a curve's first crossing of the target (linear
  between evaluations; `INF` where it never crosses): of every run (how many
  seeds reach it) and of every mean curve (what a configuration needs);
* paired-seed bootstrap intervals of the ratios (the whole reading, target and
  peer included, redone on each draw of the seeds, the same draw for every
  configuration), and the four goals, each judged on the bound that leans
  against auto (`judge`); the same for every other schedule, so that a miss
  can be set against the best schedule in hindsight.

Why mean curves, not per-run crossings: the target is the best fixed
configuration's mean final loss, which about half of its own runs never reach;
a median of per-run crossings is then undefined for the very configuration
that sets the target, while its mean curve reaches it at its end.

`tests/test_bench_auto_batch.py` runs these on synthetic curves.
"""

import math
import random
import statistics

SMOOTHING = 3               # evaluations in the trailing mean the figures are read from
INF = float("inf")
LEVEL = 0.90                # the bootstrap intervals' coverage
RESAMPLES = 2000            # bootstrap draws of the seeds
REACH_SHARE = 0.9           # auto reaches the target on at least this share of the seeds (9 of 10)
FEWER_UPDATES = 0.75        # auto's updates at most this many times the peer's
MORE_SAMPLES = 1.10         # auto's samples at most this many times the peer's
GOALS = ("reach", "updates", "samples", "pareto")


def smooth(curve, k=SMOOTHING):
    """The curve with each validation loss replaced by the mean of the last `k` evaluations up to it.

    One evaluation moves by more than the differences read here (a spike, a
    lucky dip): the target and the crossings are read from this trailing mean,
    the same for every run, so a run is neither credited for a dip nor charged
    for a spike."""
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


def mean_curve(curves, weights=None):
    """Evaluation by evaluation, the (weighted) mean over seeds of samples, updates and validation loss.

    Over the shortest curve's evaluations, the last point being every curve's last."""
    weights = [1] * len(curves) if weights is None else weights
    pairs = [(w, c) for w, c in zip(weights, curves) if w]
    total = sum(w for w, _ in pairs)
    n = min(len(c) for _, c in pairs)
    picks = list(range(n - 1)) + [-1]
    return [{key: sum(w * c[i][key] for w, c in pairs) / total for key in ("samples", "updates", "val_loss")}
            for i in picks]


def target(mean_curves):
    """(target loss, the configuration it comes from): the lowest final loss of the seed-mean curves.

    `mean_curves`: {label: mean curve} of the fixed configurations (a diverged one, NaN, is no candidate)."""
    finals = {label: final_loss(c) for label, c in mean_curves.items() if math.isfinite(final_loss(c))}
    if not finals:
        raise ValueError("the target needs at least one fixed configuration with a finite final loss")
    best = min(finals, key=finals.get)
    return finals[best], best


def crossing(curve, target_loss):
    """(samples, updates) at the first crossing of `curve`, (INF, INF) where it never crosses."""
    c = first_crossing(curve, target_loss)
    return (INF, INF) if c is None else (c["samples"], c["updates"])


def needs(curves, target_loss):
    """Per seed, the samples and updates to the target (`INF` where not reached): {"samples": [...], "updates": [...]}."""
    crossings = [crossing(c, target_loss) for c in curves]
    return {"samples": [c[0] for c in crossings], "updates": [c[1] for c in crossings]}


def reached(need):
    """How many seeds reached the target."""
    return sum(math.isfinite(v) for v in need["samples"])


def median(values):
    """The median, `INF` counted as larger than any number (so it is INF once half the values are)."""
    if not values:
        raise ValueError("the median of no values")
    ordered = sorted(values)
    n = len(ordered)
    if n % 2:
        return ordered[n // 2]
    low, high = ordered[n // 2 - 1], ordered[n // 2]
    return INF if math.isinf(high) else (low + high) / 2


def ratio(a, b):
    """a / b for needs that may be INF: INF / anything = INF (leans against the numerator), x / INF = 0."""
    if math.isinf(a):
        return INF
    if math.isinf(b):
        return 0.0
    if b <= 0:
        return 1.0 if a <= 0 else INF
    return a / b


def against_ratio(a, b):
    """`ratio` for the Pareto goal: a configuration that never reaches the target (b INF) needs fewer of nothing: 0."""
    return 0.0 if math.isinf(b) else ratio(a, b)


def quantile(values, q):
    """The q-quantile, linear between order statistics (INF stays INF)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    if math.isinf(ordered[high]) or math.isinf(ordered[low]):
        return ordered[high] if position > low else ordered[low]
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def resample_counts(seeds, resamples=RESAMPLES, seed=0):
    """`resamples` draws of `seeds` seeds with replacement, each as how many times every seed is drawn."""
    rng = random.Random(seed)
    out = []
    for _ in range(resamples):
        counts = [0] * seeds
        for _ in range(seeds):
            counts[rng.randrange(seeds)] += 1
        out.append(counts)
    return out


def most_sample_efficient(crossings, fixed_labels):
    """The fixed configuration that reaches the target with the fewest samples (ties: updates), or None."""
    finite = [label for label in fixed_labels if math.isfinite(crossings[label][0])]
    return min(finite, key=lambda label: crossings[label]) if finite else None


def procedure(smoothed, fixed_labels, weights=None):
    """The whole reading on one draw of the seeds: {"target", "target_from", "crossings", "peer"}.

    The seed-mean curve of every configuration; the target (the best fixed final
    loss); each curve's crossing; the most sample-efficient fixed configuration."""
    means = {label: mean_curve(curves, weights) for label, curves in smoothed.items()}
    target_loss, source = target({label: means[label] for label in fixed_labels})
    crossings = {label: crossing(c, target_loss) for label, c in means.items()}
    return {"target": target_loss, "target_from": source, "crossings": crossings,
            "peer": most_sample_efficient(crossings, fixed_labels), "means": means}


def _interval(point, ratios, level):
    tail = (1.0 - level) / 2
    return {"point": point, "low": quantile(ratios, tail), "high": quantile(ratios, 1.0 - tail)}


def judge(candidate, fixed_labels, point, draws, per_seed_needs, level=LEVEL):
    """The four goals for `candidate` against the fixed configurations, each on its interval's bound.

    `point`: `procedure` on every seed; `draws`: `procedure` on each bootstrap
    draw (the target and the peer chosen again in each); `per_seed_needs`: the
    candidate's `needs` at the point target.

    * reach: the candidate's own runs reach the target on >= `REACH_SHARE` of the seeds;
    * updates / samples: the upper bound of its needs over the peer's (the most
      sample-efficient fixed configuration) <= `FEWER_UPDATES` / `MORE_SAMPLES`;
    * pareto: no fixed configuration needs both fewer samples and fewer updates:
      against every one, the upper bound of candidate / it is <= 1 on one axis.
    Returns {goal: {"met", ...figures}}.
    """
    seeds, hits = len(per_seed_needs["samples"]), reached(per_seed_needs)
    needed = math.ceil(REACH_SHARE * seeds - 1e-9)
    out = {"reach": {"met": hits >= needed, "reached": hits, "seeds": seeds, "needed": needed}}
    for goal, axis, limit in (("updates", 1, FEWER_UPDATES), ("samples", 0, MORE_SAMPLES)):
        peer = point["peer"]
        if peer is None:
            out[goal] = {"met": False, "peer": None, "limit": limit, "why": "no fixed configuration reaches the target"}
            continue
        ratios = [ratio(d["crossings"][candidate][axis], d["crossings"][d["peer"]][axis]) if d["peer"] else INF
                  for d in draws]
        figures = _interval(ratio(point["crossings"][candidate][axis], point["crossings"][peer][axis]), ratios, level)
        out[goal] = {"met": figures["high"] <= limit, "peer": peer, "limit": limit, **figures}
    against = {}
    for label in fixed_labels:
        if label == candidate:
            continue
        pair = {name: _interval(against_ratio(point["crossings"][candidate][axis], point["crossings"][label][axis]),
                                [against_ratio(d["crossings"][candidate][axis], d["crossings"][label][axis])
                                 for d in draws], level)
                for name, axis in (("samples", 0), ("updates", 1))}
        pair["excluded"] = pair["samples"]["high"] <= 1.0 or pair["updates"]["high"] <= 1.0
        pair["dominates"] = pair["samples"]["point"] > 1.0 and pair["updates"]["point"] > 1.0
        against[label] = pair
    out["pareto"] = {"met": all(p["excluded"] for p in against.values()),
                     "not_excluded": [label for label, p in against.items() if not p["excluded"]],
                     "dominated_by": [label for label, p in against.items() if p["dominates"]],
                     "against": against}
    return out


def per_seed_goals(candidate, fixed_labels, needs_by_label, peer):
    """Seed by seed (each seed's runs against each other, at the point target and peer): {goal: seeds it holds on}."""
    mine = needs_by_label[candidate]
    counts = {goal: 0 for goal in GOALS}
    for s in range(len(mine["samples"])):
        a_samples, a_updates = mine["samples"][s], mine["updates"][s]
        counts["reach"] += math.isfinite(a_samples)
        if peer is not None:
            counts["updates"] += ratio(a_updates, needs_by_label[peer]["updates"][s]) <= FEWER_UPDATES
            counts["samples"] += ratio(a_samples, needs_by_label[peer]["samples"][s]) <= MORE_SAMPLES
        counts["pareto"] += math.isfinite(a_samples) and not any(
            needs_by_label[label]["samples"][s] < a_samples and needs_by_label[label]["updates"][s] < a_updates
            for label in fixed_labels if label != candidate)
    return counts


def analyse(curves_by_label, kinds, resamples=RESAMPLES, level=LEVEL, seed=0):
    """Everything the report states of one task.

    Args:
        curves_by_label: {label: [curve per seed]} (raw; smoothed here), the seeds paired.
        kinds: {label: "fixed" | "auto" | "ramp"}.

    Returns:
        {"target", "target_from", "peer", "crossings" (of the seed-mean curves), "needs" (per seed),
         "reached", "final", "goals" and "per_seed" (auto's), "revised" (the same of every other
         "auto" kind: the rule re-run at a later commit), "hindsight" (every schedule's goals
         that is not the rule's), "best_in_hindsight"}.
    """
    smoothed = {label: [smooth(c) for c in curves] for label, curves in curves_by_label.items()}
    fixed = [label for label in smoothed if kinds[label] == "fixed"]
    seeds = {len(c) for c in smoothed.values()}
    if len(seeds) != 1:
        raise ValueError(f"configurations have different numbers of seeds: {sorted(seeds)}")
    point = procedure(smoothed, fixed)
    draws = []
    for counts in resample_counts(seeds.pop(), resamples, seed):
        try:
            draws.append(procedure(smoothed, fixed, counts))
        except ValueError:          # every fixed configuration diverged in this draw: nothing reaches
            draws.append({"crossings": {label: (INF, INF) for label in smoothed}, "peer": None})
    need = {label: needs(curves, point["target"]) for label, curves in smoothed.items()}
    out = {"target": point["target"], "target_from": point["target_from"], "peer": point["peer"],
           "crossings": point["crossings"], "needs": need,
           "reached": {label: reached(n) for label, n in need.items()},
           "final": {label: spread([final_loss(c) for c in curves]) for label, curves in smoothed.items()},
           "mean_curves": point["means"]}
    if "auto" in smoothed:
        out["goals"] = judge("auto", fixed, point, draws, need["auto"], level)
        out["per_seed"] = per_seed_goals("auto", fixed, need, point["peer"])
    # Another run of the rule (at a later commit) is judged as auto is, not as a schedule in hindsight.
    revised = [label for label in smoothed if kinds[label] == "auto" and label != "auto"]
    out["revised"] = {label: {"goals": judge(label, fixed, point, draws, need[label], level),
                              "per_seed": per_seed_goals(label, fixed, need, point["peer"])} for label in revised}
    out["hindsight"] = {label: judge(label, fixed, point, draws, need[label], level)
                        for label in smoothed if kinds[label] != "auto"}
    out["best_in_hindsight"] = best_in_hindsight(out["hindsight"])
    return out


def _score(goals):
    """Goals met, then (as tie-breaks) the lowest bounds on updates and samples."""
    met = sum(bool(goals[g]["met"]) for g in GOALS)
    updates = goals["updates"].get("high", INF)
    samples = goals["samples"].get("high", INF)
    return (-met, updates if samples <= MORE_SAMPLES else INF, samples)


def best_in_hindsight(judged):
    """The schedule (not auto) that meets the most goals; ties: the lowest updates bound within the samples limit."""
    if not judged:
        return None
    return min(judged, key=lambda label: _score(judged[label]))


def along(traces, key, fractions, budget):
    """Per fraction of the budget, the median over runs of `key` in their traces at that point (None: absent)."""
    out = []
    for fraction in fractions:
        values = []
        for trace in traces:
            before = [p for p in trace if p["samples"] <= fraction * budget and p.get(key) is not None]
            if before:
                values.append(before[-1][key])
        out.append(statistics.median(values) if values else None)
    return out


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


def bootstrap_mean(values, resamples=RESAMPLES, level=LEVEL, seed=0):
    """The mean of paired differences and its bootstrap interval over the seeds:
    {"mean", "low", "high", "n", "positive"} (positive: how many differences are > 0)."""
    means = [sum(c * x for c, x in zip(counts, values)) / len(values)
             for counts in resample_counts(len(values), resamples, seed)]
    tail = (1 - level) / 2
    return {"mean": statistics.fmean(values), "low": quantile(means, tail), "high": quantile(means, 1 - tail),
            "n": len(values), "positive": sum(x > 0 for x in values)}


def paired_difference(a_values, b_values, resamples=RESAMPLES, level=LEVEL, seed=0):
    """`bootstrap_mean` of a - b over paired seeds."""
    return bootstrap_mean([a - b for a, b in zip(a_values, b_values)], resamples, level, seed)
