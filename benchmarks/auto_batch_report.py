"""auto_batch.md and its plots, written from auto_batch.json (no TensorFlow).

The figures come from `auto_batch_analysis`; this module words and draws them.
`write` returns the summary that `benchmarks/run.py` keeps in results.json and
`report.py` shows in results.md.
"""

import os

from benchmarks import auto_batch_analysis as aba
from benchmarks import stats

TITLES = {"digits": "Digits CNN", "text": "Causal language model on synthetic text"}


def _fmt(s, digits=0, scale=1.0):
    if s["mean"] is None:
        return "not reached"
    return f"{s['mean'] * scale:,.{digits}f} [{s['min'] * scale:,.{digits}f}–{s['max'] * scale:,.{digits}f}]"


def _curves(entry):
    return [aba.smooth(r["curve"]) for r in entry["runs"]]


def analyse(task):
    """Target, needs and verdicts of one task's results (curves through `aba.smooth`)."""
    runs = task["runs"]
    fixed = {label: _curves(e) for label, e in runs.items() if e["kind"] == "fixed"}
    target, source = aba.target(fixed)
    needs = {label: aba.needs(_curves(e), target) for label, e in runs.items()}
    fixed_needs = {label: needs[label] for label in fixed}
    judged = [label for label, e in runs.items() if e["kind"] != "fixed"]
    return {"target": target, "target_from": source, "needs": needs,
            "verdicts": aba.verdicts(needs["auto"], fixed_needs),
            "all_verdicts": {label: aba.verdicts(needs[label], fixed_needs) for label in judged},
            "all_per_seed": {label: aba.per_seed_verdicts(_curves(runs[label]), fixed, target) for label in judged},
            "per_seed": aba.per_seed_verdicts(_curves(runs["auto"]), fixed, target),
            "seeds": len(runs["auto"]["runs"])}


def _verdict_cell(v, key, per_seed, seeds):
    one = v[key]
    met = "**met**" if one["met"] else "**missed**"
    if "ratio" in one:
        figure = f"{one['ratio']:.2f}× {one['peer']}"
    elif one.get("dominated_by"):
        figure = "dominated by " + ", ".join(one["dominated_by"])
    elif one.get("why"):
        figure = one["why"]
    else:
        figure = "none dominates"
    return f"{met}: {figure} (seeds: {per_seed[key]} of {seeds})"


def _verdict_lines(v, per_seed, seeds, who="auto"):
    lines = []
    p = v["pareto"]
    lines.append(f"- **Pareto** ({who} not dominated: no fixed batch reaches the target with both fewer samples and "
                 f"fewer updates): **{'met' if p['met'] else 'missed'}**"
                 + (f" (dominated by {', '.join(p['dominated_by'])})" if p.get("dominated_by") else "")
                 + (f" ({p['why']})" if p.get("why") else "")
                 + (f"; seed by seed: met on {per_seed['pareto']} of {seeds}" if per_seed else "") + ".")
    u = v["updates"]
    if "ratio" in u:
        lines.append(f"- **Updates** (≤ {u['limit']:.2f}× those of {u['peer']}, the fixed batch that needs as few "
                     f"samples): {u['ratio']:.2f}×, **{'met' if u['met'] else 'missed'}**"
                     + (f"; seed by seed: met on {per_seed['updates']} of {seeds}" if per_seed else "") + ".")
    else:
        lines.append(f"- **Updates**: **{'met' if u['met'] else 'missed'}** ({u.get('why', '')}).")
    s = v["samples"]
    if "ratio" in s:
        lines.append(f"- **Samples** (≤ {s['limit']:.2f}× those of {s['peer']}, the most sample-efficient fixed "
                     f"batch): {s['ratio']:.2f}×, **{'met' if s['met'] else 'missed'}**"
                     + (f"; seed by seed: met on {per_seed['samples']} of {seeds}" if per_seed else "") + ".")
    else:
        lines.append(f"- **Samples**: **{'met' if s['met'] else 'missed'}** ({s.get('why', '')}).")
    return lines


