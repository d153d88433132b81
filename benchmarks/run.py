"""`make bench`: what accumulation costs, on workloads whose steps are compute, not overhead.

Parts (``--parts``, all by default; a part run alone replaces only its own
section of an existing results.json, e.g. ``--parts=memory`` after a change to
the library's memory use):

* ``throughput``: a Transformer text classifier and a ResNet-style CNN (with
  BatchNormalization), sized so one micro-step is compute-bound (>= 50 ms on 2
  CPU cores; larger variants on a GPU). Contenders in two families compared only
  within themselves: `fit` (plain b, plain N*b, GradientAccumulator, the same
  measuring the noise scale, Keras' built-in) and custom loops (plain b, the
  seeds' tape loop, GradientAccumulator). One process per model, every
  (contender, N) cell in every round, interleaved; ratios per round.
* ``noise_scale``: GradientAccumulator with `measure_noise_scale=True` against
  the same without, on the throughput models at N = 4: only those two, in 21
  rounds, for a ratio as tight as this machine allows to judge against 0.98.
* ``overhead``: the same contenders on a tiny model (a few ms per step): the
  fixed cost per micro-step, in microseconds.
* ``memory``: peak training memory on a ~100 MB MLP, one fresh process per
  measurement, repeated; against "accumulator <= plain b + 1.2 x parameters".
* ``distributed``: cross-replica reductions per update (MirroredStrategy, 2
  logical CPUs; MultiWorkerMirroredStrategy, 2 workers on 127.0.0.1), tiny model.
* ``leak``: resident memory after 1,000 vs 10,000 micro-steps.

Writes docs/benchmarks/<device>/results.md, results.json and PNG plots, and
copies the CPU report into the README. Safe to rerun (files are replaced whole).
"""

import datetime
import json
import os
import platform
import subprocess
import sys
import time

from absl import app, flags, logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import accelerator_facts, stats  # noqa: E402  (no TensorFlow at import)

PARTS = ["throughput", "noise_scale", "overhead", "memory", "distributed", "leak"]

OUT = flags.DEFINE_string("out", "docs/benchmarks", "Folder for results (a subfolder per device).")
PARTS_FLAG = flags.DEFINE_list("parts", PARTS, f"Parts to run, of {PARTS}.")
WORKLOADS = flags.DEFINE_list("workloads", ["transformer", "resnet"], "Compute-bound models for throughput.")
ACCUMS = flags.DEFINE_list("accums", ["2", "8"], "N values for throughput (each adds ~2 minutes per model on 2 cores).")
ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds (throughput, overhead, distributed).")
MEMORY_REPEATS = flags.DEFINE_integer("memory_repeats", 5, "Fresh processes per memory contender.")
MEMORY_ACCUM = flags.DEFINE_integer("memory_accum", 4, "N for the memory measurement.")
NOISE_ROUNDS = flags.DEFINE_integer("noise_rounds", 21, "Rounds of the noise-scale cost (2 contenders, N = 4).")
QUICK = flags.DEFINE_bool("quick", False, "A smoke run: 2 rounds, short segments, N in {2, 4}, 1 memory repeat.")
REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Rewrite report, plots and README from results.json.")
DEVICE_FOLDER = flags.DEFINE_string("device_folder", None, "With --report_only: the device subfolder to rewrite "
                                    "(e.g. gpu-nvidia-h200, measured elsewhere); default: this machine's.")

MEMORY_CONTENDERS = ["plain_b", "accumulator", "keras_builtin", "plain_b_mirrored", "accumulator_mirrored"]
OVERHEAD_WORKLOAD, OVERHEAD_ACCUM = "tiny_cnn", 4
TARGETS = {"acc_vs_plain_b": 0.97, "acc_vs_builtin": 1.0, "acc_loop_vs_seeds": 0.97,
           "noise_scale": 0.98, "memory_params": 1.2, "step_ms": 50.0, "leak_mb": 5.0,
           "gpu_saturation": 1.15}
# Per-round ratios: (key, numerator, denominator, label).
FIT_RATIOS = [("acc_vs_plain_b", "accumulator", "plain_b", "accumulator / plain b"),
              ("acc_vs_builtin", "accumulator", "keras_builtin", "accumulator / Keras built-in"),
              ("builtin_vs_plain_b", "keras_builtin", "plain_b", "Keras built-in / plain b"),
              ("plain_Nb_vs_plain_b", "plain_Nb", "plain_b", "plain N·b / plain b")]
LOOP_RATIOS = [("acc_loop_vs_seeds", "accumulator_loop", "seeds_loop", "accumulator / seeds' loop"),
               ("acc_loop_vs_plain_b_loop", "accumulator_loop", "plain_b_loop", "accumulator / plain b"),
               ("seeds_vs_plain_b_loop", "seeds_loop", "plain_b_loop", "seeds' loop / plain b")]
