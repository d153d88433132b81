"""docs/benchmarks/<device>/results.md: the benchmark report, written from results.json.

One function per section, in the report's order; each returns its markdown lines
and appends the targets it judges, as (label, measured, verdict, key), to the
list the closing "Targets" table is built from. Figures come from `analysis`;
this module only words and lays them out, so a report can be rewritten from
stored results (`python -m benchmarks.run --report_only`) without measuring.
No TensorFlow at import (the contenders' names are imported where needed).
"""

import os

from benchmarks import analysis, stats
from benchmarks.analysis import FIT_RATIOS, LOOP_RATIOS, NOISE_RATIO, TARGETS
from benchmarks.parts import MEMORY_CONTENDERS, OVERHEAD_ACCUM, PARTS, jit_compile_words

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
    "acc_vs_plain_b": ("per micro-step the accumulator adds each gradient, weighted, into the window (a "
                       "parameter-sized buffer per dense variable, the looked-up rows of a sparse one), per window "
                       "the mean and the reset; see the overhead section for its fixed cost"),
    "acc_vs_builtin": ("both keep buffers; the accumulator also weighs each micro-batch by its samples and "
                       "keeps every micro-batch's sparse rows for the window's one update (Keras 3's large-batch "
                       "update of repeated rows)"),
    "acc_loop_vs_seeds": ("the hand-written loop adds the raw gradients; the accumulator also multiplies by the "
                          "micro-batch weight and branches on the window (one `cond` per micro-step)"),
    "noise_scale": "one squared norm of the gradients per micro-step and the window's norm at the close",
    "step_ms": "the model is too small for this machine: its step time is overhead, not compute",
    "gpu_saturation": ("b leaves the GPU partly idle: per-step costs weigh more than they would at a "
                       "micro-batch that fills it"),
    "reductions": "more than one all-reduce per window",
    "leak": "resident memory grows with training steps",
    "auto_batch": "see [auto_batch.md](auto_batch.md): the runs' curves, what each needs and why",
    "effective_batch": "see [effective_batch.md](effective_batch.md): the contenders' figures, round by round",
}


def write(results, folder):
    """Writes folder/results.md; returns the targets not met, as (label, measured, verdict, key)."""
    targets = []
    lines = _header(results)
    throughput = results.get("throughput", {})
    if throughput:
        lines += _workloads(results, targets)
        lines += _throughput(throughput)
        lines += _ratios(results, targets)
        lines += _sanity(results)
    if results.get("noise_scale"):
        lines += _noise_scale(results["noise_scale"], targets)
    if results.get("overhead"):
        lines += _overhead(results["overhead"])
    if results.get("effective_batch"):
        lines += _effective_batch(results["effective_batch"], targets)
    if results.get("memory"):
        lines += _memory(results["memory"], targets)
    if results.get("distributed"):
        lines += _distributed(results["distributed"], targets)
    if results.get("leak"):
        lines += _leak(results["leak"], targets)
    if results.get("auto_batch"):
        lines += _auto_batch(results["auto_batch"], targets)
    lines += _targets_table(targets, results.get("reasons", {}))
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return [t for t in targets if t[2] != "met"]


# ------------------------------------------------------------------ helpers
def _cell(summary, digits=0, scale=1.0):
    return stats.fmt(summary, digits, scale)


def _verdict_text(verdict):
    return {"met": "**met**", "missed": "**missed**", "within noise": "within noise"}[verdict]


def _machine_note(results):
    """Where it ran: the GPU's facts, or the cores that other processes share."""
    accelerator = results.get("accelerator")
    if accelerator:
        cc = accelerator.get("compute_capability")
        return (f"GPU {accelerator.get('gpu')} (compute capability {'.'.join(map(str, cc)) if cc else '?'}, "
                f"{accelerator.get('gpu_memory', '?')}), driver {accelerator.get('driver', '?')}; TensorFlow built "
                f"for CUDA {accelerator.get('cuda_build', '?')}, cuDNN {accelerator.get('cudnn_build', '?')}; "
                f"{results.get('cpus', '?')} CPU cores. Every contender compiled with "
                f"`jit_compile={jit_compile_words(results.get('jit_compile', 'auto'))}`.")
    return f"Other processes share the {results.get('cpus', '?')} cores; every measurement records its load."


