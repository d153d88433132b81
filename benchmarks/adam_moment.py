"""What Adam's second moment does at a growth of the effective batch: keep it, or rescale it.

    python -m benchmarks.adam_moment             # 10 seeds x 4 variants: ~15-25 min on 2 shared cores
    python -m benchmarks.adam_moment --quick     # a smoke run: 2 seeds, a fifth of the samples (~2 min)
    python -m benchmarks.adam_moment --resume    # goes on with a cut run (adam_moment.json)
    python -m benchmarks.adam_moment --report_only

One forced growth x2 on the "text" task of `benchmarks.auto_batch` (its data,
model, micro-batch, learning rate and `train` machinery, imported; its flags
--quick, --seeds, --evals, --resume, --report_only and --out are the ones used
here): `AccumulationSchedule({0: a, K: 2a}, by="update")` with the benchmark's
`lr_scaling="sqrt"` and the library's default learning-rate ramp (`make_ramp`),
K the update after about a third of the samples. Four variants, the same seeds
(initial weights and data order) for each:

* ``keep``: the library's behaviour, Adam's moments untouched at the growth;
* ``rescale``: at the growth, Adam's second moments v multiplied by 1/2 (the
  all-noise limit: E[g^2] = G^2 + sigma^2/B halves when B doubles and G^2 = 0);
* ``fixed_a``, ``fixed_2a``: the start batch, and the doubled batch at its
  square-root learning rate, for the whole budget (references).

A probe reads the inner Adam's m and v at every update from K-10 on: the median
over parameters of v_hat(t)/v_hat(K), of v_hat(t) over the mean g^2 of the
updates since K (g_t^2 recovered exactly as (v_t - beta2 v_{t-1})/(1 - beta2)),
and of |update|/lr (= |m_hat|/(sqrt(v_hat)+eps), Keras 3 Adam's step). The
report (adam_moment.md, .png) is written from adam_moment.json.
"""

import collections
import datetime
import json
import math
import os
import platform
import statistics
import sys
import time

from absl import app, flags, logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import auto_batch  # noqa: E402  (TF imported lazily; defines the flags used here)
from benchmarks import auto_batch_analysis as aba  # noqa: E402

TASK = "text"                       # tuned on; never the held-out "pydoc"
VARIANTS = ("keep", "rescale", "fixed_a", "fixed_2a")
RESCALE = 0.5                       # v's factor at the growth (the all-noise limit for x2)
OFFSETS = (0, 10, 50, 200, 500)     # updates after the growth the staleness table reads
FRESH_WINDOW = 50                   # updates of g^2 (since the growth) the fresh level is the mean of
STEP_WINDOWS = ((-9, 0), (1, 10), (41, 50), (191, 200))    # updates (inclusive) the step-size table averages
CALIBRATED = 1.1                    # v counts as recalibrated when its excess over fixed 2a's is at most this
NAME = "adam_moment"


# ------------------------------------------------------------------ the plan
def growth_update(task) -> int:
    """K: the update after which the batch doubles (about a third of the samples at the start batch)."""
    return int(round(task.budget / 3 / task.settings["start"]))


def variant_config(task, variant: str, growth: int) -> dict:
    """The `auto_batch._optimizer` / `make_ramp` config of `variant`."""
    s = task.settings
    a = s["start"] // s["micro"]
    if variant in ("keep", "rescale"):
        return {"kind": "ramp", "schedule": {0: a, growth: 2 * a}, "rescale": variant == "rescale"}
    if variant == "fixed_a":
        return {"kind": "fixed", "effective_batch": s["start"]}
    if variant == "fixed_2a":
        return {"kind": "fixed", "effective_batch": 2 * s["start"]}
    raise ValueError(f"variant must be one of {VARIANTS}; received {variant!r}")


def labels(settings: dict) -> dict:
    """The variants' names in the report."""
    a = settings["start"]
    return {"keep": f"keep ({a}→{2 * a})", "rescale": f"rescale v×½ ({a}→{2 * a})",
            "fixed_a": f"fixed {a}", "fixed_2a": f"fixed {2 * a}"}


