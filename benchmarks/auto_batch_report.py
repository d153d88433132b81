"""auto_batch.md and its plots, written from auto_batch.json (no TensorFlow).

The figures come from `auto_batch_analysis`; this module words and draws them.
`write` returns the summary that `benchmarks/run.py` keeps in results.json and
`report.py` shows in results.md.
"""

import math
import os
import statistics

from benchmarks import auto_batch_analysis as aba
from benchmarks import stats

TITLES = {"digits": "Digits CNN (tuned on)", "text": "Causal language model on synthetic text (tuned on)",
          "pydoc": "Byte-level language model on the Python language reference (held out)"}
GOAL_NAMES = {"reach": "reaches the target", "updates": "updates ≤ 0.75× the peer's",
              "samples": "samples ≤ 1.10× the peer's", "pareto": "no fixed configuration needs fewer of both"}
FRACTIONS = (0.1, 0.25, 0.5, 0.75, 1.0)
TRACE_KEYS = (("noise_scale", "B_simple, raw"), ("noise_scale_preconditioned", "B_simple, preconditioned"),
              ("noise_scale_lower", "the gate's lower bound"), ("target_effective_batch_size", "target batch"),
              ("effective_batch", "batch taken"))


def _paired(entries):
    """{label: [curve]} over the seeds every configuration has (a cut run: its whole seeds)."""
    common = set.intersection(*({r["seed"] for r in e["runs"]} for e in entries.values()))
    return {label: [r["curve"] for r in e["runs"] if r["seed"] in common] for label, e in entries.items()}, sorted(common)


def analyse(task):
    """`aba.analyse` of one task's results, over the seeds every configuration ran."""
    runs = {label: e for label, e in task["runs"].items() if e["runs"]}
    curves, seeds = _paired(runs)
    out = aba.analyse(curves, {label: e["kind"] for label, e in runs.items()})
    out["seeds"] = seeds
    return out


# ------------------------------------------------------------------ words
def _num(x, digits=2):
    if x is None:
        return "–"
    if math.isinf(x):
        return "∞"
    return f"{x:,.{digits}f}"


def _ratio(figures):
    """"point [low–high]" of a ratio interval."""
    if "point" not in figures:
        return figures.get("why", "–")
    return f"{_num(figures['point'])}× [{_num(figures['low'])}–{_num(figures['high'])}]"


def _met(met):
    return "**met**" if met else "**missed**"


def goal_figure(goal, figures):
    """The figure a goal is judged on, in words."""
    if goal == "reach":
        return f"{figures['reached']} of {figures['seeds']} seeds (≥ {figures['needed']} needed)"
    if goal in ("updates", "samples"):
        if "point" not in figures:
            return figures.get("why", "")
        return (f"{_ratio(figures)} {figures['peer']}; upper bound {_num(figures['high'])} against "
                f"{figures['limit']:.2f}")
    if figures["met"]:
        return "every fixed configuration excluded (on one axis, the upper bound of auto / it ≤ 1)"
    return ("not excluded: " + ", ".join(figures["not_excluded"])
            + (f"; on the mean curves, dominated by {', '.join(figures['dominated_by'])}" if figures["dominated_by"] else ""))


def _goal_lines(goals, per_seed, seeds, who="auto"):
    lines = []
    for goal in aba.GOALS:
        lines.append(f"- **{who}: {GOAL_NAMES[goal]}**: {_met(goals[goal]['met'])}: {goal_figure(goal, goals[goal])}"
                     + (f" (seed by seed: holds on {per_seed[goal]} of {seeds})" if per_seed else "") + ".")
    return lines