def _timing_note(results):
    """How long the parts took, and which were re-run alone since the last full run."""
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


# ------------------------------------------------------------------ sections
def _header(results):
    low, high = analysis.load_span(results)
    return [f"# Benchmarks: {results['device']}", "",
            f"{results['date']}; TensorFlow {results['versions']['tensorflow']}, Keras {results['versions']['keras']}, "
            f"Python {results['versions']['python']}. {_timing_note(results)} 1-minute load average between "
            f"{low:.2f} and {high:.2f} during the measurements (in `results.json`). {_machine_note(results)}", "",
            "How to read: every cell is the median over interleaved rounds with its [min–max]; every ratio "
            "is computed round by round (both sides measured seconds apart in the same round) and then "
            "summarized, never as a ratio of medians. `fit` contenders are compared with `fit`, custom loops "
            "with custom loops. A target is *met* when the median is on the right side of it, *missed* "
            "when every round is on the wrong side, *within noise* otherwise.", ""]


def _workloads(results, targets):
    """The models and their step times; judges each as compute-bound (CPU) or as filling the GPU."""
    lines = ["## Workloads", "",
             "| model | what | parameters | micro-batch b | plain b step (ms) | timed micro-steps per cell and round |",
             "|---|---|---|---|---|---|"]
    for workload, measured in results["throughput"].items():
        step = analysis.step_ms(measured)
        lines.append(f"| {workload} | {measured['description']} | {measured['param_bytes'] / 2**20:.1f} MB | "
                     f"{measured['micro']} | {_cell(step)} | {measured['segment_micro_steps']} |")
        if results.get("accelerator"):
            # On a GPU milliseconds say little; b fills the device when a batch N times
            # larger gains little per sample.
            saturation = analysis.ratios(analysis.rates(measured), FIT_RATIOS).get("plain_Nb_vs_plain_b", {})
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
    return lines + ["", "Step time: plain b's seconds per timed segment over its micro-steps, every round and N.", ""]


def _throughput(throughput):
    """Samples/s per N, a table per model and family (`fit`, custom loop)."""
    from benchmarks.contenders import FIT, LABELS, LOOP
    lines = ["## Throughput", "",
             f"Samples per second, median [min–max] over {analysis.rounds(throughput)} rounds"
             + (" (cut by its time limit: the rounds it completed)" if any(
                 m.get("cut") for m in throughput.values()) else "") + ". "
             "plain b does not depend on N: it is one model, measured again at every N (see the sanity check).", ""]
    for workload, measured in throughput.items():
        rates = analysis.rates(measured)
        for family, title in ((FIT, "fit"), (LOOP, "custom loop")):
            names = [c for c in family if c in measured["contenders"]]
            lines += [f"**{workload}, {title}**", "",
                      "| N | " + " | ".join(LABELS[c].replace(f" ({'fit' if family is FIT else 'loop'})", "") for c in names) + " |",
                      "|---|" + "---|" * len(names)]
            for n in sorted(rates):
                cells = [(_cell(stats.summary(rates[n][c])) if c in rates[n] else "did not fit") for c in names]
                lines.append(f"| {n} | " + " | ".join(cells) + " |")
            lines.append("")
    return lines + ["![throughput](throughput.png)", ""]