# ------------------------------------------------------------------ the probe
def moment_pairs(optimizer, variables) -> tuple:
    """(inner Adam, [(m, v)] per variable): v from the library's seam, m by the optimizer variable's path."""
    from tfx_gradient_accumulator.accumulator.core import seam
    inner = seam.inner_optimizer(optimizer) or optimizer
    velocities = seam.adam_second_moments(inner)
    if velocities is None:
        raise TypeError(f"{type(inner).__name__} holds no Adam second moments")
    by_path = {v.path: v for v in inner.variables}
    pairs = []
    for variable in variables:
        v = velocities[seam.optimizer_variable_index(inner, variable)]
        if not v.path.endswith("_velocity"):
            raise ValueError(f"unexpected second-moment path {v.path!r}")
        pairs.append((by_path[v.path[:-len("velocity")] + "momentum"], v))
    return inner, pairs


def _probe_class():
    import keras
    import numpy as np

    class MomentProbe(keras.callbacks.Callback):
        """Reads Adam's m and v at every update from `growth` - 10 on; `rescale` multiplies v at the growth."""

        def __init__(self, growth, rescale=None, expect_accum=None):
            super().__init__()
            self.growth, self.rescale, self.expect_accum = growth, rescale, expect_accum

        def on_train_begin(self, logs=None):
            self.inner, self.pairs = self.model.optimizer.inner_optimizer, None     # built at the first update
            self.last, self.v_prev, self.v_growth = 0, None, None
            self.g2 = collections.deque(maxlen=FRESH_WINDOW)
            self.lr_prev = float(np.asarray(self.inner.learning_rate))
            self.out = {"offset": [], "ratio": [], "fresh": [], "step": [], "lr": []}

        def _read(self, which):
            return np.concatenate([np.asarray(p[which]).ravel() for p in self.pairs]).astype("float64")

        def on_train_batch_end(self, batch, logs=None):
            optimizer = self.model.optimizer
            t = int(optimizer.iterations.numpy())
            if optimizer.held_micro_batches or t == self.last:
                return
            self.last = t
            lr_used, self.lr_prev = self.lr_prev, float(np.asarray(self.inner.learning_rate))
            if t < self.growth - 10:
                return
            self._measure(t, lr_used, optimizer)

        def _measure(self, t, lr_used, optimizer):
            if self.pairs is None:
                self.inner, self.pairs = moment_pairs(optimizer, self.model.trainable_variables)
            b1, b2, eps = float(self.inner.beta_1), float(self.inner.beta_2), float(self.inner.epsilon)
            m, v = self._read(0), self._read(1)
            v_hat = v / (1 - b2 ** t)
            if t > self.growth:
                self.g2.append((v - b2 * self.v_prev) / (1 - b2))
            if t == self.growth:
                self.v_growth, self.mask = v_hat, v_hat > 0
            step = np.abs(m) * math.sqrt(1 - b2 ** t) / (1 - b1 ** t) / (np.sqrt(v) + eps)
            self._record(t - self.growth, v_hat, step, lr_used)
            self.v_prev = v
            if t == self.growth and self.rescale is not None:
                self._rescale(optimizer, b2)

        def _record(self, offset, v_hat, step, lr_used):
            out = self.out
            out["offset"].append(offset)
            out["step"].append(float(np.median(step)))
            out["lr"].append(lr_used)
            out["ratio"].append(float(np.median(v_hat[self.mask] / self.v_growth[self.mask]))
                                if self.v_growth is not None else None)
            fresh = None
            if self.g2:
                level = sum(self.g2) / len(self.g2)
                keep = self.mask & (level > 0)
                fresh = float(np.median(v_hat[keep] / level[keep]))
            out["fresh"].append(fresh)

        def _rescale(self, optimizer, b2):
            if optimizer.accum_steps != self.expect_accum:
                raise RuntimeError(f"the growth to accum_steps {self.expect_accum} did not happen at update "
                                   f"{self.growth} (accum_steps {optimizer.accum_steps})")
            for _, v in self.pairs:
                v.assign(v * self.rescale)
            self.v_prev = self._read(1)

    return MomentProbe