NOISE_RATIO = ("noise_scale", "accumulator_noise_scale", "accumulator", "noise scale on / off")


def _quick(args):
    return list(args) + (["--rounds=2", "--segment_seconds=0.2"] if QUICK.value else [f"--rounds={ROUNDS.value}"])


def _measure(*args, timeout=1800):
    command = [sys.executable, "-m", "benchmarks.measure", *args]
    logging.info("measuring: %s  (load %s)", " ".join(args), _load())
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow"))
    if out.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load():
    return [round(v, 2) for v in os.getloadavg()]


def _device():
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "gpu")
        return "gpu-" + name.lower().replace(" ", "-"), name
    return "cpu", f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


def _machine_note(results):
    """Where it ran: the GPU's facts, or the cores that other processes share."""
    accelerator = results.get("accelerator")
    if accelerator:
        cc = accelerator.get("compute_capability")
        return (f"GPU {accelerator.get('gpu')} (compute capability {'.'.join(map(str, cc)) if cc else '?'}, "
                f"{accelerator.get('gpu_memory', '?')}), driver {accelerator.get('driver', '?')}; TensorFlow built "
                f"for CUDA {accelerator.get('cuda_build', '?')}, cuDNN {accelerator.get('cudnn_build', '?')}; "
                f"{results.get('cpus', '?')} CPU cores.")
    return f"Other processes share the {results.get('cpus', '?')} cores; every measurement records its load."


# ------------------------------------------------------------------ analysis
def _rates(measured):
    """{N: {contender: [samples/s per round]}} from a throughput measurement."""
    samples = measured["segment_micro_steps"] * measured["micro"]
    rates = {}
    for key, seconds in measured["seconds"].items():
        name, n = key.rsplit("@", 1)
        rates.setdefault(int(n), {})[name] = [samples / s for s in seconds]
    return rates


def _step_ms(measured):
    """plain b's milliseconds per micro-step, over every round and N."""
    values = [s / measured["segment_micro_steps"] * 1e3 for key, seconds in measured["seconds"].items()
              if key.startswith("plain_b@") for s in seconds]
    return stats.summary(values)


def _ratios(rates, ratio_specs):
    out = {}
    for n, cells in rates.items():
        for key, a, b, _ in ratio_specs:
            if a in cells and b in cells:
                out.setdefault(key, {})[n] = stats.ratio_summary(cells[a], cells[b])
    return out


def _sanity(rates):
    """Contenders whose work does not depend on N, measured at every N."""
    from benchmarks.contenders import N_INDEPENDENT
    found = {}
    for name in N_INDEPENDENT:
        cells = {n: r[name] for n, r in rates.items() if name in r}
        if len(cells) > 1:
            found[name] = stats.sanity_check(cells)
    return found


def _load_span(results):
    """Min and max of every 1-minute load average recorded in the results."""
    values = []

    def walk(node, key=""):
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, k)
        elif isinstance(node, list):
            if key in ("load_start", "load_end") and node and not isinstance(node[0], list):
                values.append(node[0])
            elif key == "segment_load_1min":
                for round_loads in node:
                    for pair in round_loads.values():
                        values.extend(pair)
            else:
                for v in node:
                    walk(v, key)
    walk(results)
    return (min(values), max(values)) if values else (float("nan"), float("nan"))


# ------------------------------------------------------------------ plots
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


def _plots(results, folder):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from benchmarks.contenders import FIT, LABELS, LOOP

    throughput = results.get("throughput", {})
    if throughput:
        workloads = list(throughput)
        fig, axes = plt.subplots(2, len(workloads), figsize=(6.5 * len(workloads), 8.5), squeeze=False)
        for column, workload in enumerate(workloads):
            rates = _rates(throughput[workload])
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
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "throughput.png"), dpi=100)
        plt.close(fig)

        fig, axes = plt.subplots(1, len(workloads), figsize=(6.5 * len(workloads), 4.5), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            rates = _rates(throughput[workload])
            ratios = _ratios(rates, FIT_RATIOS[:2] + LOOP_RATIOS[:1] + [NOISE_RATIO])
            accums = sorted(rates)
            for i, (key, _, _, label) in enumerate(FIT_RATIOS[:2] + LOOP_RATIOS[:1] + [NOISE_RATIO]):
                if key in ratios:
                    ns = sorted(ratios[key])
                    _errorbar(ax, ns, [ratios[key][n] for n in ns], label, offset=0.03 * (i - 1.5))
            ax.axhline(1.0, color="grey", lw=0.8)
            ax.axhline(0.97, color="grey", lw=0.8, ls="--")
            ax.set(title=f"{workload}: per-round ratios (dashed: 0.97)", xlabel="N", ylabel="ratio (median, min–max)")
            _n_axis(ax, accums)
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "ratios.png"), dpi=100)
        plt.close(fig)

    memory = results.get("memory")
    if memory:
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
            ax.axhline(plain + TARGETS["memory_params"] * memory["param_mb"], color="red", ls="--",
                       label="target: plain b + 1.2 × params (allocator)")
        top = max(r[k] for n in names for r in memory["runs"][n] for k in ("tensor_growth_mb", "rss_growth_mb"))
        ax.set_ylim(0, top * 1.35)
        ax.legend(fontsize=8, loc="upper left")
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels([LABELS[n] for n in names], fontsize=8)
        ax.set(title=f"{memory['workload']} ({memory['param_mb']:.0f} MB params), N={memory['accum']}: "
                     "peak training memory", ylabel="MB over baseline (median, min–max)")
        ax.grid(alpha=0.3, axis="y")
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "memory.png"), dpi=100)
        plt.close(fig)


