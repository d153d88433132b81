"""Peak training memory on an embedding-heavy model: the window keeps rows, not tables.

A 64 MiB table (262,144 ids x 64 float32) under a small dense head; micro-batches of
64 samples with 32 ids each (Zipf-distributed, so ids repeat), Adam, `fit`. Each
contender trains in a fresh process with one inter-op thread, and TensorFlow's
allocator statistics (`tf.config.experimental.get_memory_info`) give the peak over
the baseline (model, data and compiled model in place) for every micro-step, and the
bytes still held after each. Contenders:

* ``plain_b``: Adam at the micro-batch (the memory a run without accumulation needs);
* ``accumulator``: `GradientAccumulator(Adam, N)`: the window's rows;
* ``accumulator_merged``: the same with `merge_duplicate_rows=True`;
* ``keras_builtin``: `Adam(gradient_accumulation_steps=N)`, a dense table-sized buffer;
* ``large_batch``: Adam at N x b, what Keras itself allocates for the large batch's
  sparse gradient (the batch that does not fit, in the setting accumulation is for).

Target (issue 20): accumulator peak - plain b peak <= 1.2 x dense parameter bytes +
the window's row bytes (N x ids per micro-batch x (64 x 4 + 8) bytes), and no copy of
the table when a window closes.

    python -m benchmarks.embedding_memory [--repeats 3] [--accum 4]

writes docs/benchmarks/cpu/embedding_memory.{json,md,png} (or gpu-<device>/ on a GPU).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys

from benchmarks import allocator_statistics_on

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB, DIM, IDS, MICRO = 262_144, 64, 32, 64
CONTENDERS = ("plain_b", "accumulator", "accumulator_merged", "keras_builtin", "large_batch")
TARGET = 1.2


def _model(keras):
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((IDS,), dtype="int32"),
        keras.layers.Embedding(VOCAB, DIM),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(64, activation="relu"),
        keras.layers.Dense(1),
    ])


def measure(contender, accum):
    """One contender in this process: per-micro-step peaks and held bytes, in MiB."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    allocator_statistics_on()
    import numpy as np
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    from tfx_gradient_accumulator.accumulator import GradientAccumulator

    rng = np.random.RandomState(0)
    samples = MICRO * accum * 3
    x = (np.minimum(rng.zipf(1.2, size=(samples, IDS)), VOCAB) - 1).astype("int32")
    y = rng.randn(samples, 1).astype("float32")
    model = _model(keras)
    batch = MICRO * accum if contender == "large_batch" else MICRO
    if contender in ("plain_b", "large_batch"):
        optimizer = keras.optimizers.Adam(1e-3)
    elif contender == "keras_builtin":
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accum)
    else:
        optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), accum,
                                        merge_duplicate_rows=contender == "accumulator_merged")
    model.compile(optimizer, "mse", jit_compile=False)
    # One warm-up window builds the optimizer, traces the step and sizes the row buffers.
    model.fit(x[:MICRO * accum], y[:MICRO * accum], batch_size=batch, shuffle=False, verbose=0)
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"

    def mib(key):
        return tf.config.experimental.get_memory_info(device)[key] / 2**20

    tf.config.experimental.reset_memory_stats(device)
    baseline = mib("current")
    peaks, held = [], []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            tf.config.experimental.reset_memory_stats(device)

        def on_train_batch_end(self, batch, logs=None):
            peaks.append(round(mib("peak") - baseline, 2))
            held.append(round(mib("current") - baseline, 2))

    rest = slice(MICRO * accum, None)
    model.fit(x[rest], y[rest], batch_size=batch, shuffle=False, verbose=0, callbacks=[Probe()])
    dense = sum(int(np.prod(w.shape)) * 4 for w in model.weights[1:])
    # The optimizer's state as it is held (the window's buffers change size: not `v.shape`).
    state = sum(np.asarray(v.numpy()).nbytes for v in optimizer.variables)
    rows = accum * MICRO * IDS * (DIM * 4 + 8)
    return {"contender": contender, "accum": accum, "device": device, "peaks_mb": peaks, "held_mb": held,
            "state_mb": state / 2**20,
            "table_mb": VOCAB * DIM * 4 / 2**20, "dense_param_mb": dense / 2**20, "window_rows_mb": rows / 2**20}


