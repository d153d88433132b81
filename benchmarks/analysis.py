"""Figures derived from results.json: rates, per-round ratios, sanity checks, the targets.

Pure functions over the measured results (no TensorFlow, no files), so that the
plots and the report compute every figure the same way, and tests can feed them
made-up results. The per-round statistics themselves live in `stats.py`.
"""

from benchmarks import stats

TARGETS = {"acc_vs_plain_b": 0.97, "acc_vs_builtin": 1.0, "acc_loop_vs_seeds": 0.97,
           "noise_scale": 0.98, "memory_params": 1.2, "step_ms": 50.0, "leak_mb": 5.0,
           "gpu_saturation": 1.15}
# Per-round ratios: (key, numerator, denominator, label).
FIT_RATIOS = [("acc_vs_plain_b", "accumulator", "plain_b", "accumulator / plain b"),
              ("acc_vs_builtin", "accumulator", "keras_builtin", "accumulator / Keras built-in"),
              ("builtin_vs_plain_b", "keras_builtin", "plain_b", "Keras built-in / plain b"),
              ("plain_Nb_vs_plain_b", "plain_Nb", "plain_b", "plain N·b / plain b")]
LOOP_RATIOS = [("acc_loop_vs_seeds", "accumulator_loop", "seeds_loop", "accumulator / hand-written loop"),
               ("acc_loop_vs_plain_b_loop", "accumulator_loop", "plain_b_loop", "accumulator / plain b"),
               ("seeds_vs_plain_b_loop", "seeds_loop", "plain_b_loop", "hand-written loop / plain b")]
NOISE_RATIO = ("noise_scale", "accumulator_noise_scale", "accumulator", "noise scale on / off")


def rates(measured):
    """{N: {contender: [samples/s per round]}} from a throughput measurement."""
    samples = measured["segment_micro_steps"] * measured["micro"]
    rates = {}
    for key, seconds in measured["seconds"].items():
        name, n = key.rsplit("@", 1)
        rates.setdefault(int(n), {})[name] = [samples / s for s in seconds]
    return rates


def step_ms(measured):
    """plain b's milliseconds per micro-step, over every round and N."""
    values = [s / measured["segment_micro_steps"] * 1e3 for key, seconds in measured["seconds"].items()
              if key.startswith("plain_b@") for s in seconds]
    return stats.summary(values)


def ratios(rates, ratio_specs):
    """{key: {N: summary of the per-round ratios}} for the specs whose two contenders were measured."""
    out = {}
    for n, cells in rates.items():
        for key, a, b, _ in ratio_specs:
            if a in cells and b in cells:
                out.setdefault(key, {})[n] = stats.ratio_summary(cells[a], cells[b])
    return out


def sanity(rates):
    """Contenders whose work does not depend on N, measured at every N."""
    from benchmarks.contenders import N_INDEPENDENT
    found = {}
    for name in N_INDEPENDENT:
        cells = {n: r[name] for n, r in rates.items() if name in r}
        if len(cells) > 1:
            found[name] = stats.sanity_check(cells)
    return found


def rounds(throughput):
    """The fewest rounds any throughput cell has."""
    return min(len(seconds) for measured in throughput.values() for seconds in measured["seconds"].values())


def load_span(results):
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


def overhead_per_step_us(overhead):
    """{contender: [µs per micro-step per round]} from the overhead measurement."""
    per_step = {}
    for key, seconds in overhead["seconds"].items():
        name, _ = key.rsplit("@", 1)
        per_step[name] = [s / overhead["segment_micro_steps"] * 1e6 for s in seconds]
    return per_step


def memory_baseline(name):
    """The contender a memory contender is compared with: plain b trained the same way (same strategy)."""
    return "plain_b_mirrored" if name.endswith("_mirrored") else "plain_b"


def held_between_steps_mb(run):
    """The most the allocator held between steps after the first (which builds the optimizer state)."""
    return max(run.get("per_batch_tensor_held_mb", [float("nan")] * 2)[1:])


def window_peaks(runs, accum):
    """Per repeat: the allocator's peak at window-closing micro-steps, and at the others (the first excluded)."""
    closing = [max(r["per_batch_tensor_growth_mb"][accum - 1::accum]) for r in runs]
    other = [max(v for i, v in enumerate(r["per_batch_tensor_growth_mb"]) if i and (i + 1) % accum)
             for r in runs]
    return closing, other