# ------------------------------------------------------------------ report
def _rounds(throughput):
    return min(len(seconds) for measured in throughput.values() for seconds in measured["seconds"].values())


def _timing_note(results):
    parts, dates = results.get("part_seconds", {}), results.get("part_dates", {})
    if "full_wall_seconds" not in results:      # e.g. a GPU's parts, one device call each
        return ("Parts run one at a time: " + ", ".join(f"{p} ({dates.get(p, '?')}, {parts[p] / 60:.1f} min)"
                                                        for p in PARTS if p in parts) + ".")
    note = (f"The last full `make bench` took {results['full_wall_seconds'] / 60:.1f} minutes ("
            + ", ".join(f"{p} {parts[p] / 60:.1f}" for p in PARTS if p in parts) + ").")
    if set(results["parts_run"]) != set(PARTS):
        note += (f" Re-run alone since: {', '.join(results['parts_run'])} "
                 f"({', '.join(dates.get(p, '?') for p in results['parts_run'])}).")
    return note


def _cell(summary, digits=0, scale=1.0):
    return stats.fmt(summary, digits, scale)


def _verdict_text(verdict):
    return {"met": "**met**", "missed": "**missed**", "within noise": "within noise"}[verdict]


def _report(results, folder):
    from benchmarks.contenders import FIT, LABELS, LOOP
    from benchmarks import models

    low, high = _load_span(results)
    lines = [f"# Benchmarks: {results['device']}", "",
             f"{results['date']}; TensorFlow {results['versions']['tensorflow']}, Keras {results['versions']['keras']}, "
             f"Python {results['versions']['python']}. {_timing_note(results)} 1-minute load average between "
             f"{low:.2f} and {high:.2f} during the measurements (in `results.json`). {_machine_note(results)}", "",
             "How to read: every cell is the median over interleaved rounds with its [min–max]; every ratio "
             "is computed round by round (both sides measured seconds apart in the same round) and then "
             "summarized, never as a ratio of medians. `fit` contenders are compared with `fit`, custom loops "
             "with custom loops. A target is *met* when the median is on the right side of it, *missed* "
             "when every round is on the wrong side, *within noise* otherwise.", ""]
    targets = []

    throughput = results.get("throughput", {})
    if throughput:
        lines += ["## Workloads", "",
                  "| model | what | parameters | micro-batch b | plain b step (ms) | timed micro-steps per cell and round |",
                  "|---|---|---|---|---|---|"]
        for workload, measured in throughput.items():
            step = _step_ms(measured)
            lines.append(f"| {workload} | {measured['description']} | {measured['param_bytes'] / 2**20:.1f} MB | "
                         f"{measured['micro']} | {_cell(step)} | {measured['segment_micro_steps']} |")
            if results.get("accelerator"):
                # On a GPU milliseconds say little; b fills the device when a batch N times
                # larger gains little per sample.
                saturation = _ratios(_rates(measured), FIT_RATIOS).get("plain_Nb_vs_plain_b", {})
                if saturation:
                    n = max(saturation)
                    gain = saturation[n]
                    targets.append((f"{workload}: b fills the GPU (plain {n}·b / plain b samples/s ≤ "
                                    f"{TARGETS['gpu_saturation']:.2f})", _cell(gain, 3),
                                    "met" if gain["median"] <= TARGETS["gpu_saturation"] else "missed",
                                    "gpu_saturation"))
            else:
                targets.append((f"{workload}: compute-bound micro-step (≥ {TARGETS['step_ms']:.0f} ms)",
                                f"{_cell(step)} ms", "met" if step["median"] >= TARGETS["step_ms"] else "missed",
                                "step_ms"))
        lines += ["", "Step time: plain b's seconds per timed segment over its micro-steps, every round and N.", ""]

        lines += ["## Throughput", "",
                  f"Samples per second, median [min–max] over {_rounds(throughput)} rounds. "
                  "plain b does not depend on N: it is one model, measured again at every N (see the sanity check).", ""]
        for workload, measured in throughput.items():
            rates = _rates(measured)
            accums = sorted(rates)
            for family, title in ((FIT, "fit"), (LOOP, "custom loop")):
                names = [c for c in family if c in measured["contenders"]]
                lines += [f"**{workload}, {title}**", "",
                          "| N | " + " | ".join(LABELS[c].replace(f" ({'fit' if family is FIT else 'loop'})", "") for c in names) + " |",
                          "|---|" + "---|" * len(names)]
                for n in accums:
                    cells = [(_cell(stats.summary(rates[n][c])) if c in rates[n] else "did not fit") for c in names]
                    lines.append(f"| {n} | " + " | ".join(cells) + " |")
                lines.append("")
        half_iqrs = [(r["q3"] - r["q1"]) / 2 for measured in throughput.values()
                     for per_n in _ratios(_rates(measured), FIT_RATIOS + [NOISE_RATIO] + LOOP_RATIOS).values()
                     for r in per_n.values()]
        lines += ["![throughput](throughput.png)", "", "## Ratios (per round)", "",
                  "Median [min–max] of the per-round ratios. Resolution: the per-round ratios' interquartile "
                  f"ranges are ±{100 * stats.summary(half_iqrs)['median']:.0f}% wide (median over the cells below), "
                  "so a median within a few percent of a target is not a measured difference.", ""]
        for workload, measured in throughput.items():
            rates = _rates(measured)
            specs = FIT_RATIOS + [NOISE_RATIO] + LOOP_RATIOS
            ratios = _ratios(rates, specs)
            lines += [f"**{workload}**", "",
                      "| N | " + " | ".join(("fit: " if s in FIT_RATIOS + [NOISE_RATIO] else "loop: ") + s[3]
                                           for s in specs) + " |",
                      "|---|" + "---|" * len(specs)]
            for n in sorted(rates):
                lines.append(f"| {n} | " + " | ".join(
                    _cell(ratios[s[0]][n], 3) if n in ratios.get(s[0], {}) else "–" for s in specs) + " |")
            lines.append("")
            judged = [("acc_vs_plain_b", "fit: accumulator ≥ 0.97× plain b"),
                      ("acc_vs_builtin", "fit: accumulator ≥ 1.0× Keras built-in"),
                      ("acc_loop_vs_seeds", "loop: accumulator ≥ 0.97× seeds' loop")]
            if not results.get("noise_scale"):      # else judged on its own, tighter, measurement
                judged.append(("noise_scale", "fit: noise scale on ≥ 0.98× off"))
            for key, label in judged:
                for n in sorted(ratios.get(key, {})):
                    r = ratios[key][n]
                    targets.append((f"{workload} N={n}: {label}", _cell(r, 3),
                                    stats.verdict(r, TARGETS[key]), key))
        lines += ["![ratios](ratios.png)", "", "## Sanity check", "",
                  "A contender whose work does not depend on N (plain b in `fit` and in the loop: one model, "
                  "measured again at every N) should show the same throughput at every N; it is flagged when "
                  "its medians across N differ by more than the largest interquartile range of its cells.", ""]
        flagged = []
        for workload, measured in throughput.items():
            for name, flag in _sanity(_rates(measured)).items():
                if flag:
                    flagged.append(f"- {workload}, {LABELS[name]}: medians differ by {flag['relative'] * 100:.1f}% "
                                   f"(lowest at N={flag['lowest_at']}, highest at N={flag['highest_at']}; "
                                   f"allowed {flag['allowed']:.1f} samples/s, found {flag['difference']:.1f}).")
        lines += flagged or ["Nothing flagged."]
        if flagged:
            lines += ["", results.get("sanity_note", SANITY_NOTE)]
        lines.append("")

    noise = results.get("noise_scale")
    if noise:
        lines += ["## Noise-scale cost", "",
                  "`GradientAccumulator(..., measure_noise_scale=True)` against the same without, in `fit`: only "
                  "these two contenders, alternating in a random order in every round, so that the per-round "
                  "ratio is tight enough to judge against 0.98. Throughput in samples/s; the ratio is per round "
                  "(on / off), with its min–max and interquartile range.", "",
                  "| model | N | rounds | off | on | on / off: median [min–max] | interquartile range |",
                  "|---|---|---|---|---|---|---|"]
        for workload, measured in noise.items():
            rates = _rates(measured)
            for n in sorted(rates):
                cells = rates[n]
                ratio = stats.ratio_summary(cells["accumulator_noise_scale"], cells["accumulator"])
                lines.append(f"| {workload} | {n} | {len(cells['accumulator'])} | "
                             f"{_cell(stats.summary(cells['accumulator']))} | "
                             f"{_cell(stats.summary(cells['accumulator_noise_scale']))} | {_cell(ratio, 3)} | "
                             f"{ratio['q1']:.3f}–{ratio['q3']:.3f} |")
                targets.append((f"{workload} N={n}: fit: noise scale on ≥ 0.98× off", _cell(ratio, 3),
                                stats.verdict(ratio, TARGETS["noise_scale"]), "noise_scale"))
        lines.append("")

    overhead = results.get("overhead")
    if overhead:
        per_step = {}
        for key, seconds in overhead["seconds"].items():
            name, _ = key.rsplit("@", 1)
            per_step[name] = [s / overhead["segment_micro_steps"] * 1e6 for s in seconds]
        lines += ["## Overhead per micro-step (tiny model)", "",
                  f"{overhead['description']}, b = {overhead['micro']}, N = {OVERHEAD_ACCUM}: a step of a few ms, "
                  "so the table shows what each way of training adds per micro-step, not compute. "
                  "Microseconds per micro-step, median [min–max]; the difference is taken per round.", "",
                  "| contender | µs per micro-step | minus plain b of its family, per round |", "|---|---|---|"]
        for name in [c for c in FIT + LOOP if c in per_step]:
            peer = "plain_b" if name in FIT else "plain_b_loop"
            diff = (_cell(stats.summary(stats.per_round_differences(per_step[name], per_step[peer])))
                    if name != peer and peer in per_step else "–")
            lines.append(f"| {LABELS[name]} | {_cell(stats.summary(per_step[name]))} | {diff} |")
        lines.append("")

    memory = results.get("memory")
    if memory:
        runs = memory["runs"]
        repeats = min(len(r) for r in runs.values())
        lines += ["## Peak training memory", "",
                  f"{memory['description']}: {memory['param_mb']:.1f} MB of float32 parameters, b = {memory['micro']}, "
                  f"N = {memory['accum']}, Adam, `fit`. Each figure comes from a fresh process ({repeats} per "
                  "contender, interleaved), measured from a baseline taken once the model (its weights), its data "
                  "and the compiled model exist, before the first step, through warm steps and 2 windows. "
                  "**Allocator peak** (the target's measure): the peak of the bytes TensorFlow's allocator holds "
                  "(`tf.config.experimental.get_memory_info`, reset at the baseline) minus the bytes it held at the "
                  "baseline: every tensor training adds (optimizer state, gradients, window buffers, temporaries), "
                  "exactly, without the C allocator's fragmentation. TensorFlow runs independent ops one at a time "
                  "here (1 inter-op thread): with its default 2, which ops overlap changes from process to process, "
                  "and so does the peak. **RSS**: the growth of the process's resident "
                  "high-water mark (VmHWM, reset at the baseline) over its resident memory: what the OS sees, "
                  "traced graphs and fragmentation included; it moves by tens of MB from process to process "
                  "(zero-filled pages count only once written, and freed blocks stay resident or not depending on "
                  "the C allocator), so it is shown, not judged. Differences are taken per repeat.", "",
                  "| contender | allocator peak (MB) | at window-closing micro-steps | at other micro-steps "
                  "| held between steps beyond the state (MB) "
                  "| RSS growth (MB) | optimizer state (MB) | allocator peak − plain b, same strategy (MB) | ÷ parameter bytes |",
                  "|---|---|---|---|---|---|---|---|---|"]
        accum, overs = memory["accum"], {}
        for name in [n for n in MEMORY_CONTENDERS if n in runs]:
            # Each is compared with plain b trained the same way (under the same strategy).
            baseline = "plain_b_mirrored" if name.endswith("_mirrored") else "plain_b"
            plain = [r["tensor_growth_mb"] for r in runs.get(baseline, [])]
            growth = [r["tensor_growth_mb"] for r in runs[name]]
            state = runs[name][0]["optimizer_state_mb"]
            # After the first step (which builds the state), the allocator should hold the state and nothing
            # more between steps; anything else (a folded graph constant, a cached copy) shows here.
            held = [max(r.get("per_batch_tensor_held_mb", [float("nan")] * 2)[1:]) - state for r in runs[name]]
            if name != baseline and plain:
                differences = stats.per_round_differences(growth, plain)
                extra_text = _cell(stats.summary(differences), 1)
                over = stats.summary([d / memory["param_mb"] for d in differences])
                over_text = overs[name] = _cell(over, 2)
                closing = [max(r["per_batch_tensor_growth_mb"][accum - 1::accum]) for r in runs[name]]
                other = [max(v for i, v in enumerate(r["per_batch_tensor_growth_mb"]) if i and (i + 1) % accum)
                         for r in runs[name]]
                closing_text, other_text = _cell(stats.summary(closing), 1), _cell(stats.summary(other), 1)
                if name == "accumulator":
                    close_cost = stats.summary([(a - b) / memory["param_mb"] for a, b in zip(closing, other)])
                if name == "accumulator":
                    targets.append((f"memory: accumulator ≤ plain b + {TARGETS['memory_params']}× parameter bytes",
                                    f"+{over_text}× params", stats.verdict(over, TARGETS["memory_params"], False),
                                    "memory_params"))
            else:
                extra_text = over_text = closing_text = other_text = "–"
            lines.append(f"| {LABELS[name]} | {_cell(stats.summary(growth), 1)} | {closing_text} | {other_text} | "
                         f"{_cell(stats.summary(held), 1)} | "
                         f"{_cell(stats.summary([r['rss_growth_mb'] for r in runs[name]]), 1)} | {state:.1f} | "
                         f"{extra_text} | {over_text} |")
        if "accumulator" in runs:
            lines += ["", f"The accumulator's micro-steps that close a window peak {_cell(close_cost, 2)}× the "
                      "parameter bytes above its other micro-steps (per repeat)."]
            lines[-1] += (
                " Only a closing micro-step runs the inner optimizer, and Adam's update makes temporaries of a "
                "variable's size (its moment updates, `m * lr`, `sqrt(v)`; here up to twice the 64 MB kernel); "
                "the other micro-steps add each gradient into its buffer as the backward pass produces it. The "
                "window's means take no memory of their own: the buffers are divided in place, one variable "
                "after another (`accumulator/_tf.py: divide_in_place`), so the division costs at most the "
                "largest variable's bytes for a moment, and the buffers are refilled with zeros the same way. "
                "So the accumulator's peak is its buffers (1×) above plain b's, less what plain b's peak holds "
                "that the accumulator's does not (plain b's gradients, all alive at its update).")
            if "plain_b" in runs:
                plain_held = stats.summary([max(r.get("per_batch_tensor_held_mb", [float("nan")] * 2)[1:])
                                            - r["optimizer_state_mb"] for r in runs["plain_b"]])
                acc_held = stats.summary([max(r.get("per_batch_tensor_held_mb", [float("nan")] * 2)[1:])
                                          - r["optimizer_state_mb"] for r in runs["accumulator"]])
                compared = ("no more than that" if acc_held["median"] <= plain_held["median"] + 1.0
                            else f"{acc_held['median']:.0f} MB")
                lines[-1] += (
                    f" Between steps, plain b holds {plain_held['median']:.0f} MB beyond its optimizer state "
                    f"(Keras' own, the same without accumulation); the accumulator holds {compared}. "
                    "Refilled with `tf.fill`, the buffers' zeros were folded by Grappler into graph constants that "
                    "stayed allocated: up to 1.5× the parameters more between steps, before this was measured "
                    "(DEVELOPERS.md).")
        if "accumulator_mirrored" in overs:
            lines += ["", "Under a MirroredStrategy over one device (the path of a Trainer given a strategy: the "
                      "window's sums go through an all-reduce, and its results are divided as tensors, in "
                      "their own buffers), the accumulator peaks "
                      f"{overs['accumulator_mirrored']}× the parameter bytes above plain b under the same "
                      "strategy."]
        lines += ["", f"Measured on {runs['plain_b'][0]['device'] if 'plain_b' in runs else '?'}; "
                  "`python -m benchmarks.run --parts=memory` (or `make bench BENCH_ARGS=--parts=memory`) "
                  "re-runs this part alone.", "", "![memory](memory.png)", ""]

    distributed = results.get("distributed")
    if distributed:
        lines += ["## Distributed: reductions per update (tiny model)", "",
                  "Both run the same custom `strategy.run` loop, one call per micro-step; the seeds' pattern "
                  "all-reduces the gradients after every micro-step, the accumulator once per update. The tiny "
                  "model makes the reductions, not the compute, visible. Time ratio per round.", "",
                  "| strategy | N | reductions per update: accumulator | seeds | s per update: accumulator | seeds "
                  "| accumulator / seeds (time) |", "|---|---|---|---|---|---|---|"]
        for key, title in (("mirrored", "Mirrored, 2 logical CPUs"), ("multiworker", "MultiWorker, 2 workers")):
            if key not in distributed:
                continue
            r = distributed[key]
            a, b = r["accumulator"], r["seeds_reduce_every_micro_step"]
            ratio = stats.ratio_summary(a["seconds_per_update_by_round"], b["seconds_per_update_by_round"])
            lines.append(f"| {title} | {r['accum']} | {a['reductions_per_update']:.1f} | {b['reductions_per_update']:.1f} | "
                         f"{_cell(stats.summary(a['seconds_per_update_by_round']), 4)} | "
                         f"{_cell(stats.summary(b['seconds_per_update_by_round']), 4)} | {_cell(ratio, 2)} |")
            targets.append((f"{title}: one cross-replica reduction per update", f"{a['reductions_per_update']:.1f}",
                            "met" if a["reductions_per_update"] == 1 else "missed", "reductions"))
        lines.append("")

    leak = results.get("leak")
    if leak:
        growth = leak["rss_after_10000_mb"] - leak["rss_after_1000_mb"]
        lines += ["## Leak check", "",
                  f"Resident memory after 1,000 micro-steps: {leak['rss_after_1000_mb']:.1f} MB; after 10,000: "
                  f"{leak['rss_after_10000_mb']:.1f} MB (growth {growth:+.1f} MB, {leak['updates']} updates).", ""]
        targets.append(("leak: growth between 1,000 and 10,000 micro-steps ≤ 5 MB", f"{growth:+.1f} MB",
                        "met" if growth <= TARGETS["leak_mb"] else "missed", "leak"))

    reasons = results.get("reasons", {})
    lines += ["## Targets", "", "| target | measured | verdict | why, where not met |", "|---|---|---|---|"]
    for label, value, verdict, key in targets:
        why = {"met": "", "within noise": WITHIN_NOISE.get(key, WITHIN_NOISE[None])}.get(
            verdict, reasons.get(key, REASONS.get(key, "")))
        lines.append(f"| {label} | {value} | {_verdict_text(verdict)} | {why} |")
    lines.append("")
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return [t for t in targets if t[2] != "met"]