def _ratios(results, targets):
    """The per-round ratios per model and N, with their resolution; judges the accumulator's."""
    throughput = results["throughput"]
    specs = FIT_RATIOS + [NOISE_RATIO] + LOOP_RATIOS
    half_iqrs = [(r["q3"] - r["q1"]) / 2 for measured in throughput.values()
                 for per_n in analysis.ratios(analysis.rates(measured), specs).values()
                 for r in per_n.values()]
    lines = ["## Ratios (per round)", "",
             "Median [min–max] of the per-round ratios. Resolution: the per-round ratios' interquartile "
             f"ranges are ±{100 * stats.summary(half_iqrs)['median']:.0f}% wide (median over the cells below), "
             "so a median within a few percent of a target is not a measured difference.", ""]
    judged = [("acc_vs_plain_b", "fit: accumulator ≥ 0.97× plain b"),
              ("acc_vs_builtin", "fit: accumulator ≥ 1.0× Keras built-in"),
              ("acc_loop_vs_seeds", "loop: accumulator ≥ 0.97× hand-written loop")]
    if not results.get("noise_scale"):      # else judged on its own, tighter, measurement
        judged.append(("noise_scale", "fit: noise scale on ≥ 0.98× off"))
    for workload, measured in throughput.items():
        rates = analysis.rates(measured)
        ratios = analysis.ratios(rates, specs)
        lines += [f"**{workload}**", "",
                  "| N | " + " | ".join(("fit: " if s in FIT_RATIOS + [NOISE_RATIO] else "loop: ") + s[3]
                                       for s in specs) + " |",
                  "|---|" + "---|" * len(specs)]
        for n in sorted(rates):
            lines.append(f"| {n} | " + " | ".join(
                _cell(ratios[s[0]][n], 3) if n in ratios.get(s[0], {}) else "–" for s in specs) + " |")
        lines.append("")
        for key, label in judged:
            for n in sorted(ratios.get(key, {})):
                r = ratios[key][n]
                targets.append((f"{workload} N={n}: {label}", _cell(r, 3), stats.verdict(r, TARGETS[key]), key))
    return lines + ["![ratios](ratios.png)", ""]


def _sanity(results):
    """Flags an N-independent contender whose throughput moved with N (the machine, not the code)."""
    from benchmarks.contenders import LABELS
    lines = ["## Sanity check", "",
             "A contender whose work does not depend on N (plain b in `fit` and in the loop: one model, "
             "measured again at every N) should show the same throughput at every N; it is flagged when "
             "its medians across N differ by more than the largest interquartile range of its cells.", ""]
    flagged = []
    for workload, measured in results["throughput"].items():
        for name, flag in analysis.sanity(analysis.rates(measured)).items():
            if flag:
                flagged.append(f"- {workload}, {LABELS[name]}: medians differ by {flag['relative'] * 100:.1f}% "
                               f"(lowest at N={flag['lowest_at']}, highest at N={flag['highest_at']}; "
                               f"allowed {flag['allowed']:.1f} samples/s, found {flag['difference']:.1f}).")
    lines += flagged or ["Nothing flagged."]
    if flagged:
        lines += ["", results.get("sanity_note", SANITY_NOTE)]
    return lines + [""]


def _noise_scale(noise, targets):
    """The noise scale's cost, measured on its own (two contenders, many rounds); judged against 0.98."""
    lines = ["## Noise-scale cost", "",
             "`GradientAccumulator(..., measure_noise_scale=True)` against the same without, in `fit`: only "
             "these two contenders, alternating in a random order in every round, so that the per-round "
             "ratio is tight enough to judge against 0.98. Throughput in samples/s; the ratio is per round "
             "(on / off), with its min–max and interquartile range.", "",
             "| model | N | rounds | off | on | on / off: median [min–max] | interquartile range |",
             "|---|---|---|---|---|---|---|"]
    for workload, measured in noise.items():
        rates = analysis.rates(measured)
        for n in sorted(rates):
            cells = rates[n]
            ratio = stats.ratio_summary(cells["accumulator_noise_scale"], cells["accumulator"])
            lines.append(f"| {workload} | {n} | {len(cells['accumulator'])} | "
                         f"{_cell(stats.summary(cells['accumulator']))} | "
                         f"{_cell(stats.summary(cells['accumulator_noise_scale']))} | {_cell(ratio, 3)} | "
                         f"{ratio['q1']:.3f}–{ratio['q3']:.3f} |")
            targets.append((f"{workload} N={n}: fit: noise scale on ≥ 0.98× off", _cell(ratio, 3),
                            stats.verdict(ratio, TARGETS["noise_scale"]), "noise_scale"))
    return lines + [""]