def _task_section(name, task, a, settings):
    s = task["settings"]
    lines = [f"## {TITLES.get(name, name)}", "",
             f"{task['description'][0].upper()}{task['description'][1:]}. Every run: {task['budget']:,} samples "
             f"({task['budget'] / task['train_size']:.1f} passes), micro-batch {s['micro']}, Adam; effective batches "
             f"from {s['start']} to {s['max']}; learning rate {s['lr0']:g} at {s['start']}, "
             f"`lr_scaling=\"{settings['lr_scaling']}\"` for every run ("
             + ", ".join(f"{float(lr):.2g} at {e}" for e, lr in task["lr"].items()) + "). "
             f"auto ended at effective batches {task['auto_final_batches']} (seed by seed); the ramp's schedule "
             f"(update: accum_steps) is {task['ramp_schedule']}.", "",
             f"**Target**: {a['target']:.4f}, the final validation loss of {a['target_from']} (mean over "
             f"{a['seeds']} seeds), the lowest of the fixed batches'.", "",
             "| run | final validation loss | samples to the target | updates to the target | seeds that reach it "
             "| updates in all |", "|---|---|---|---|---|---|"]
    for label, entry in task["runs"].items():
        n = a["needs"][label]
        finals = aba.spread([aba.final_loss(aba.smooth(r["curve"])) for r in entry["runs"]])
        total = aba.spread([r["curve"][-1]["updates"] for r in entry["runs"]])
        lines.append(f"| {label} | {_fmt(finals, 4)} | {_fmt(n['samples'])} | {_fmt(n['updates'])} | "
                     f"{n['reached']} of {n['seeds']} | {_fmt(total)} |")
    lines += ["", "Mean over seeds [min–max], read from each curve's trailing mean over "
              f"{aba.SMOOTHING} evaluations; samples and updates to the target over the seeds that reach it "
              "(first crossing, linear between evaluations). A configuration that misses the target on any "
              f"seed counts as not reaching it in the verdicts. {task['auto_final_batch']}: the effective "
              "batch auto ended with (most seeds).", "", "**auto** (the headline setting):"]
    lines += _verdict_lines(a["verdicts"], a["per_seed"], a["seeds"])
    lines += ["", "Every run that changes its batch, judged the same way (means over seeds; in brackets, the seeds "
              "on which the same verdict holds seed by seed):", "",
              "| run | Pareto | updates (≤ 0.75× the peer's) | samples (≤ 1.10× the most sample-efficient) |",
              "|---|---|---|---|"]
    for label, v in a["all_verdicts"].items():
        per_seed = a["all_per_seed"][label]
        lines.append(f"| {label} | " + " | ".join(_verdict_cell(v, key, per_seed, a["seeds"])
                                                   for key in ("pareto", "updates", "samples")) + " |")
    lines += [""]
    for label, entry in task["runs"].items():
        if entry["kind"] in ("auto", "auto variant"):
            lines.append(f"{label}'s decisions (update: accum_steps), seed by seed: "
                         + "; ".join(str(r["schedule"]) for r in entry["runs"]) + ".")
            lines.append("")
    return lines


def _tuner_section(tuner):
    trials = tuner["trials"]
    best = min(trials, key=lambda t: t["final_val_loss"])
    lines = ["## One auto run against a KerasTuner search", "",
             f"{TITLES.get(tuner['task'], tuner['task'])}, seed {tuner['seed']}: `keras_tuner.GridSearch` over the "
             f"fixed effective batch ({', '.join(map(str, tuner['grid']))}; objective: final validation loss), each "
             "trial a full run, against one AutoAccumulation run of the same length. Final validation loss: the "
             f"trailing mean of the last {aba.SMOOTHING} evaluations, as above.", "",
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
              "(median [min–max] over the rounds: the spread of the fit). So a run that needs U updates of N micro-steps takes "
              "U × (N × t_micro + t_update): at the same samples, fewer, larger updates save U × t_update. "
              + (f"Here an update costs as much as {model['t_update'] / model['t_micro']:.1f} micro-steps"
                 if model["t_update"] > 0 and model["t_micro"] > 0 else
                 "Here the fit does not resolve a positive t_update (the rounds' spread is larger than it)")
              + "; on a cluster the all-reduce crosses a network, and its share grows with the model's size.", "",
              "![goodput](auto_batch_goodput.png)", ""]
    return lines