SANITY_NOTE = ("A flag here means the rounds did not see the same machine: other processes took CPU time "
               "during some N blocks and not others (see the load averages in `results.json`); ratios are "
               "per round, so both of their sides saw the same conditions, but absolute samples/s carry this "
               "error.")
WITHIN_NOISE = {
    None: ("the rounds straddle the target (median on the wrong side, some rounds on the right one): the "
           "difference is smaller than this machine's round-to-round noise, so not resolved here"),
    "memory_params": ("the repeats straddle the target: the allocator's peak at a window close depends on which "
                      "variable-sized temporaries of the inner optimizer's update happen to be alive together "
                      "(see the table, per repeat)"),
}
# Why a target can be missed: the mechanism, for the table (shown where every round missed).
REASONS = {
    "memory_params": ("the peak is at the window-closing micro-steps (see the memory table), where the inner "
                      "optimizer's update runs next to the window buffers (1×)"),
    "acc_vs_plain_b": ("per micro-step the accumulator adds a weighted add into a parameter-sized buffer per "
                       "variable (dense, also for the embedding's sparse gradient), per window the mean and the "
                       "reset; see the overhead section for its fixed cost"),
    "acc_vs_builtin": ("both keep buffers; the accumulator also weighs each micro-batch by its samples and "
                       "densifies sparse gradients"),
    "acc_loop_vs_seeds": ("the seeds' loop adds the raw gradients; the accumulator also multiplies by the "
                          "micro-batch weight and branches on the window (one `cond` per micro-step)"),
    "noise_scale": "one squared norm of the gradients per micro-step and the window's norm at the close",
    "step_ms": "the model is too small for this machine: its step time is overhead, not compute",
    "gpu_saturation": ("b leaves the GPU partly idle: per-step costs weigh more than they would at a "
                       "micro-batch that fills it"),
    "reductions": "more than one all-reduce per window",
    "leak": "resident memory grows with training steps",
}