def _overhead(overhead):
    """Microseconds per micro-step on the tiny model, and each contender's excess over plain b."""
    from benchmarks.contenders import FIT, LABELS, LOOP
    per_step = analysis.overhead_per_step_us(overhead)
    lines = ["## Overhead per micro-step (tiny model)", "",
             f"{overhead['description']}, b = {overhead['micro']}, N = {OVERHEAD_ACCUM}: a step of a few ms, "
             "so the table shows what each way of training adds per micro-step, not compute. "
             "Microseconds per micro-step, median [min–max]; the difference is taken per round.", "",
             "| contender | µs per micro-step | minus plain b of its family, per round |", "|---|---|---|"]
    for name in [c for c in FIT + LOOP if c in per_step]:
        peer = "plain_b" if name in FIT else "plain_b_loop"
        diff = (_cell(stats.summary(stats.per_round_differences(per_step[name], per_step[peer])))
                if name != peer and peer in per_step else "–")
        lines.append(f"| {LABELS[name]} | {_cell(stats.summary(per_step[name]))} | {diff} |")
    return lines + [""]


def _effective_batch(summary, targets):
    """`micro_batch_size=b` at `fit(batch_size=E)` against its peers, from effective_batch.md's part:
    its goals join the targets; what "auto" took is said in a line."""
    lines = ["## The effective batch (`micro_batch_size`)", "",
             f"`GradientAccumulator(inner, micro_batch_size={summary['micro']})` at `fit(batch_size="
             f"{summary['effective']})` (N = {summary['accum']}) against plain `fit` at E, Keras' built-in "
             "accumulation and plain `fit` at b, in fresh processes; the tables, the memory and "
             "`micro_batch_size=\"auto\"` behind an out-of-memory cliff: [effective_batch.md](effective_batch.md)"
             + (" (a smoke run: its figures mean nothing)" if summary.get("quick") else "") + ".", ""]
    for goal in summary["goals"]:
        sign = "≥" if goal["higher_is_better"] else "≤"
        targets.append((f"effective batch: {goal['label']} {sign} {goal['target']:.2f}", _cell(goal["ratio"], 3),
                        goal["verdict"], "effective_batch"))
    for setting, auto in summary.get("auto", {}).items():
        words = "oneDNN on (the allocator retries)" if setting == "on" else "oneDNN off"
        if not auto.get("available"):
            lines.append(f"- auto, {words}: not measured ({auto.get('why', '?').splitlines()[0][:120]}).")
            continue
        lines.append(f"- auto, {words}: b = {', '.join(map(str, auto['micro_batches']))} after "
                     f"{_cell(auto['out_of_memory_errors'])} out-of-memory errors, "
                     f"{_cell(auto['seconds_lost'], 1)} s lost by its own account.")
    return lines + [""]


