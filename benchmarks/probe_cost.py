"""`python -m benchmarks.probe_cost`: what `find_micro_batch` (`accum_steps="fit"`) costs a run.

The probe trains real steps at growing micro-batches before training: b = 1, 2, 4, ...
doubling until a step runs out of memory or b reaches the effective batch E, then
bisection down to adjacent sizes. Each new size is a new input shape, so each probe step
traces the training step anew: the cost is about (probe steps) x (a trace + a step).
Measured here against the run it precedes, each repeat in a fresh process (its own
traces, as a Trainer's run has):

* **probe**: the seconds of `find_micro_batch(..., uniform=True)` on one sample batch;
* **start**: the seconds of the run's first `fit` call over one update (it traces the
  step at the b found: every run pays it, probe or not);
* **update**: the seconds per update after that (N micro-batches of b);
* **probe in updates**: probe / update, and the probe's **share** of a run of U updates,
  probe / (probe + start + U x update), for U = 1,000 and 10,000.

The workload is the CPU Transformer of the throughput part (`benchmarks/models.py`), E =
128, whose every probe fits on this machine (the doubling runs to E: log2(E) + 1 probe
steps, no bisection). A device that runs out of memory at b' adds up to log2(b') steps of
bisection, each costing what a doubling step costs: the table gives the cost per probe
step to scale it.

Writes docs/benchmarks/cpu/probe_cost.json and probe_cost.md (generated: never edit).
"""

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

WORKLOAD, EFFECTIVE, MEASURED_UPDATES, SAMPLE_ROWS = "transformer", 128, 4, 32
RUN_LENGTHS = (1000, 10000)


def _define_flags():
    global OUT, REPEATS, ONE
    OUT = flags.DEFINE_string("out", "docs/benchmarks/cpu", "Folder for probe_cost.json and .md.")
    REPEATS = flags.DEFINE_integer("repeats", 3, "Fresh processes, each a probe and a run.", lower_bound=1)
    ONE = flags.DEFINE_bool("one", False, "Internal: measure once in this process and print one JSON line.")


def measure_once(workload=WORKLOAD, effective=EFFECTIVE, updates=MEASURED_UPDATES):
    """One probe and the start of the run it precedes, in this process: a dict of seconds."""
    import keras

    from benchmarks import models
    from tfx_gradient_accumulator import GradientAccumulator, find_micro_batch

    model = models.build(workload, "cpu")
    model.compile(optimizer=GradientAccumulator(keras.optimizers.Adam(1e-4), schedulable=True),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = models.data(workload, "cpu", effective * (updates + 1))
    start = time.perf_counter()
    found = find_micro_batch(model, x[:SAMPLE_ROWS], y[:SAMPLE_ROWS], effective_batch_size=effective, uniform=True)
    probe = time.perf_counter() - start
    start = time.perf_counter()
    model.fit(x[:effective], y[:effective], batch_size=found.micro_batch, verbose=0, shuffle=False)
    first = time.perf_counter() - start
    start = time.perf_counter()
    model.fit(x[effective:], y[effective:], batch_size=found.micro_batch, verbose=0, shuffle=False)
    update = (time.perf_counter() - start) / updates
    return {"probe_seconds": probe, "start_seconds": first, "update_seconds": update,
            "probe_steps": len(found.probes), "micro_batch": found.micro_batch, "accum_steps": found.accum_steps}


def summarize(repeats):
    """The table's numbers from the repeats' measurements: median, min and max of each."""
    derived = []
    for r in repeats:
        row = dict(r, probe_in_updates=r["probe_seconds"] / r["update_seconds"],
                   probe_step_seconds=r["probe_seconds"] / r["probe_steps"])
        for updates in RUN_LENGTHS:
            run = r["probe_seconds"] + r["start_seconds"] + updates * r["update_seconds"]
            row[f"share_of_{updates}"] = r["probe_seconds"] / run
        derived.append(row)
    keys = [k for k in derived[0] if isinstance(derived[0][k], float)]
    return {k: {"median": statistics.median(d[k] for d in derived), "min": min(d[k] for d in derived),
                "max": max(d[k] for d in derived)} for k in keys}


def markdown(results):
    s = results["summary"]
    first = results["repeats"][0]

    def cell(key, fmt="{:.2f}", scale=1.0):
        v = s[key]
        return (f"{fmt.format(v['median'] * scale)} [{fmt.format(v['min'] * scale)}–"
                f"{fmt.format(v['max'] * scale)}]")

    rows = [("probe (s)", cell("probe_seconds")), ("per probe step (s)", cell("probe_step_seconds")),
            ("the run's first fit call, one update (s)", cell("start_seconds")),
            ("an update after it (s)", cell("update_seconds", "{:.3f}")),
            ("probe, in updates", cell("probe_in_updates", "{:.0f}"))]
    rows += [(f"probe's share of a run of {u:,} updates", cell(f"share_of_{u}", "{:.1f}%", 100.0))
             for u in RUN_LENGTHS]
    lines = [
        "# What the micro-batch probe costs",
        "",
        "Generated by `python -m benchmarks.probe_cost`; do not edit. Explained in "
        "[the benchmarks page](../../benchmarks.md#the-micro-batch-probe).",
        "",
        f"{results['date']}, TensorFlow {results['versions']['tensorflow']}, Keras {results['versions']['keras']}, "
        f"{results['repeats_count']} fresh processes (median [min–max]); load average at the end "
        f"{results['load_1min'][0]} on {os.cpu_count()} cores (other work inflates every time alike; the "
        "shares are ratios of times measured side by side).",
        "",
        f"Workload: {results['workload']}, E = {results['effective']}; the probe found b = {first['micro_batch']} "
        f"x {first['accum_steps']} in {first['probe_steps']} probe steps (every size fits here: doubling to E).",
        "",
        "| | median [min–max] |",
        "|---|---|",
        *[f"| {name} | {value} |" for name, value in rows],
        "",
    ]
    return "\n".join(lines)


def run(repeats):
    """`repeats` fresh processes, each `measure_once`; the results' dict."""
    import keras
    import tensorflow as tf

    from benchmarks import models
    measured = []
    for index in range(repeats):
        out = subprocess.run([sys.executable, "-m", "benchmarks.probe_cost", "--one"], cwd=ROOT, capture_output=True,
                             text=True, env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow"))
        if out.returncode:
            raise RuntimeError(f"repeat {index} failed:\n{out.stderr[-3000:]}")
        measured.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(measured[-1]), flush=True)
    return {"date": datetime.date.today().isoformat(), "workload": models.describe(WORKLOAD, "cpu"),
            "load_1min": [round(v, 2) for v in os.getloadavg()],
            "effective": EFFECTIVE, "repeats_count": repeats, "repeats": measured, "summary": summarize(measured),
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                         "python": platform.python_version()}}


def write(results, folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "probe_cost.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(folder, "probe_cost.md"), "w") as f:
        f.write(markdown(results))


def main(argv):
    del argv
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if ONE.value:
        print(json.dumps(measure_once()))
        return
    results = run(REPEATS.value)
    folder = OUT.value if os.path.isabs(OUT.value) else os.path.join(ROOT, OUT.value)
    write(results, folder)
    print(markdown(results))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