README_START, README_END = "<!-- benchmarks:start -->", "<!-- benchmarks:end -->"


def _update_readme(folder, device):
    """Copies the report between the README's benchmark markers (CPU runs only)."""
    readme = os.path.join(ROOT, "README.md")
    with open(readme) as f:
        text = f.read()
    if README_START not in text or README_END not in text or device != "cpu":
        return
    relative = os.path.relpath(folder, ROOT)
    with open(os.path.join(folder, "results.md")) as f:
        report = f.read()
    for image in ("throughput", "ratios", "memory"):
        report = report.replace(f"]({image}.png)", f"]({relative}/{image}.png)")
    report = "\n".join(("#" + line) if line.startswith("#") else line for line in report.splitlines()[1:])
    head, rest = text.split(README_START, 1)
    _, tail = rest.split(README_END, 1)
    with open(readme + ".partial", "w") as f:
        f.write(head + README_START + "\n" + report.strip() + "\n" + README_END + tail)
    os.replace(readme + ".partial", readme)


# ------------------------------------------------------------------ running
def _run_throughput(results):
    accums = ["2", "4"] if QUICK.value else ACCUMS.value
    results["throughput"] = {}
    for workload in WORKLOADS.value:
        results["throughput"][workload] = _measure(
            "--mode=throughput", f"--workload={workload}", f"--accums={','.join(accums)}", *_quick([]))