def _memory(memory, targets):
    """Peak training memory: what is measured and how, the table, and why the accumulator's peak is where it is."""
    runs = memory["runs"]
    repeats = min(len(r) for r in runs.values())
    lines = ["## Peak training memory", "",
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
    rows, overs, close_cost = _memory_rows(memory, targets)
    lines += rows
    lines += _memory_notes(runs, overs, close_cost)
    return lines + ["", f"Measured on {runs['plain_b'][0]['device'] if 'plain_b' in runs else '?'}; "
                    "`python -m benchmarks.run --parts=memory` (or `make bench BENCH_ARGS=--parts=memory`) "
                    "re-runs this part alone.", "", "![memory](memory.png)", ""]


def _memory_rows(memory, targets):
    """The memory table's rows; judges the accumulator's peak over plain b's against 1.2× the parameters.

    Returns (rows, {contender: its excess over plain b in parameter bytes, as text},
    the accumulator's closing micro-steps' peak over its others in parameter bytes)."""
    from benchmarks.contenders import LABELS
    runs, accum = memory["runs"], memory["accum"]
    rows, overs, close_cost = [], {}, None
    for name in [n for n in MEMORY_CONTENDERS if n in runs]:
        # Each is compared with plain b trained the same way (under the same strategy).
        baseline = analysis.memory_baseline(name)
        plain = [r["tensor_growth_mb"] for r in runs.get(baseline, [])]
        growth = [r["tensor_growth_mb"] for r in runs[name]]
        state = runs[name][0]["optimizer_state_mb"]
        # After the first step (which builds the state), the allocator should hold the state and nothing
        # more between steps; anything else (a folded graph constant, a cached copy) shows here.
        held = [analysis.held_between_steps_mb(r) - state for r in runs[name]]
        extra_text = over_text = closing_text = other_text = "–"
        if name != baseline and plain:
            differences = stats.per_round_differences(growth, plain)
            extra_text = _cell(stats.summary(differences), 1)
            over = stats.summary([d / memory["param_mb"] for d in differences])
            over_text = overs[name] = _cell(over, 2)
            closing, other = analysis.window_peaks(runs[name], accum)
            closing_text, other_text = _cell(stats.summary(closing), 1), _cell(stats.summary(other), 1)
            if name == "accumulator":
                close_cost = stats.summary([(a - b) / memory["param_mb"] for a, b in zip(closing, other)])
                targets.append((f"memory: accumulator ≤ plain b + {TARGETS['memory_params']}× parameter bytes",
                                f"+{over_text}× params", stats.verdict(over, TARGETS["memory_params"], False),
                                "memory_params"))
        rows.append(f"| {LABELS[name]} | {_cell(stats.summary(growth), 1)} | {closing_text} | {other_text} | "
                    f"{_cell(stats.summary(held), 1)} | "
                    f"{_cell(stats.summary([r['rss_growth_mb'] for r in runs[name]]), 1)} | {state:.1f} | "
                    f"{extra_text} | {over_text} |")
    return rows, overs, close_cost


def _memory_notes(runs, overs, close_cost):
    """Why the accumulator peaks where it does, and what it holds between steps against plain b."""
    lines = []
    if "accumulator" in runs:
        note = (f"The accumulator's micro-steps that close a window peak {_cell(close_cost, 2)}× the "
                "parameter bytes above its other micro-steps (per repeat).")
        note += (
            " Only a closing micro-step runs the inner optimizer, and Adam's update makes temporaries of a "
            "variable's size (its moment updates, `m * lr`, `sqrt(v)`; here up to twice the 64 MB kernel); "
            "the other micro-steps add each gradient into its buffer as the backward pass produces it. The "
            "window's means take no memory of their own: the buffers are divided in place, one variable "
            "after another (`accumulator/core/_tf.py: divide_in_place`), so the division costs at most the "
            "largest variable's bytes for a moment, and the buffers are refilled with zeros the same way. "
            "So the accumulator's peak is its buffers (1×) above plain b's, less what plain b's peak holds "
            "that the accumulator's does not (plain b's gradients, all alive at its update).")
        if "plain_b" in runs:
            plain_held = stats.summary([analysis.held_between_steps_mb(r) - r["optimizer_state_mb"]
                                        for r in runs["plain_b"]])
            acc_held = stats.summary([analysis.held_between_steps_mb(r) - r["optimizer_state_mb"]
                                      for r in runs["accumulator"]])
            compared = ("no more than that" if acc_held["median"] <= plain_held["median"] + 1.0
                        else f"{acc_held['median']:.0f} MB")
            note += (
                f" Between steps, plain b holds {plain_held['median']:.0f} MB beyond its optimizer state "
                f"(Keras' own, the same without accumulation); the accumulator holds {compared}. "
                "Refilled with `tf.fill`, the buffers' zeros were folded by Grappler into graph constants that "
                "stayed allocated: up to 1.5× the parameters more between steps, before this was measured "
                "(DEVELOPERS.md).")
        lines += ["", note]
    if "accumulator_mirrored" in overs:
        lines += ["", "Under a MirroredStrategy over one device (the path of a Trainer given a strategy: the "
                  "window's sums go through an all-reduce, and its results are divided as tensors, in "
                  "their own buffers), the accumulator peaks "
                  f"{overs['accumulator_mirrored']}× the parameter bytes above plain b under the same "
                  "strategy."]
    return lines


def _distributed(distributed, targets):
    """Cross-replica reductions per update, accumulator against the seeds' pattern; judges one per update."""
    lines = ["## Distributed: reductions per update (tiny model)", "",
             "Both run the same custom `strategy.run` loop, one call per micro-step; a hand-written loop "
             "all-reduces the gradients after every micro-step, the accumulator once per update. The tiny "
             "model makes the reductions, not the compute, visible. Time ratio per round.", "",
             "| strategy | N | reductions per update: accumulator | hand-written | s per update: accumulator | "
             "hand-written | accumulator / hand-written (time) |", "|---|---|---|---|---|---|---|"]
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
    return lines + [""]


def _leak(leak, targets):
    """Resident memory after 1,000 and 10,000 micro-steps; judges the growth against 5 MB."""
    growth = leak["rss_after_10000_mb"] - leak["rss_after_1000_mb"]
    targets.append(("leak: growth between 1,000 and 10,000 micro-steps ≤ 5 MB", f"{growth:+.1f} MB",
                    "met" if growth <= TARGETS["leak_mb"] else "missed", "leak"))
    return ["## Leak check", "",
            f"Resident memory after 1,000 micro-steps: {leak['rss_after_1000_mb']:.1f} MB; after 10,000: "
            f"{leak['rss_after_10000_mb']:.1f} MB (growth {growth:+.1f} MB, {leak['updates']} updates).", ""]


def _auto_batch(summary, targets):
    """AutoAccumulation against fixed effective batches: the verdicts, from auto_batch.md's part."""
    lines = ["## AutoAccumulation against fixed effective batches", "",
             "The effective batch grown by the measured noise scale against fixed effective batches (each with a "
             "learning-rate grid and a decay schedule), hand ramps and a KerasTuner search, on two tuned-on tasks "
             "and a held-out one, over paired seeds; and the "
             "goodput model (why updates cost time). The curves, tables and plots: "
             "[auto_batch.md](auto_batch.md).", ""]
    labels = {"reach": "auto reaches the best fixed configuration's loss on ≥ 9 of 10 seeds",
              "updates": "auto needs ≤ 0.75× the updates of the most sample-efficient fixed configuration "
                         "(90% upper bound)",
              "samples": "auto needs ≤ 1.10× its samples (90% upper bound)",
              "pareto": "no fixed configuration reaches the target with fewer samples and fewer updates"}
    for task, part in summary.items():
        if task in ("tuner", "goodput") or "verdicts" not in part:
            continue
        verdicts, per_seed, seeds = part["verdicts"], part["per_seed"], part["seeds"]
        name = task + (" (held out)" if part.get("held_out") else "")
        for key, label in labels.items():
            v = verdicts.get(key)
            if v is None:
                continue
            if "peer" in v:
                measured = (f"≤ {v['ratio']:.2f}× {v['peer']}" if v.get("ratio") is not None else f"∞ × {v['peer']}")
            else:
                measured = ("not excluded: " + ", ".join(v["dominated_by"]) if v.get("dominated_by")
                            else v.get("why", "none"))
            targets.append((f"{name}: {label}", f"{measured} (seeds met: {per_seed[key]} of {seeds})",
                            "met" if v["met"] else "missed", "auto_batch"))
    goodput = summary.get("goodput")
    if goodput:
        lines += [f"Goodput model on 2 worker processes: time per update = N × {goodput['t_micro'] * 1e3:.2f} ms + "
                  f"{goodput['t_update'] * 1e3:.2f} ms; time per sample against N = 1: "
                  + ", ".join(f"N={n}: {r:.2f}×" for n, r in goodput["ratios"].items()) + ".", ""]
    return lines


def _targets_table(targets, reasons):
    """Every judged target with its verdict, and why where it was not met (`reasons` from results.json first)."""
    lines = ["## Targets", "", "| target | measured | verdict | why, where not met |", "|---|---|---|---|"]
    for label, value, verdict, key in targets:
        why = {"met": "", "within noise": WITHIN_NOISE.get(key, WITHIN_NOISE[None])}.get(
            verdict, reasons.get(key, REASONS.get(key, "")))
        lines.append(f"| {label} | {value} | {_verdict_text(verdict)} | {why} |")
    return lines + [""]