def _median_of(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _rule_labels(task, a):
    """The runs of the rule: "auto", then each re-run at a later commit (`a["revised"]`)."""
    first = ["auto"] if task["runs"].get("auto", {}).get("runs") else []
    return first + list(a.get("revised", {}))


def _trace_rows(label, traces, keys, budget):
    """One row per key logged along `traces` (medians over seeds at each share of the samples)."""
    rows = []
    for key, name in keys:
        values = aba.along(traces, key, FRACTIONS, budget)
        if any(v is not None for v in values):
            rows.append(f"| {label}: {name} | " + " | ".join(_num(v, 0) for v in values) + " |")
    return rows


def _phi_table(task, a):
    """The rule's logs along its runs (medians over seeds), and the noise scale of fixed 32 ×1."""
    budget = task["budget"]
    header = "| along the run (share of the samples) | " + " | ".join(f"{f:.0%}" for f in FRACTIONS) + " |"
    lines = [header, "|---|" + "---|" * len(FRACTIONS)]
    for label in _rule_labels(task, a):
        traces = [r.get("trace") or r["curve"] for r in task["runs"][label]["runs"]]
        # A re-run's raw noise scale is the first run's (the same windows): its other logs only.
        lines += _trace_rows(label, traces, TRACE_KEYS if label == "auto" else TRACE_KEYS[1:], budget)
    small = f"fixed {task['settings']['start']} ×1"
    if small in task["runs"]:
        lines += _trace_rows(small, [r["curve"] for r in task["runs"][small]["runs"]], TRACE_KEYS[:2], budget)
    return lines + ["", "Noise scales and batches in samples (medians over seeds of the last value logged by "
                    "then; the rule's logs at window boundaries)." if len(lines) > 2 else ""]


def _hindsight_lines(a):
    judged = a["hindsight"]
    order = sorted(judged, key=lambda label: aba._score(judged[label]))
    best = a["best_in_hindsight"]
    lines = [f"**The best schedule in hindsight** (of the {len(judged)} others, judged as auto is): **{best}**, "
             f"{sum(judged[best][g]['met'] for g in aba.GOALS)} of 4 goals met.", "",
             "| schedule | reaches | updates / peer's | samples / peer's | not excluded by | goals met |",
             "|---|---|---|---|---|---|"]
    for label in order[:8]:
        g = judged[label]
        lines.append(f"| {label} | {g['reach']['reached']} of {g['reach']['seeds']} | {_ratio(g['updates'])} | "
                     f"{_ratio(g['samples'])} | {', '.join(g['pareto']['not_excluded']) or '–'} | "
                     f"{sum(g[k]['met'] for k in aba.GOALS)} |")
    return lines + ["", f"(The {min(8, len(order))} best of {len(order)}; ratios: of the needs of the mean "
                    f"curves, against the peer, {a['peer']}, with the 90% interval.)", ""]


def _config_table(task, a):
    s = task["settings"]
    lines = ["| configuration | learning rate | final loss, mean [min–max] | samples to the target | "
             "updates to the target | seeds that reach it | updates in all |", "|---|---|---|---|---|---|---|"]
    for label, entry in task["runs"].items():
        if label not in a["needs"]:
            continue
        final = a["final"][label]
        total = _median_of([r["curve"][-1]["updates"] for r in entry["runs"] if r["seed"] in a["seeds"]])
        lr = f"{entry['lr']:.2g}" + (" → 0" if entry.get("decay") else "") if entry.get("lr") else "–"
        if entry["kind"] != "fixed" and entry.get("lr"):
            lr += f" at {s['start']}, then sqrt"
        lines.append(f"| {label} | {lr} | {final['mean']:.4f} [{final['min']:.4f}–{final['max']:.4f}] | "
                     f"{_num(a['crossings'][label][0], 0)} | {_num(a['crossings'][label][1], 0)} | "
                     f"{a['reached'][label]} of {len(a['seeds'])} | {_num(total, 0)} |")
    return lines + ["", "Samples and updates to the target: where the configuration's seed-mean curve first "
                    "reaches it (∞: never); seeds that reach it: its own runs, each at the same target; every "
                    f"loss read from the trailing mean of {aba.SMOOTHING} evaluations.", ""]


def _start_lines(task, a):
    """The rule against the configuration it starts as (its smallest batch at the same learning rate):
    what growing changed, seed by seed, whatever the target."""
    start = f"fixed {task['settings']['start']} ×1"
    if start not in task["runs"]:
        return []
    lines = []
    for label in _rule_labels(task, a):
        mine = {r["seed"]: r for r in task["runs"][label]["runs"] if r["seed"] in a["seeds"]}
        theirs = {r["seed"]: r for r in task["runs"][start]["runs"] if r["seed"] in mine}
        seeds = sorted(theirs)
        if len(seeds) < 2:
            continue
        final = [aba.final_loss(aba.smooth(mine[s]["curve"])) for s in seeds]
        base = [aba.final_loss(aba.smooth(theirs[s]["curve"])) for s in seeds]
        d = aba.paired_difference(final, base)
        updates = statistics.median(mine[s]["curve"][-1]["updates"] / theirs[s]["curve"][-1]["updates"]
                                    for s in seeds)
        lines.append(f"**{label} against {start}** (where it starts, the same learning rate; {len(seeds)} "
                     f"paired seeds): final loss {d['mean']:+.4f} [{d['low']:+.4f} to {d['high']:+.4f}] "
                     f"(90% interval of the mean paired difference), with {updates:.2f}× the updates (median).")
        lines.append("")
    return lines


def _task_section(name, task, a):
    s = task["settings"]
    lines = [f"## {TITLES.get(name, name)}", "",
             f"{task['description'][0].upper()}{task['description'][1:]}. Every run: {task['budget']:,} samples "
             f"({task['budget'] / task['train_size']:.2f} passes over {task['train_size']:,}), micro-batch "
             f"{s['micro']}, Adam, lr(E) = {s['lr0']:g} × sqrt(E / {s['start']}); effective batches "
             f"{s['start']} to {s['max']}; {len(a['seeds'])} paired seeds.", "",
             f"**Target**: {a['target']:.4f}, the mean final validation loss of **{a['target_from']}**, the lowest of "
             f"the fixed configurations'. **Peer** (the most sample-efficient fixed configuration): "
             f"**{a['peer']}**.", ""]
    if "goals" in a:
        lines += _goal_lines(a["goals"], a["per_seed"], len(a["seeds"])) + [""]
    for label, judged in a.get("revised", {}).items():
        code = task["runs"][label].get("code", {})
        lines += [f"**{label}**: the rule re-run at commit `{(code.get('commit') or '?')[:10]}` "
                  f"(\"{code.get('subject') or '?'}\"), after the runs above; the same seeds, judged the same way:", ""]
        lines += _goal_lines(judged["goals"], judged["per_seed"], len(a["seeds"]), who=label) + [""]
    lines += _start_lines(task, a)
    lines += _hindsight_lines(a)
    lines += _phi_table(task, a) + [""]
    lines += _config_table(task, a)
    for label in _rule_labels(task, a):
        lines += [f"{label}'s decisions (update: accum_steps), seed by seed: "
                  + "; ".join(str(r["schedule"]) for r in task["runs"][label]["runs"]) + ".", ""]
    return lines


def _header(results):
    code = results.get("code", {})
    settings = results["settings"]
    passed = ("start_accum_steps", "lr_scaling", "epoch_end")      # set by the benchmark, or not a setting
    defaults = ", ".join(f"{k}={v!r}" for k, v in results.get("rule_defaults", {}).items() if k not in passed)
    return ["# AutoAccumulation against fixed effective batches", "",
            f"{results['date']}; TensorFlow {results['versions']['tensorflow']}, Keras {results['versions']['keras']}, "
            f"Python {results['versions']['python']}; {results['cpus']} CPU cores (1-minute load "
            f"{results['load_at_start'][0]} at the start, {results.get('load_at_end', ['?'])[0]} at the end); "
            f"{results.get('wall_seconds', 0) / 60:.0f} minutes"
            + (f" (resumed {len(results['resumed'])}×)" if results.get("resumed") else "") + "."
            + (" **A smoke run (--quick): too short to read.**" if settings.get("quick") else ""), "",
            f"Library at commit `{(code.get('commit') or '?')[:10]}` (\"{code.get('subject') or '?'}\")"
            + (", **with uncommitted changes**" if code.get("dirty") else "")
            + f". AutoAccumulation's defaults there: {defaults}. auto runs at them, from the smallest batch "
            f"(`start_accum_steps`) with `lr_scaling=\"{settings.get('lr_scaling', 'sqrt')}\"`.", "",
            "The tasks, the configurations and the rules below were fixed before any run in "
            "`benchmarks/auto_batch_tasks.md`. Per task, every fixed effective batch at ×½, ×1, ×2 the square-root "
            "rule's learning rate and at ×1 with cosine decay to 0; auto; two hand ramps. Seed s gives every "
            "configuration the same initial weights and data order.", "",
            "**How it is judged.** Per configuration, the seed-mean validation curve. Target: the lowest final "
            "loss of the fixed configurations' mean curves. The samples and updates a configuration needs: where "
            "its mean curve first reaches the target (linear between evaluations; ∞ if never). Paired-seed "
            f"bootstrap ({aba.RESAMPLES:,} draws of the seeds, the same draw for every configuration, the target "
            "and the peer chosen again in each), 90% intervals of the ratios; each goal judged on the bound that "
            "leans against auto: its own runs reach the target on ≥ 9 of 10 seeds; the upper bound of its updates "
            "over the peer's (the most sample-efficient fixed configuration) ≤ 0.75; of its samples ≤ 1.10; "
            "against every fixed configuration, the upper bound ≤ 1 in samples or in updates.", ""]


def _summary_table(analyses, results):
    lines = ["| task | " + " | ".join(GOAL_NAMES[g] for g in aba.GOALS) + " | best in hindsight |",
             "|---|" + "---|" * (len(aba.GOALS) + 1)]
    for name, a in analyses.items():
        if "goals" not in a:
            continue
        held = " (held out)" if results["tasks"][name].get("held_out") else ""
        cells = []
        for goal in aba.GOALS:
            g = a["goals"][goal]
            figure = (f"{g['reached']}/{g['seeds']}" if goal == "reach" else
                      f"≤ {_num(g['high'])}×" if "high" in g else
                      ("–" if g["met"] else ", ".join(g.get("not_excluded", [])) or g.get("why", "")))
            cells.append(f"{_met(g['met'])} ({figure})")
        best = a["best_in_hindsight"]
        met = sum(a["hindsight"][best][g]["met"] for g in aba.GOALS)
        lines.append(f"| {name}{held} | " + " | ".join(cells) + f" | {best} ({met} of 4) |")
    return lines + [""]


def _tuner_section(tuner):
    trials = tuner["trials"]
    best = min(trials, key=lambda t: t["final_val_loss"])
    lines = ["## One auto run against a KerasTuner search", "",
             f"{TITLES.get(tuner['task'], tuner['task'])}, seed {tuner['seed']}: `keras_tuner.GridSearch` over the "
             f"fixed effective batch ({', '.join(map(str, tuner['grid']))}, each at lr(E); objective: final "
             "validation loss), each trial a full run, against one AutoAccumulation run of the same length. Final "
             f"validation loss: the trailing mean of the last {aba.SMOOTHING} evaluations.", "",
             "| | samples trained | final validation loss |", "|---|---|---|"]
    for t in trials:
        lines.append(f"| trial: fixed {t['effective_batch']} | {t['samples']:,} | {t['final_val_loss']:.4f} |")
    lines += [f"| **search, in all** (best: {best['effective_batch']}) | **{tuner['search_samples']:,}** | "
              f"**{best['final_val_loss']:.4f}** |",
              f"| **auto, one run** | **{tuner['auto']['samples']:,}** | **{tuner['auto']['final_val_loss']:.4f}** |",
              "", f"The search trains {tuner['search_samples'] / tuner['auto']['samples']:.1f}× the samples of the "
              f"auto run; auto's final validation loss is {tuner['auto']['final_val_loss'] - best['final_val_loss']:+.4f} "
              "against the search's best (one seed: read it against the spread over seeds above).", ""]
    return lines


def goodput(g):
    """Per accum_steps: seconds per sample and per update, and per-round ratios against accum_steps=1."""
    samples_per_cell = g["micro_steps_per_cell"] * g["micro_per_worker"] * g["workers"]
    per_sample = {int(n): [t / samples_per_cell for t in v] for n, v in g["seconds"].items()}
    per_update = {int(n): [t / (g["micro_steps_per_cell"] / int(n)) for t in v] for n, v in g["seconds"].items()}
    ratios = {n: stats.ratio_summary(per_sample[n], per_sample[1]) for n in per_sample if 1 in per_sample}
    model = aba.goodput_model({n: stats.summary(v)["median"] for n, v in per_update.items()})
    per_round = aba.goodput_rounds(per_update)
    model["by_round"] = {key: stats.summary(values) for key, values in per_round.items()}
    return per_sample, per_update, ratios, model


def _goodput_section(g):
    per_sample, per_update, ratios, model = goodput(g)
    global_micro = g["micro_per_worker"] * g["workers"]
    lines = ["## Why updates cost time: the goodput model", "",
             (f"Measured {g['date']} (it times the window, not the rule). " if g.get("date") else "") +
             f"{g['workers']} worker processes on one machine (127.0.0.1, MultiWorkerMirroredStrategy, one CPU thread "
             f"each), the text model at width {g['width']} ({g['params']:,} parameters), a custom `strategy.run` "
             f"loop with `GradientAccumulator(accum_steps=N)`, micro-batch {g['micro_per_worker']} per worker "
             f"({global_micro} global): one all-reduce per update. {g['micro_steps_per_cell']} micro-steps per "
             f"cell, {g['rounds']} interleaved rounds (the order reversed every other round); ratios per round "
             "against N = 1 of the same round, median [min–max].", "",
             "| N | ms per sample | ms per update | time per sample / N = 1 |", "|---|---|---|---|"]
    for n in sorted(per_sample):
        lines.append(f"| {n} | {stats.fmt(stats.summary(per_sample[n]), 3, 1e3)} | "
                     f"{stats.fmt(stats.summary(per_update[n]), 2, 1e3)} | {stats.fmt(ratios[n], 3)} |")
    by_round = model["by_round"]
    lines += ["", f"Fitted over N (least squares on the medians): **time per update = N × t_micro + t_update**, "
              f"t_micro = {model['t_micro'] * 1e3:.2f} ms (one micro-step of {global_micro} samples), "
              f"t_update = {model['t_update'] * 1e3:.2f} ms (what an update adds: the all-reduce of the "
              "gradients and the inner optimizer's step). Fitted round by round instead: t_micro "
              f"{stats.fmt(by_round['t_micro'], 2, 1e3)} ms, t_update {stats.fmt(by_round['t_update'], 2, 1e3)} ms "
              "(median [min–max] over the rounds: the spread of the fit). So a run that needs U updates of N "
              "micro-steps takes U × (N × t_micro + t_update): at the same samples, fewer, larger updates save "
              "U × t_update. "
              + (f"Here an update costs as much as {model['t_update'] / model['t_micro']:.1f} micro-steps"
                 if model["t_update"] > 0 and model["t_micro"] > 0 else
                 "Here the fit does not resolve a positive t_update (the rounds' spread is larger than it)")
              + "; on a cluster the all-reduce crosses a network, and its share grows with the model's size.", "",
              "![goodput](auto_batch_goodput.png)", ""]
    return lines


def _finite(x):
    """x, or None where it is not finite (results.json is strict JSON)."""
    return x if x is not None and math.isfinite(x) else None


def _summary(name, task, a):
    """One task's verdicts for results.json (the keys `report.py` reads: verdicts, per_seed, seeds)."""
    verdicts = {}
    for goal in aba.GOALS:
        g = a["goals"][goal]
        v = {"met": bool(g["met"])}
        if goal == "reach":
            v["why"] = f"{g['reached']} of {g['seeds']} seeds"
        elif "high" in g:
            v.update({"ratio": _finite(g["high"]), "point": _finite(g["point"]), "peer": g["peer"]})
        elif goal == "pareto":
            v["dominated_by"] = g["not_excluded"]
        else:
            v["why"] = g.get("why", "")
        verdicts[goal] = v
    return {"held_out": bool(task.get("held_out")), "target": a["target"], "target_from": a["target_from"],
            "peer": a["peer"], "verdicts": verdicts, "per_seed": a["per_seed"], "seeds": len(a["seeds"]),
            "best_in_hindsight": a["best_in_hindsight"],
            "revised": {label: {goal: bool(j["goals"][goal]["met"]) for goal in aba.GOALS}
                        for label, j in a.get("revised", {}).items()}}


def write(results, folder):
    """Writes auto_batch.md and the plots; returns the summary (verdicts per task)."""
    analyses = {name: analyse(task) for name, task in results["tasks"].items()
                if any(e["runs"] for e in task["runs"].values())}      # a cut run: tasks not started yet
    lines = _header(results)
    if results.get("reading"):
        lines += ["## Reading", ""] + [p for paragraph in results["reading"] for p in (paragraph, "")]
    lines += ["## Verdicts", ""] + _summary_table(analyses, results)
    summary = {}
    for name, a in analyses.items():
        lines += _task_section(name, results["tasks"][name], a)
        if "goals" in a:
            summary[name] = _summary(name, results["tasks"][name], a)
    lines += ["![validation loss against samples and updates, and the rule's noise scales and batches]"
              "(auto_batch.png)", ""]
    if results.get("tuner"):
        lines += _tuner_section(results["tuner"])
        summary["tuner"] = {"search_samples": results["tuner"]["search_samples"],
                            "auto_samples": results["tuner"]["auto"]["samples"],
                            "search_best": min(t["final_val_loss"] for t in results["tuner"]["trials"]),
                            "auto_final": results["tuner"]["auto"]["final_val_loss"]}
    if results.get("goodput"):
        lines += _goodput_section(results["goodput"])
        _, _, ratios, model = goodput(results["goodput"])
        summary["goodput"] = {"ratios": {str(n): r["median"] for n, r in ratios.items()},
                              "t_micro": model["t_micro"], "t_update": model["t_update"],
                              "t_update_by_round": model["by_round"]["t_update"]}
    with open(os.path.join(folder, "auto_batch.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    _draw(results, analyses, folder)
    return summary


# ------------------------------------------------------------------ plots
STYLES = {0.5: ":", 1.0: "-", 2.0: "-."}


def _mean_curve(runs, key):
    """(x, loss) of the seed-mean curve (of the smoothed curves), as the analysis reads it."""
    curve = aba.mean_curve([aba.smooth(r["curve"]) for r in runs])
    return [p[key] for p in curve], [p["val_loss"] for p in curve]


def _style(label, entry, batches):
    """(color, linestyle, width, alpha) of a configuration's line."""
    import matplotlib.pyplot as plt
    if entry["kind"] == "fixed":
        color = plt.cm.viridis(batches.index(entry["effective_batch"]) / max(1, len(batches) - 1) * 0.9)
        return color, "--" if entry.get("decay") else STYLES.get(entry.get("lr_factor", 1.0), "-"), 1.0, 0.75
    if entry["kind"] == "auto":
        return ("k", "-", 2.4, 1.0) if label == "auto" else ("tab:red", "-", 2.0, 0.9)
    return ("tab:pink" if label == "ramp" else "tab:purple"), "-", 1.6, 0.9


def _draw_losses(ax_samples, ax_updates, task, a):
    entries = {label: e for label, e in task["runs"].items() if e["runs"]}
    batches = sorted({e["effective_batch"] for e in entries.values() if e["kind"] == "fixed"})
    for label, entry in entries.items():
        runs = [r for r in entry["runs"] if r["seed"] in a["seeds"]]
        color, ls, width, alpha = _style(label, entry, batches)
        for ax, key in ((ax_samples, "samples"), (ax_updates, "updates")):
            xs, ys = _mean_curve(runs, key)
            ax.plot([max(x, 1) for x in xs] if key == "updates" else xs, ys, color=color, ls=ls, lw=width,
                    alpha=alpha, label=label)
            if label == "auto":
                for r in runs:
                    c = aba.smooth(r["curve"])
                    ax.plot([max(p[key], 1) if key == "updates" else p[key] for p in c],
                            [p["val_loss"] for p in c], color="k", lw=0.5, alpha=0.25)
    smoothed = [aba.smooth(r["curve"]) for e in entries.values() for r in e["runs"]]
    low = min(p["val_loss"] for c in smoothed for p in c if math.isfinite(p["val_loss"]))
    high = max(c[0]["val_loss"] for c in smoothed)
    for ax in (ax_samples, ax_updates):
        ax.axhline(a["target"], color="grey", ls="--", lw=1)
        ax.set(yscale="log", ylim=(low * 0.95, high * 1.05),
               ylabel=f"validation loss (mean over seeds; trailing mean of {aba.SMOOTHING})")
        ax.grid(alpha=0.3)


def _draw_trace(ax, task):
    colors = {"noise_scale": "tab:blue", "noise_scale_preconditioned": "tab:orange", "noise_scale_lower": "tab:green",
              "target_effective_batch_size": "tab:red", "effective_batch": "k"}
    for j, run in enumerate(task["runs"].get("auto", {}).get("runs", [])):
        trace = run.get("trace") or run["curve"]
        for key, name in TRACE_KEYS:
            points = [(p["samples"], p[key]) for p in trace if p.get(key) is not None and p[key] > 0]
            if points:
                ax.plot(*zip(*points), color=colors[key], lw=1.4 if key == "effective_batch" else 0.8, alpha=0.6,
                        drawstyle="steps-post" if key in ("effective_batch", "target_effective_batch_size") else None,
                        ls="--" if key == "target_effective_batch_size" else "-", label=name if j == 0 else None)
    ax.set(yscale="log", xlabel="samples", ylabel="samples (log)",
           title="auto, every seed: noise scales, bound, target, batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def _draw(results, analyses, folder):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(analyses)
    fig, axes = plt.subplots(len(tasks), 3, figsize=(18, 5 * len(tasks)), squeeze=False)
    for row, name in enumerate(tasks):
        task, a = results["tasks"][name], analyses[name]
        _draw_losses(axes[row][0], axes[row][1], task, a)
        axes[row][0].set(title=f"{TITLES.get(name, name)}: against samples", xlabel="samples")
        axes[row][1].set(title=f"against updates (target: {a['target_from']})", xlabel="updates (log)", xscale="log")
        axes[row][0].legend(fontsize=6, ncol=2)
        _draw_trace(axes[row][2], task)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "auto_batch.png"), dpi=80)
    plt.close(fig)
    if results.get("goodput"):
        _draw_goodput(results["goodput"], folder, plt)


def _draw_goodput(g, folder, plt):
    per_sample, per_update, ratios, model = goodput(g)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ns = sorted(ratios)
    axes[0].errorbar(ns, [ratios[n]["median"] for n in ns],
                     yerr=[[ratios[n]["median"] - ratios[n]["min"] for n in ns],
                           [ratios[n]["max"] - ratios[n]["median"] for n in ns]], marker="o", capsize=3)
    axes[0].set(xscale="log", xticks=ns, title="time per sample / accum_steps=1 (per round)",
                xlabel="accum_steps N (micro-steps per update)", ylabel="ratio (median, min–max)")
    axes[0].set_xticklabels(ns)
    axes[0].grid(alpha=0.3)
    medians = [stats.summary(per_update[n])["median"] * 1e3 for n in ns]
    axes[1].plot(ns, medians, "o", label="measured (median)")
    axes[1].plot(ns, [(n * model["t_micro"] + model["t_update"]) * 1e3 for n in ns], "-",
                 label=f"N × {model['t_micro'] * 1e3:.2f} + {model['t_update'] * 1e3:.2f} ms")
    axes[1].set(title="time per update", xlabel="accum_steps N", ylabel="ms")
    axes[1].legend(fontsize=8)
    axes[1].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "auto_batch_goodput.png"), dpi=90)
    plt.close(fig)