def _run_noise_scale(results):
    results["noise_scale"] = {}
    for workload in WORKLOADS.value:
        results["noise_scale"][workload] = _measure(
            "--mode=throughput", f"--workload={workload}", "--accums=4",
            "--contenders=accumulator,accumulator_noise_scale", "--segment_seconds=0.6",
            f"--rounds={3 if QUICK.value else NOISE_ROUNDS.value}")


def _run_overhead(results):
    results["overhead"] = _measure("--mode=throughput", f"--workload={OVERHEAD_WORKLOAD}", f"--accums={OVERHEAD_ACCUM}",
                                   "--contenders=plain_b,accumulator,keras_builtin,plain_b_loop,seeds_loop,accumulator_loop",
                                   *_quick(["--segment_seconds=1.0"] if not QUICK.value else []))


def _run_memory(results):
    from benchmarks import models
    repeats = 1 if QUICK.value else MEMORY_REPEATS.value
    runs = {name: [] for name in MEMORY_CONTENDERS}
    for _ in range(repeats):
        for name in MEMORY_CONTENDERS:      # interleaved: one process each
            runs[name].append(_measure("--mode=memory", "--workload=wide_mlp", f"--accums={MEMORY_ACCUM.value}",
                                       f"--contender={name}", "--inter_op_threads=1"))
    first = runs["plain_b"][0]
    results["memory"] = {"workload": "wide_mlp", "description": models.describe("wide_mlp", first["size"]),
                         "param_mb": first["param_mb"], "accum": first["accum"], "micro": first["micro"],
                         "runs": runs}