def _spawn(contender, accum):
    out = subprocess.run([sys.executable, "-m", "benchmarks.embedding_memory", "--one", contender,
                          "--accum", str(accum)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{contender} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def report(runs, folder):
    """Writes embedding_memory.{json,md,png} into `folder`; returns the Markdown."""
    first = runs["accumulator"][0]
    accum, rows_mb, dense_mb, table_mb = first["accum"], first["window_rows_mb"], first["dense_param_mb"], first["table_mb"]
    peak = {name: _summary([max(r["peaks_mb"]) for r in rs]) for name, rs in runs.items()}
    state = {name: _summary([r["state_mb"] for r in rs]) for name, rs in runs.items()}

    def extra(name, peer):
        # What training costs beyond `peer`: its peak over its baseline, plus the
        # optimizer state it holds beyond the peer's (in the baseline already).
        return _summary([max(a["peaks_mb"]) - max(b["peaks_mb"]) + a["state_mb"] - b["state_mb"]
                         for a, b in zip(runs[name], runs[peer])])

    over_plain = {name: extra(name, "plain_b") for name in runs if name != "plain_b"}
    over_large = {name: extra(name, "large_batch") for name in ("accumulator", "accumulator_merged")}
    # A window's close runs the update the large batch's step runs, on the same rows:
    # a copy of the table there would show as ~table_mb over the large batch's peak.
    closing = {name: _summary([max(a["peaks_mb"][accum - 1::accum]) - max(b["peaks_mb"])
                               for a, b in zip(runs[name], runs["large_batch"])])
               for name in ("accumulator", "accumulator_merged")}
    allowed = TARGET * dense_mb + rows_mb

    def verdict(summary):
        return "met" if summary["max"] <= allowed else ("missed" if summary["median"] > allowed else "within noise")

    fmt = lambda s: f"{s['median']:.1f} [{s['min']:.1f}–{s['max']:.1f}]"
    lines = [
        "## Peak training memory: embedding model", "",
        f"A {table_mb:.0f} MiB table ({VOCAB:,} ids × {DIM} float32) under a {dense_mb * 1024:.0f} KiB dense "
        f"head; micro-batches of {MICRO} samples × {IDS} Zipf-distributed ids, N = {accum}, Adam, `fit`, "
        f"{len(runs['plain_b'])} fresh processes per contender, 1 inter-op thread. Peak: TensorFlow's allocator "
        "peak over the baseline (model, data, optimizer state and compiled step in place), the highest of the "
        "micro-steps; state: the optimizer's variables as held; extra: the peak and the state beyond the peer's. "
        f"Median [min–max], MiB. The window's rows: {accum} × {MICRO * IDS:,} rows × ({DIM} × 4 + 8) bytes = "
        f"{rows_mb:.2f} MiB. `python -m benchmarks.embedding_memory` re-runs it.", "",
        "| contender | peak | optimizer state | extra over plain b | extra over the large batch | closing step over the large batch's step |",
        "|---|---|---|---|---|---|",
    ]
    for name in runs:
        lines.append(f"| {name} | {fmt(peak[name])} | {fmt(state[name])} | "
                     f"{fmt(over_plain[name]) if name in over_plain else '—'} | "
                     f"{fmt(over_large[name]) if name in over_large else '—'} | "
                     f"{fmt(closing[name]) if name in closing else '—'} |")
    lines += [
        "", f"Target: the accumulator's extra ≤ {TARGET} × dense parameters + the window's rows = "
        f"{allowed:.2f} MiB. Over plain b: **{verdict(over_plain['accumulator'])}** "
        f"({fmt(over_plain['accumulator'])} MiB): beside the rows it holds, the window's close hands Keras' Adam "
        f"the large batch's {accum * MICRO * IDS:,}-row gradient, whose temporaries (scaled and squared rows) "
        "Keras makes for the large batch too. Over the large batch itself: "
        f"**{verdict(over_large['accumulator'])}** ({fmt(over_large['accumulator'])} MiB). No copy of the table: "
        f"a closing step peaks {fmt(closing['accumulator'])} MiB above the large batch's step, where a copy would "
        f"add {table_mb:.0f}. Keras' built-in accumulation holds a dense table-sized buffer: "
        f"{fmt(over_plain['keras_builtin'])} MiB over plain b.", "",
        "![embedding memory](embedding_memory.png)", ""]
    text = "\n".join(lines)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "embedding_memory.json"), "w") as f:
        json.dump({"runs": runs, "target_mb": allowed}, f, indent=1)
    with open(os.path.join(folder, "embedding_memory.md"), "w") as f:
        f.write(text)
    _plot(runs, over_plain, allowed, table_mb, folder)
    return text


def _plot(runs, over_plain, allowed, table_mb, folder):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(over_plain)
    med = [over_plain[n]["median"] for n in names]
    err = [[m - over_plain[n]["min"] for m, n in zip(med, names)],
           [over_plain[n]["max"] - m for m, n in zip(med, names)]]
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    ax.bar(names, med, yerr=err, capsize=4, color=["#2a7", "#5b9", "#c66", "#888"])
    for x, m in enumerate(med):
        ax.text(x, m, f"{m:.1f}", ha="center", va="bottom", fontsize=8)
    ax.axhline(allowed, color="red", ls="--", lw=1, label="target: 1.2× dense params + window rows")
    ax.axhline(table_mb, color="grey", ls=":", lw=1, label="one copy of the table")
    ax.set_yscale("symlog", linthresh=1)
    ax.set(ylabel="MiB beyond plain b (peak + state)",
           title=f"Embedding model, {table_mb:.0f} MiB table: memory beyond training at the micro-batch")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "embedding_memory.png"), dpi=100)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=CONTENDERS, help="measure one contender in this process")
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--folder", default=None, help="default: docs/benchmarks/cpu")
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one, args.accum)))
        return
    runs = {name: [] for name in CONTENDERS}
    for repeat in range(args.repeats):
        for name in CONTENDERS:
            runs[name].append(_spawn(name, args.accum))
            print(f"repeat {repeat + 1}/{args.repeats} {name}: peak +{max(runs[name][-1]['peaks_mb']):.1f} MiB",
                  flush=True)
    folder = args.folder or os.path.join(ROOT, "docs", "benchmarks",
                                         "cpu" if runs["plain_b"][0]["device"] == "CPU:0" else "gpu")
    print(report(runs, folder))


if __name__ == "__main__":
    main()