def write(results, folder):
    """Writes auto_batch.md and the plots; returns the summary (verdicts per task)."""
    analyses = {name: analyse(task) for name, task in results["tasks"].items()}
    settings = results["settings"]
    lines = ["# AutoAccumulation against fixed effective batches", "",
             f"{results['date']}; TensorFlow {results['versions']['tensorflow']}, Keras "
             f"{results['versions']['keras']}, Python {results['versions']['python']}; {results['cpus']} CPU cores "
             f"shared with other processes (1-minute load {results['load_at_start'][0]} at the start, "
             f"{results.get('load_at_end', ['?'])[0]} at the end); {results.get('wall_seconds', 0) / 60:.1f} "
             "minutes." + (" **A smoke run (--quick): too short to read.**" if settings.get("quick") else ""), "",
             "Every run trains with `GradientAccumulator` at one micro-batch, so runs differ only in their "
             "effective batch (accum_steps × micro-batch), on the same samples. **auto**: `AutoAccumulation("
             f"margin={settings['margin']:g}, patience={settings['patience']}, growth={settings['growth']}, "
             f"lr_scaling=\"{settings['lr_scaling']}\")` from the smallest effective batch (the library's defaults for "
             "margin, patience and growth, chosen before any run; the variants named `auto m… p… g…` are other "
             "settings, run alongside and shown, not picked from); **fixed**: every effective batch from the "
             "smallest to the largest, doubling (the one auto ends with among them); **ramp**: a hand-made `AccumulationSchedule(by=\"update\")` "
             "doubling the effective batch in equal shares of the samples. One learning-rate rule for all: "
             f"`{settings['lr_scaling']}` scaling from the smallest batch's learning rate (fixed batches start at "
             f"theirs). {settings['seeds']} seeds (weights and shuffling).", "",
             "**The goal**: auto is Pareto-better than every fixed batch (none reaches the target with both "
             f"fewer samples and fewer updates), needs at least {aba.FEWER_UPDATES:.0%} fewer updates than the "
             f"fixed batch that needs as few samples, and at most {aba.MORE_SAMPLES:.0%} more samples than the "
             "most sample-efficient fixed batch. Judged on the means over seeds, with the seed-by-seed count.", ""]
    if results.get("reading"):
        lines += ["## Reading", ""] + [p for paragraph in results["reading"] for p in (paragraph, "")]
    summary = {}
    for name, a in analyses.items():
        lines += _task_section(name, results["tasks"][name], a, settings)
        summary[name] = {"target": a["target"], "target_from": a["target_from"],
                         "verdicts": {k: {kk: vv for kk, vv in v.items()} for k, v in a["verdicts"].items()},
                         "per_seed": a["per_seed"], "seeds": a["seeds"]}
    lines += ["![validation loss against samples and updates](auto_batch.png)", ""]
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
def _draw(results, analyses, folder):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(results["tasks"])
    fig, axes = plt.subplots(len(tasks), 3, figsize=(16, 4.6 * len(tasks)), squeeze=False)
    for row, name in enumerate(tasks):
        task, a = results["tasks"][name], analyses[name]
        fixed_labels = [label for label, e in task["runs"].items() if e["kind"] == "fixed"]
        variants = [label for label, e in task["runs"].items() if e["kind"] == "auto variant"]
        for label, entry in task["runs"].items():
            if entry["kind"] == "fixed":
                color = plt.cm.viridis(fixed_labels.index(label) / max(1, len(fixed_labels) - 1) * 0.9)
            elif entry["kind"] == "auto variant":
                color = ("tab:orange", "tab:red", "tab:brown")[variants.index(label) % 3]
            else:
                color = {"auto": "k", "ramp": "tab:pink"}.get(label, "tab:gray")
            width = 2.2 if label == "auto" else 1.1
            for j, run in enumerate(entry["runs"]):
                curve = aba.smooth(run["curve"])
                kwargs = {"color": color, "lw": width, "alpha": 0.8, "label": label if j == 0 else None,
                          "ls": "--" if entry["kind"] == "auto variant" else "-"}
                axes[row][0].plot([p["samples"] for p in curve], [p["val_loss"] for p in curve], **kwargs)
                axes[row][1].plot([max(p["updates"], 1) for p in curve], [p["val_loss"] for p in curve], **kwargs)
                if entry["kind"] != "fixed":
                    axes[row][2].plot([p["samples"] for p in curve], [p["effective_batch"] for p in curve],
                                      drawstyle="steps-post", **kwargs)
        for ax in axes[row][:2]:
            ax.axhline(a["target"], color="grey", ls="--", lw=1, label=f"target ({a['target_from']})")
            ax.set_ylabel(f"validation loss (trailing mean of {aba.SMOOTHING} evaluations)")
            smoothed = [aba.smooth(r["curve"]) for e in task["runs"].values() for r in e["runs"]]
            low = min(p["val_loss"] for c in smoothed for p in c)
            high = max(c[0]["val_loss"] for c in smoothed)
            ax.set(yscale="log", ylim=(low * 0.85, high * 1.1))
            ax.grid(alpha=0.3)
        axes[row][0].set(title=f"{TITLES.get(name, name)}: against samples", xlabel="samples")
        axes[row][1].set(title="against optimizer updates", xlabel="updates (log)", xscale="log")
        axes[row][2].set(title="effective batch (auto, its variants, ramp; every seed)", xlabel="samples", ylabel="effective batch",
                         yscale="log")
        axes[row][0].legend(fontsize=8)
        axes[row][2].legend(fontsize=8)
        axes[row][2].grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "auto_batch.png"), dpi=90)
    plt.close(fig)
    if results.get("goodput"):
        per_sample, per_update, ratios, model = goodput(results["goodput"])
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