def _run_distributed(results):
    from benchmarks.distributed import launch_multiworker
    args = [f"--workload={OVERHEAD_WORKLOAD}", f"--accums={OVERHEAD_ACCUM}", *_quick([])]
    results["distributed"] = {"mirrored": {**_measure("--mode=mirrored", *args), "accum": OVERHEAD_ACCUM}}
    logging.info("measuring: --mode=multiworker (2 workers on 127.0.0.1)  (load %s)", _load())
    results["distributed"]["multiworker"] = {**launch_multiworker(args), "accum": OVERHEAD_ACCUM}


def _run_leak(results):
    results["leak"] = _measure("--mode=leak")


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    started = time.perf_counter()
    device, device_name = _device()
    if DEVICE_FOLDER.value:
        if not REPORT_ONLY.value:
            raise ValueError("--device_folder only rewrites a report (--report_only): measuring uses this machine's")
        device = DEVICE_FOLDER.value
    folder = os.path.join(ROOT, OUT.value, device)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "results.json")
    if REPORT_ONLY.value:
        with open(path) as f:
            results = json.load(f)
    else:
        parts = PARTS_FLAG.value
        unknown = set(parts) - set(PARTS)
        if unknown:
            raise ValueError(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
        results = {}
        if set(parts) != set(PARTS) and os.path.exists(path):
            with open(path) as f:
                results = json.load(f)      # keep the other parts' figures
        import keras
        import tensorflow as tf
        results.update({"date": datetime.date.today().isoformat(), "device": device_name,
                        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                                     "python": platform.python_version()},
                        "cpus": os.cpu_count(), "parts_run": parts, "load_at_start": _load(),
                        "accelerator": accelerator_facts()})
        for part in PARTS:
            if part in parts:
                part_started = time.perf_counter()
                globals()[f"_run_{part}"](results)
                results.setdefault("part_seconds", {})[part] = round(time.perf_counter() - part_started, 1)
                results.setdefault("part_dates", {})[part] = results["date"]
        results["load_at_end"] = _load()
        results["wall_seconds"] = time.perf_counter() - started
        if set(parts) == set(PARTS):
            results["full_wall_seconds"] = results["wall_seconds"]
        with open(path + ".partial", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".partial", path)
    _plots(results, folder)
    missed = _report(results, folder)
    if OUT.value == OUT.default:
        _update_readme(folder, device)
    print(open(os.path.join(folder, "results.md")).read())
    logging.info("done in %.1f minutes; %d target(s) not met", (time.perf_counter() - started) / 60, len(missed))


if __name__ == "__main__":
    app.run(main)