def thin(out: dict, last_offset: int) -> dict:
    """The probe's record kept at every update from -10 to +60 and in `STEP_WINDOWS`, every 10th after, and the last."""
    dense = [range(low, high + 1) for low, high in STEP_WINDOWS]
    keep = [i for i, o in enumerate(out["offset"])
            if o <= 60 or o % 10 == 0 or o == last_offset or any(o in r for r in dense)]
    return {key: [aba_round(values[i]) for i in keep] for key, values in out.items()}


def aba_round(value):
    """A float to 5 significant digits (the JSON stays small); ints and None unchanged."""
    if value is None or isinstance(value, int):
        return value
    return auto_batch._finite(value)


# ------------------------------------------------------------------ one run
def train_variant(task, seed: int, variant: str, growth: int) -> dict:
    """One run of `variant`: {"seed", "curve", "probe", "schedule", "seconds"}: `auto_batch.train`'s
    run of the variant's config, with the probe among its callbacks (its "probe" in place of the
    rule's "trace", which these fixed and ramped runs do not have)."""
    s = task.settings
    config = variant_config(task, variant, growth)
    probe = _probe_class()(growth, RESCALE if config.get("rescale") else None,
                           expect_accum=2 * s["start"] // s["micro"])
    run = auto_batch.train(task, seed, config, callbacks=[probe])
    return {"seed": run["seed"], "curve": run["curve"], "probe": thin(probe.out, probe.out["offset"][-1]),
            "schedule": run["schedule"], "seconds": run["seconds"]}


# ------------------------------------------------------------------ analysis (pure Python)
def final(run) -> float:
    """The run's final validation loss as auto_batch reads it (trailing mean of the last evaluations)."""
    return aba.final_loss(aba.smooth(run["curve"]))


def paired(results) -> tuple:
    """({variant: {seed: run}}, the seeds every variant ran)."""
    runs = {v: {r["seed"]: r for r in results["runs"].get(v, [])} for v in VARIANTS}
    seeds = sorted(set.intersection(*(set(r) for r in runs.values())))
    return runs, seeds


def at_offset(run, key, offset):
    """The probe's `key` at `offset` updates after the growth; None past the run's end."""
    probe = run["probe"]
    return probe[key][probe["offset"].index(offset)] if offset in probe["offset"] else None


def spread(values):
    """{"median", "min", "max"} of the values that are not None; None if none."""
    values = [v for v in values if v is not None]
    if not values:
        return None
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def staleness(runs, seeds, offsets=OFFSETS) -> dict:
    """Per offset: v_hat(t)/v_hat(K) of every variant, and keep's and rescale's excess over fixed 2a's
    v_hat/fresh-g^2 level (paired seeds), as {"median", "min", "max"}."""
    table = {}
    for offset in offsets:
        row = {v: spread([at_offset(runs[v][s], "ratio", offset) for s in seeds]) for v in VARIANTS}
        for v in ("keep", "rescale"):
            pairs = [(at_offset(runs[v][s], "fresh", offset), at_offset(runs["fixed_2a"][s], "fresh", offset))
                     for s in seeds]
            row[f"excess_{v}"] = spread([a / b if a is not None and b else None for a, b in pairs])
        table[str(offset)] = row
    return table


def excess_curve(runs, seeds, variant) -> tuple:
    """(offsets, median over seeds of `variant`'s fresh level / fixed 2a's) at every recorded offset > 0."""
    common = sorted(set.intersection(*(set(runs[v][s]["probe"]["offset"]) for v in (variant, "fixed_2a")
                                       for s in seeds)))
    xs, ys = [], []
    for offset in common:
        if offset <= 0:
            continue
        value = spread([at_offset(runs[variant][s], "fresh", offset) / at_offset(runs["fixed_2a"][s], "fresh", offset)
                        for s in seeds if at_offset(runs["fixed_2a"][s], "fresh", offset)])
        if value is not None:
            xs.append(offset)
            ys.append(value["median"])
    return xs, ys


def recalibrated_after(xs, ys, threshold=CALIBRATED):
    """The first offset from which the excess stays at or below `threshold`; None if it never does."""
    for i, x in enumerate(xs):
        if all(y <= threshold for y in ys[i:]):
            return x
    return None


def old_share(n: int, growth: int, beta2: float = 0.999) -> float:
    """The weight of the pre-growth g^2 in Adam's bias-corrected v_hat, `n` updates after the growth at `growth`."""
    t = growth + n
    return (beta2 ** n - beta2 ** t) / (1 - beta2 ** t)


def theory_excess(n: int, growth: int, beta2: float = 0.999) -> float:
    """A kept v_hat's excess over a calibrated one in the all-noise limit (the old g^2 twice the new)."""
    return 1 + old_share(n, growth, beta2)


def steps(runs, seeds, lr0: float) -> dict:
    """Per variant and window: the mean over its updates of median |update|/lr, and of |update|/lr0 (`lr0`
    the start batch's learning rate), as spreads over the seeds."""
    out = {}
    for v in VARIANTS:
        out[v] = {}
        for low, high in STEP_WINDOWS:
            per_lr, per_lr0 = [], []
            for s in seeds:
                probe = runs[v][s]["probe"]
                picks = [i for i, o in enumerate(probe["offset"]) if low <= o <= high]
                if picks:
                    per_lr.append(statistics.fmean(probe["step"][i] for i in picks))
                    per_lr0.append(statistics.fmean(probe["step"][i] * probe["lr"][i] / lr0 for i in picks))
            out[v][f"{low}..{high}"] = {"per_lr": spread(per_lr), "per_lr0": spread(per_lr0)}
    return out


def analyse(results) -> dict:
    """Every figure the report states."""
    runs, seeds = paired(results)
    finals = {v: [final(runs[v][s]) for s in seeds] for v in VARIANTS}
    differences = {f"{x} - {y}": aba.bootstrap_mean([a - b for a, b in zip(finals[x], finals[y])])
                   for x, y in (("rescale", "keep"), ("keep", "fixed_2a"), ("keep", "fixed_a"),
                                ("rescale", "fixed_2a"), ("fixed_2a", "fixed_a"))}
    curve_keep = excess_curve(runs, seeds, "keep")
    curve_rescale = excess_curve(runs, seeds, "rescale")
    growth = results["growth_update"]
    return {"seeds": seeds, "finals": {v: aba.spread(f) for v, f in finals.items()}, "differences": differences,
            "staleness": staleness(runs, seeds), "steps": steps(runs, seeds, results["settings"]["lr0"]),
            "excess_curves": {"keep": curve_keep, "rescale": curve_rescale},
            "recalibrated": {"keep": recalibrated_after(*curve_keep), "rescale": recalibrated_after(*curve_rescale)},
            "excess_end": {"offset": curve_keep[0][-1], "keep": curve_keep[1][-1], "rescale": curve_rescale[1][-1]},
            "last_offset": min(runs["keep"][s]["probe"]["offset"][-1] for s in seeds),
            "theory": {str(n): theory_excess(n, growth) for n in OFFSETS},
            "theory_recalibrated": next(n for n in range(100_000) if theory_excess(n, growth) <= CALIBRATED)}


# ------------------------------------------------------------------ the report
def _num(x, digits=3):
    return "–" if x is None else f"{x:,.{digits}f}"


def _spread(s, digits=3):
    """"median [min–max]" of a spread; "–" for None."""
    if s is None:
        return "–"
    return f"{_num(s['median'], digits)} [{_num(s['min'], digits)}–{_num(s['max'], digits)}]"


def _interval(d, digits=4):
    return f"{d['mean']:+.{digits}f} [{d['low']:+.{digits}f}, {d['high']:+.{digits}f}]"


def verdict(difference: dict) -> str:
    """Whether the 90% interval of rescale - keep excludes 0, in words."""
    if difference["low"] > 0:
        return "rescaling **raises** the final loss (the whole interval is above 0)"
    if difference["high"] < 0:
        return "rescaling **lowers** the final loss (the whole interval is below 0)"
    return "**no difference beyond the interval**: it contains 0"


def _header(results) -> list:
    s, code = results["settings"], results["code"]
    dirty = " (with uncommitted changes)" if code.get("dirty") else ""
    v = results["versions"]
    return [
        "## Adam's second moment at a batch growth: keep it or rescale it",
        "",
        f"Measured {results['date']} at commit `{(code.get('commit') or '?')[:10]}`{dirty} "
        f"(\"{code.get('subject')}\"), TensorFlow {v['tensorflow']}, Keras {v['keras']}, Python {v['python']}, "
        f"{results['cpus']} CPUs shared with other work (load {results['load_at_start']} at the start); "
        f"{results.get('wall_seconds', 0) / 60:.0f} minutes. `python -m benchmarks.adam_moment` re-runs it"
        + (" (**a --quick smoke run: 2 seeds, a fifth of the samples**)" if results["plan"]["quick"] else "") + ".",
        "",
        f"**Task**: the benchmark's `text` task (tuned on): {results['task']['description']}. "
        f"{results['task']['budget']:,} samples per run, micro-batch {s['micro']}, Adam (β₂ = {results['beta2']}), "
        f"lr {s['lr0']:g} at batch {s['start']}, `lr_scaling=\"{results['lr_scaling']}\"`.",
        "",
        f"**The growth**: `AccumulationSchedule({{0: {s['start'] // s['micro']}, {results['growth_update']}: "
        f"{2 * s['start'] // s['micro']}}}, by=\"update\", lr_scaling=\"{results['lr_scaling']}\", "
        f"lr_ramp_updates={results['lr_ramp_updates']})`: batch {s['start']} for {results['growth_update']} "
        f"updates (about a third of the samples), then {2 * s['start']}; the learning rate ramps linearly to "
        f"×√2 over {results['lr_ramp_updates']} updates. Variants, on the same {len(results['analysis']['seeds'])} "
        "seeds (initial weights and data order): **keep** (the library's behaviour: Adam's moments untouched), "
        f"**rescale** (at the growth every second moment v multiplied by {RESCALE:g}: the all-noise limit, "
        f"E[g²] = G² + σ²/B halving with B), **fixed {s['start']}** and **fixed {2 * s['start']}** (at its "
        "square-root learning rate) for the whole budget.",
        "",
    ]


def _finals_lines(results) -> list:
    a = results["analysis"]
    names = labels(results["settings"])
    lines = ["### Final validation loss", "",
             f"Loss per sequence ({results['task']['settings']['micro']} sequences a micro-batch), read as "
             "auto_batch reads it: the mean of the last 3 evaluations. Mean [min–max] over the seeds.", "",
             "| variant | final loss |", "|---|---|"]
    for v in VARIANTS:
        f = a["finals"][v]
        lines.append(f"| {names[v]} | {f['mean']:.4f} [{f['min']:.4f}–{f['max']:.4f}] |")
    lines += ["", f"Paired-seed differences: mean [bootstrap {aba.LEVEL:.0%} interval], and the seeds where the "
              "difference is positive.", "", "| difference | mean [interval] | seeds > 0 |", "|---|---|---|"]
    for key, d in a["differences"].items():
        x, y = key.split(" - ")
        lines.append(f"| {names[x]} − {names[y]} | {_interval(d)} | {d['positive']} of {d['n']} |")
    d = a["differences"]["rescale - keep"]
    lines += ["", f"**Rescale − keep**: {_interval(d)}: {verdict(d)}.", ""]
    return lines


def _staleness_lines(results) -> list:
    a, s = results["analysis"], results["settings"]
    names = labels(s)
    lines = ["### How stale the kept second moment is", "",
             "Per run, the median over the model's parameters; per cell, the median [min–max] over the seeds. "
             "**v̂(t)/v̂(K)**: Adam's bias-corrected second moment relative to its value at the growth (update "
             f"K = {results['growth_update']}, before the rescale; the fixed runs at the same update count are the calibrated "
             "reference: their change is the drift of E[g²] alone). **Excess**: v̂(t) over the mean g² of the "
             f"updates since the growth (the last {FRESH_WINDOW} at most; "
             "g_t² = (v_t − β₂ v_(t−1))/(1 − β₂), exact), "
             f"divided by the same figure of the fixed {2 * s['start']} run of the same seed: 1 when the kept v is "
             f"as calibrated as one that saw batch {2 * s['start']} all along. **All-noise arithmetic**: the "
             "excess a kept v̂ has when the old batch's g² was twice the new one's: 1 + the weight of the pre-growth "
             "updates in v̂.", "",
             f"| updates after the growth | v̂/v̂(K) {names['keep']} | {names['rescale']} | {names['fixed_2a']} | "
             f"{names['fixed_a']} | excess, keep | excess, rescale | all-noise arithmetic |",
             "|---|---|---|---|---|---|---|---|"]
    for offset, row in a["staleness"].items():
        if row["keep"] is None:
            lines.append(f"| +{offset} | past the run's end (+{a['last_offset']}) | | | | | | "
                         f"{a['theory'][offset]:.3f} |")
            continue
        lines.append(f"| +{offset} | {_spread(row['keep'])} | {_spread(row['rescale'])} | {_spread(row['fixed_2a'])} "
                     f"| {_spread(row['fixed_a'])} | {_spread(row['excess_keep'])} | {_spread(row['excess_rescale'])} "
                     f"| {a['theory'][offset]:.3f} |")
    lines += ["", _recalibration_sentence(results), "", _factor_sentence(results), ""]
    return lines


def _factor_sentence(results) -> str:
    """What the excess just after the growth says about the noise share, and the factor it implies."""
    row = results["analysis"]["staleness"]["10"]
    keep, rescale = row["excess_keep"]["median"], row["excess_rescale"]["median"]
    share = 2 * (1 - 1 / keep)          # (G² + s) / (G² + s/2) = keep  =>  s / (G² + s) = 2 (1 - 1/keep)
    return (f"**The ½ overshoots**: 10 updates after the growth the kept v is {keep:.2f}× a calibrated one, not 2×: "
            f"E[g²] at batch {results['settings']['start']} was {keep:.2f}× the new batch's, i.e. the noise was "
            f"~{share:.0%} of it, not all. The rescaled v starts {rescale:.2f}× a calibrated one (too small) and "
            "stays near that level through the run; a calibrated factor would have been "
            f"~{1 / keep:.2f} (not measured as a variant).")


def _recalibration_sentence(results) -> str:
    a, s = results["analysis"], results["settings"]
    after, end = a["recalibrated"]["keep"], a["excess_end"]
    measured = (f"the kept v's excess stays within {CALIBRATED:g}× from +{after} updates on" if after is not None
                else f"the kept v's excess never comes within {CALIBRATED:g}× while it can be measured")
    return (f"**Recalibration**: {measured} (up to +{end['offset']}, where the fixed {2 * s['start']} run ends; "
            f"there it is {end['keep']:.3f}, and the rescaled v's {end['rescale']:.3f}); by the all-noise "
            f"arithmetic (β₂ = {results['beta2']}) it would take {a['theory_recalibrated']:,} updates after the "
            f"growth, ~{a['theory_recalibrated'] / a['last_offset']:.1f}× the {a['last_offset']} this run has "
            "after it. The measured excess falls faster than that arithmetic, and starts lower.")


def _steps_lines(results) -> list:
    a = results["analysis"]
    names = labels(results["settings"])
    windows = [f"{low}..{high}" for low, high in STEP_WINDOWS]
    lines = ["### Step size around the growth", "",
             "Median over parameters of |update|/lr (= |m̂|/(√v̂ + ε), Keras' Adam step over the learning rate "
             "in force) and of |update|/lr₀ (lr₀ the start batch's learning rate: the ramp's multiplier "
             "included), averaged over the updates of each window (relative to the growth), median [min–max] "
             "over the seeds.", "",
             "| variant | " + " | ".join(f"/lr at {w}" for w in windows) + " | "
             + " | ".join(f"/lr₀ at {w}" for w in windows) + " |",
             "|---|" + "---|" * (2 * len(windows))]
    for v in VARIANTS:
        cells = [_spread(a["steps"][v][w]["per_lr"]) for w in windows]
        cells += [_spread(a["steps"][v][w]["per_lr0"]) for w in windows]
        lines.append(f"| {names[v]} | " + " | ".join(cells) + " |")
    return lines + ["", _steps_sentence(results), ""]


def _steps_sentence(results) -> str:
    """The kept and rescaled runs' normalized steps against the fixed 2a run's, in words."""
    st, names = results["analysis"]["steps"], labels(results["settings"])

    def rel(v, w, unit="per_lr"):
        mine, calibrated = st[v][w][unit], st["fixed_2a"][w][unit]
        return "–" if mine is None or calibrated is None else f"{mine['median'] / calibrated['median']:.2f}"

    return (f"Against {names['fixed_2a']} at the same updates (medians): the kept v makes the step over lr "
            f"{rel('keep', '1..10')}× after 1–10 updates, {rel('keep', '41..50')}× after 41–50 and "
            f"{rel('keep', '191..200')}× after 191–200 (once m has lost the old batch's noise, v's staleness "
            f"shows); the rescaled v {rel('rescale', '1..10')}×, {rel('rescale', '41..50')}× and "
            f"{rel('rescale', '191..200')}×. With the learning-rate ramp included (over lr₀), keep's step is "
            f"{rel('keep', '1..10', 'per_lr0')}× fixed {2 * results['settings']['start']}'s after 1–10 updates "
            f"and {rel('keep', '191..200', 'per_lr0')}× after 191–200; rescale's "
            f"{rel('rescale', '41..50', 'per_lr0')}× after 41–50.")


def _recommendation(results) -> list:
    a = results["analysis"]
    d = a["differences"]["rescale - keep"]
    if d["high"] < 0:
        choice = "**rescale**: it lowers the final loss beyond the interval"
    else:
        choice = ("**keep** (the library's behaviour): rescaling " +
                  ("raises the final loss" if d["low"] > 0 else "does not change the final loss beyond the interval")
                  + f" ({_interval(d)}, {d['positive']} of {d['n']} seeds worse), and keeping needs no assumption "
                  "about how much of E[g²] is noise: the ½ is right only when G² ≪ σ²/B; here it overshot, "
                  "and the rescaled run took steps larger than a run calibrated to the new batch all along")
    d_fixed = a["differences"]["keep - fixed_2a"]
    return ["### Verdict", "",
            f"Recommendation: {choice}. The kept v acts as a temporary learning-rate cut that fades over a few "
            "hundred updates (the step table), on top of the ramp; on this task the smaller steps pay (keep − "
            f"fixed {2 * results['settings']['start']}: {_interval(d_fixed)}). Limits: one task (tuned on), one "
            "growth ×2, the square-root rule with a constant learning rate; where the noise share is known (the "
            "library measures the noise scale), a factor from it, not ½, would be the variant to try.", ""]


def write(results, folder) -> str:
    """adam_moment.md and .png from the results (with their analysis); the markdown's path."""
    lines = (_header(results) + _finals_lines(results) + _staleness_lines(results) + _steps_lines(results)
             + _recommendation(results) + [f"![Adam's second moment at a growth]({NAME}.png)", ""])
    path = os.path.join(folder, f"{NAME}.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    plot(results, folder)
    return path


def _median_curve(runs, seeds, variant, key):
    """(offsets, median over seeds of the probe's `key`) over the offsets every seed recorded."""
    common = sorted(set.intersection(*(set(runs[variant][s]["probe"]["offset"]) for s in seeds)))
    pairs = [(o, spread([at_offset(runs[variant][s], key, o) for s in seeds])) for o in common]
    return [o for o, v in pairs if v is not None], [v["median"] for _, v in pairs if v is not None]


def plot(results, folder):
    """adam_moment.png: v̂/v̂(K) and the excess after the growth, and the loss curves."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs, seeds = paired(results)
    a, names, growth = results["analysis"], labels(results["settings"]), results["growth_update"]
    colours = {"keep": "tab:blue", "rescale": "tab:red", "fixed_a": "tab:gray", "fixed_2a": "tab:green"}
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for v in VARIANTS:
        axes[0].plot(*_median_curve(runs, seeds, v, "ratio"), label=names[v], color=colours[v])
    axes[0].set(xlabel="updates after the growth", ylabel="median v̂(t) / v̂(K)", title="Adam's v̂ after the growth")
    for v in ("keep", "rescale"):
        axes[1].plot(*a["excess_curves"][v], label=names[v], color=colours[v])
    xs = a["excess_curves"]["keep"][0]
    axes[1].plot(xs, [theory_excess(n, growth, results["beta2"]) for n in xs], "--", color="black",
                 label="all-noise arithmetic (keep)")
    axes[1].axhline(1.0, color=colours["fixed_2a"], lw=0.8)
    axes[1].set(xlabel="updates after the growth", ylabel=f"excess over {names['fixed_2a']}",
                title="v̂ over the fresh g² level, ÷ fixed 2a's")
    for v in VARIANTS:
        curves = [aba.smooth(runs[v][s]["curve"]) for s in seeds]
        mean = aba.mean_curve(curves)
        axes[2].plot([p["samples"] for p in mean], [p["val_loss"] for p in mean], label=names[v], color=colours[v])
    axes[2].axvline(growth * results["settings"]["start"], color="black", lw=0.8, ls=":")
    finals = [a["finals"][v]["mean"] for v in VARIANTS]
    axes[2].set_ylim(min(finals) - 0.05, max(finals) + 0.4)
    axes[2].set(xlabel="samples", ylabel="validation loss (seed mean, trailing 3)", title="loss (growth dotted)")
    for ax in axes:
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, f"{NAME}.png"), dpi=80)
    plt.close(fig)


# ------------------------------------------------------------------ main
def plan() -> dict:
    """What decides the runs' figures; --resume refuses a JSON of another plan."""
    return {"quick": auto_batch.QUICK.value, "seeds": len(auto_batch._seeds()), "evals": auto_batch.EVALS.value,
            "task": TASK, "variants": list(VARIANTS), "rescale": RESCALE}


def _start(path, task) -> dict:
    import keras
    import tensorflow as tf
    if auto_batch.RESUME.value and os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
        if results.get("plan") != json.loads(json.dumps(plan())):
            raise app.UsageError(f"--resume: {path} is of another plan; run without --resume to start over")
        return results
    return {"date": datetime.date.today().isoformat(), "plan": plan(), "code": auto_batch._commit(),
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                         "python": platform.python_version()},
            "cpus": os.cpu_count(), "load_at_start": [round(v, 2) for v in os.getloadavg()],
            "settings": task.settings, "task": task.record(), "growth_update": growth_update(task),
            "lr_scaling": auto_batch.LR_SCALING, "lr_ramp_updates": auto_batch.make_ramp({0: 1}).lr_ramp_updates,
            "beta2": float(keras.optimizers.Adam().beta_2), "runs": {v: [] for v in VARIANTS}}


def measure(path) -> dict:
    """Every (seed, variant) run not in the results yet, seed-major, saved after each."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    task = auto_batch.make_task(TASK)
    results = _start(path, task)
    started = time.perf_counter()
    todo = [(seed, v) for seed in auto_batch._seeds() for v in VARIANTS
            if seed not in {r["seed"] for r in results["runs"][v]}]
    logging.info("%s: %d samples per run, growth at update %d; %d runs to do", TASK, task.budget,
                 results["growth_update"], len(todo))
    for i, (seed, variant) in enumerate(todo):
        run = train_variant(task, seed, variant, results["growth_update"])
        results["runs"][variant] = sorted(results["runs"][variant] + [run], key=lambda r: r["seed"])
        auto_batch._save(results, path)
        logging.info("[%d/%d] %-8s seed %d: final loss %.4f (%.0f s)", i + 1, len(todo), variant, seed,
                     final(run), run["seconds"])
    results["load_at_end"] = [round(v, 2) for v in os.getloadavg()]
    results["wall_seconds"] = round(results.get("wall_seconds", 0) + time.perf_counter() - started, 1)
    return results


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    out = auto_batch.OUT.value
    folder = out if os.path.isabs(out) else os.path.join(ROOT, out)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"{NAME}.json")
    if auto_batch.REPORT_ONLY.value:
        with open(path) as f:
            results = json.load(f)
    else:
        results = measure(path)
    results["analysis"] = analyse(results)
    auto_batch._save(results, path)
    logging.info("wrote %s", write(results, folder))


if __name__ == "__main__":
    app.run(main)
