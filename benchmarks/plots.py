"""The report's PNG figures: throughput, per-round ratios, peak memory (matplotlib, Agg).

Every figure is drawn from results.json through `analysis`, the same figures the
report's tables show, so a plot and its table never disagree. Medians with their
min–max over the rounds (or repeats), like the tables.
"""

import os

from benchmarks import analysis, stats
from benchmarks.parts import MEMORY_CONTENDERS


def draw(results, folder):
    """Writes throughput.png and ratios.png (with a throughput part) and memory.png (with a memory part)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    throughput = results.get("throughput", {})
    if throughput:
        _save(plt, _throughput_figure(plt, throughput), folder, "throughput.png")
        _save(plt, _ratios_figure(plt, throughput), folder, "ratios.png")
    memory = results.get("memory")
    if memory:
        _save(plt, _memory_figure(plt, memory), folder, "memory.png")


def _save(plt, fig, folder, name):
    fig.tight_layout()
    fig.savefig(os.path.join(folder, name), dpi=100)
    plt.close(fig)


def _n_axis(ax, accums):
    """N on a log axis, ticked at the measured values; grid and legend."""
    ax.set(xscale="log", xticks=accums)
    ax.set_xticklabels(accums)
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _errorbar(ax, xs, summaries, label, offset=0.0, **kwargs):
    medians = [s["median"] for s in summaries]
    low = [s["median"] - s["min"] for s in summaries]
    high = [s["max"] - s["median"] for s in summaries]
    ax.errorbar([x * (1 + offset) for x in xs], medians, yerr=[low, high], marker="o", capsize=3,
                label=label, **kwargs)


def _throughput_figure(plt, throughput):
    """Samples/s against N: a column per model, `fit` above, custom loops below."""
    from benchmarks.contenders import FIT, LABELS, LOOP
    workloads = list(throughput)
    fig, axes = plt.subplots(2, len(workloads), figsize=(6.5 * len(workloads), 8.5), squeeze=False)
    for column, workload in enumerate(workloads):
        rates = analysis.rates(throughput[workload])
        accums = sorted(rates)
        for row, family in enumerate((FIT, LOOP)):
            ax = axes[row][column]
            for i, name in enumerate(c for c in family if any(c in rates[n] for n in accums)):
                ns = [n for n in accums if name in rates[n]]
                _errorbar(ax, ns, [stats.summary(rates[n][name]) for n in ns], LABELS[name],
                          offset=0.03 * (i - 2))
            ax.set(title=f"{workload}: {'fit' if row == 0 else 'custom loop'}", xlabel="N (micro-batches per update)",
                   ylabel="samples / s (median, min–max)")
            _n_axis(ax, accums)
    return fig


def _ratios_figure(plt, throughput):
    """The judged per-round ratios against N, one panel per model, with the 0.97 line."""
    workloads = list(throughput)
    specs = analysis.FIT_RATIOS[:2] + analysis.LOOP_RATIOS[:1] + [analysis.NOISE_RATIO]
    fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.5), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        rates = analysis.rates(throughput[workload])
        ratios = analysis.ratios(rates, specs)
        accums = sorted(rates)
        for i, (key, _, _, label) in enumerate(specs):
            if key in ratios:
                ns = sorted(ratios[key])
                _errorbar(ax, ns, [ratios[key][n] for n in ns], label, offset=0.03 * (i - 1.5))
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(0.97, color="grey", lw=0.8, ls="--")
        ax.set(title=f"{workload}: per-round ratios (dashed: 0.97)", xlabel="N", ylabel="ratio (median, min–max)")
        _n_axis(ax, accums)
    return fig


def _memory_figure(plt, memory):
    """Allocator peak and RSS growth per contender, with the target over plain b."""
    from benchmarks.contenders import LABELS
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [n for n in MEMORY_CONTENDERS if n in memory["runs"]]
    for offset, key, label, hatch in ((-0.2, "tensor_growth_mb", "TensorFlow allocator peak", None),
                                      (0.2, "rss_growth_mb", "resident memory (VmHWM)", "//")):
        summaries = [stats.summary([r[key] for r in memory["runs"][n]]) for n in names]
        ax.bar([i + offset for i in range(len(names))], [s["median"] for s in summaries], width=0.4,
               yerr=[[s["median"] - s["min"] for s in summaries], [s["max"] - s["median"] for s in summaries]],
               capsize=4, label=label, hatch=hatch, color="C0" if hatch is None else "C7")
    if "plain_b" in names:
        plain = stats.summary([r["tensor_growth_mb"] for r in memory["runs"]["plain_b"]])["median"]
        ax.axhline(plain + analysis.TARGETS["memory_params"] * memory["param_mb"], color="red", ls="--",
                   label="target: plain b + 1.2 × params (allocator)")
    top = max(r[k] for n in names for r in memory["runs"][n] for k in ("tensor_growth_mb", "rss_growth_mb"))
    ax.set_ylim(0, top * 1.35)
    ax.legend(fontsize=8, loc="upper left")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels([LABELS[n] for n in names], fontsize=8)
    ax.set(title=f"{memory['workload']} ({memory['param_mb']:.0f} MB params), N={memory['accum']}: "
                 "peak training memory", ylabel="MB over baseline (median, min–max)")
    ax.grid(alpha=0.3, axis="y")
    return fig
