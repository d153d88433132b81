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
* ``probe_cost``: what `find_micro_batch` (`accum_steps="fit"`) costs the run it precedes
  (`benchmarks/probe_cost.py`, fresh processes; probe_cost.json and .md beside the
  device's results, about 3 minutes on 2 cores).
* ``effective_batch``: `GradientAccumulator(inner, micro_batch_size=b)` at `fit(batch_size=E)`
  against plain `fit` at E, Keras' built-in accumulation and plain `fit` at b (steady
  throughput; the first epoch under XLA), its peak memory against the window's, and
  `micro_batch_size="auto"` behind an out-of-memory cliff (`benchmarks/effective_batch.py`,
  fresh processes; effective_batch.json and .md beside the device's results, about 10
  minutes on 2 cores); results.json keeps its goals' verdicts.
* ``kernel_count``: kernels executed per non-closing and per closing step (plain
  `fit`, Keras' built-in accumulation, a hand-written tape loop, ours, ours with
  the noise scale; N = 2, 8; a dense and an embedding model; XLA off and on),
  counted from profiler traces on the CPU, the same on every machine:
  `benchmarks/kernel_count.py` in its own process, which writes
  docs/benchmarks/cpu/kernel_count.json and .md (about 2 minutes); results.json
  keeps its goals' verdicts.
* ``memory``: peak training memory on a ~100 MB MLP, one fresh process per
  measurement, repeated; against "accumulator <= plain b + 1.2 x parameters".
* ``distributed``: cross-replica reductions per update (MirroredStrategy, 2
  logical CPUs; MultiWorkerMirroredStrategy, 2 workers on 127.0.0.1), tiny model.
* ``leak``: resident memory after 1,000 vs 10,000 micro-steps.
* ``auto_batch``: `AutoAccumulation` at its defaults against fixed effective
  batches (each at 3 learning rates and with cosine decay), hand ramps and a
  KerasTuner search (validation loss against samples and updates, 10 paired
  seeds, two tuned-on tasks and a held-out one: `benchmarks/auto_batch_tasks.md`),
  and the goodput model (time per sample at accum_steps 1, 2, 4, 8 on 2 worker
  processes): `benchmarks/auto_batch.py` in its own process, which writes
  auto_batch.json, auto_batch.md and its plots next to results.json;
  results.json keeps its verdicts (about 2 hours on 2 idle cores; ``--quick`` a
  smoke run; `python -m benchmarks.auto_batch --resume` goes on with a cut run).

Writes docs/benchmarks/<device>/results.json (here), results.md (`report.py`)
and PNG plots (`plots.py`); ``--report_only`` rewrites the last two from the
stored results.json without measuring. Safe to rerun (files are replaced whole).
This module only runs: each measurement is `measure.py` in its own process, and
the figures derived from them are `analysis.py`'s.
"""

import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import accelerator_facts, plots, report  # noqa: E402  (no TensorFlow at import)
from benchmarks.parts import MEMORY_CONTENDERS, OVERHEAD_ACCUM, OVERHEAD_WORKLOAD, PARTS  # noqa: E402

OUT = flags.DEFINE_string("out", "docs/benchmarks", "Folder for results (a subfolder per device).")
PARTS_FLAG = flags.DEFINE_list("parts", PARTS, f"Parts to run, of {PARTS}.")
WORKLOADS = flags.DEFINE_list("workloads", ["transformer", "resnet"], "Compute-bound models for throughput.")
ACCUMS = flags.DEFINE_list("accums", ["2", "8"], "N values for throughput (each adds ~2 minutes per model on 2 cores).")
ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds (throughput, overhead, distributed).")
MEASURE_SECONDS = flags.DEFINE_integer(
    "measure_seconds", 1800, "Time limit of one measurement process; a throughput measurement cut by it "
    "keeps its completed rounds (a GPU lease sets it inside its minutes).")
THROUGHPUT_CONTENDERS = flags.DEFINE_list(
    "contenders", None, "Throughput contenders (default: all of benchmarks/contenders.py); a GPU lease "
    "measures fewer to fit its minutes.")
MEMORY_REPEATS = flags.DEFINE_integer("memory_repeats", 5, "Fresh processes per memory contender.")
MEMORY_ACCUM = flags.DEFINE_integer("memory_accum", 4, "N for the memory measurement.")
NOISE_ROUNDS = flags.DEFINE_integer("noise_rounds", 21, "Rounds of the noise-scale cost (2 contenders, N = 4).")
QUICK = flags.DEFINE_bool("quick", False, "A smoke run: 2 rounds, short segments, N in {2, 4}, 1 memory repeat.")
REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Rewrite report and plots from results.json.")
DEVICE_FOLDER = flags.DEFINE_string("device_folder", None, "With --report_only: the device subfolder to rewrite "
                                    "(e.g. gpu-nvidia-h200, measured elsewhere); default: this machine's.")


def _quick(args):
    """`args` plus the rounds (and, with --quick, short segments) a measurement runs."""
    return list(args) + (["--rounds=2", "--segment_seconds=0.2"] if QUICK.value else [f"--rounds={ROUNDS.value}"])


def _measure(*args, timeout=None):
    """`benchmarks.measure` with `args` in a fresh process (its own memory, its own traces); its JSON line.

    Stopped after `timeout` seconds (default `--measure_seconds`); a throughput
    measurement stopped so returns the rounds it completed, marked "cut"."""
    command = [sys.executable, "-m", "benchmarks.measure", *args]
    logging.info("measuring: %s  (load %s)", " ".join(args), _load())
    with tempfile.TemporaryDirectory() as folder:
        partial = os.path.join(folder, "partial.json")
        try:
            out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                                 timeout=timeout or MEASURE_SECONDS.value,
                                 env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
                                          BENCH_PARTIAL=partial))
        except subprocess.TimeoutExpired as expired:
            if not os.path.exists(partial):
                said = expired.stderr or ""
                said = said.decode(errors="replace") if isinstance(said, bytes) else said
                raise RuntimeError(f"{' '.join(args)} was cut after {expired.timeout} s before its first "
                                   f"round ended; it said:\n{said[-3000:]}") from None
            logging.warning("cut after %s s: keeping the rounds it completed", timeout or MEASURE_SECONDS.value)
            with open(partial) as f:
                return {**json.load(f), "cut": True}
    if out.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _load():
    """The 1-, 5- and 15-minute load averages: what else ran on the cores during a measurement."""
    return [round(v, 2) for v in os.getloadavg()]


def _device():
    """(results subfolder, device name): the first GPU's, else the CPU's."""
    import tensorflow as tf
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "gpu")
        return "gpu-" + name.lower().replace(" ", "-"), name
    return "cpu", f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


# ------------------------------------------------------------------ running
def _run_throughput(results):
    accums = ["2", "4"] if QUICK.value else ACCUMS.value
    results["throughput"] = {}
    for workload in WORKLOADS.value:
        chosen = [f"--contenders={','.join(THROUGHPUT_CONTENDERS.value)}"] if THROUGHPUT_CONTENDERS.value else []
        results["throughput"][workload] = _measure(
            "--mode=throughput", f"--workload={workload}", f"--accums={','.join(accums)}", *chosen, *_quick([]))


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


def _run_kernel_count(results):
    """`benchmarks.kernel_count` in its own process, on the CPU whatever the machine (the counts are the
    CPU executor's), into docs/benchmarks/cpu/; results.json keeps its goals."""
    folder = os.path.join(ROOT, OUT.value, "cpu")
    command = [sys.executable, "-m", "benchmarks.kernel_count", f"--out={folder}"]
    logging.info("measuring: %s  (load %s)", " ".join(command[1:]), _load())
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
                                  CUDA_VISIBLE_DEVICES=""))
    if out.returncode:
        raise RuntimeError(f"benchmarks.kernel_count failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(folder, "kernel_count.json")) as f:
        goals = json.load(f)["goals"]
    results["kernel_count"] = {"goals": len(goals), "met": sum(g["met"] for g in goals),
                               "missed": [g for g in goals if not g["met"]]}


def _run_probe_cost(results):
    """`benchmarks.probe_cost` (its repeats are fresh processes) into this device's folder;
    results.json keeps its summary."""
    folder = os.path.join(ROOT, OUT.value, _device()[0])
    command = [sys.executable, "-m", "benchmarks.probe_cost", f"--out={folder}", f"--repeats={1 if QUICK.value else 3}"]
    logging.info("measuring: %s  (load %s)", " ".join(command[1:]), _load())
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow"))
    if out.returncode:
        raise RuntimeError(f"benchmarks.probe_cost failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(folder, "probe_cost.json")) as f:
        results["probe_cost"] = json.load(f)["summary"]


def _run_effective_batch(results):
    """`benchmarks.effective_batch` (every measurement a fresh process) into this device's folder;
    results.json keeps its goals and what "auto" took."""
    folder = os.path.join(ROOT, OUT.value, _device()[0])
    command = [sys.executable, "-m", "benchmarks.effective_batch", f"--out={folder}"]
    command += ["--quick"] if QUICK.value else []
    logging.info("measuring: %s  (load %s)", " ".join(command[1:]), _load())
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow"))
    if out.returncode:
        raise RuntimeError(f"benchmarks.effective_batch failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(folder, "effective_batch.json")) as f:
        measured = json.load(f)
    results["effective_batch"] = {"goals": measured["goals"], "auto": measured["auto"], "quick": measured["quick"],
                                  "micro": measured["micro"], "accum": measured["accum"],
                                  "effective": measured["effective"],
                                  "load_start": measured["measured"]["steady"]["load_start"],
                                  "load_end": measured["load_end"]}


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


def _run_auto_batch(results, folder):
    """`benchmarks.auto_batch` in its own process; its summary (the verdicts) from its last line."""
    command = [sys.executable, "-m", "benchmarks.auto_batch", f"--out={folder}"] + (["--quick"] if QUICK.value else [])
    logging.info("measuring: %s  (load %s)", " ".join(command[1:]), _load())
    out = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, text=True, timeout=4 * 3600,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow"))
    if out.returncode:
        raise RuntimeError(f"benchmarks.auto_batch failed (exit {out.returncode}); its log is above")
    results["auto_batch"] = json.loads(out.stdout.strip().splitlines()[-1])


def _measure_parts(path, device_name, started, folder):
    """Runs the parts of --parts in PARTS' order and writes results.json.

    A subset of the parts replaces only its own sections of an existing
    results.json, so that the other parts' figures (and their dates) stay."""
    parts = PARTS_FLAG.value
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"unknown parts {sorted(unknown)}; choose from {PARTS}")
    from benchmarks.parts import jit_compile_setting
    jit_compile = jit_compile_setting()           # a bad BENCH_JIT_COMPILE refused before any part runs
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
                    "accelerator": accelerator_facts(),
                    "jit_compile": jit_compile})
    for part in PARTS:
        if part in parts:
            part_started = time.perf_counter()
            if part == "auto_batch":
                _run_auto_batch(results, folder)
            else:
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
    return results


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
        results = _measure_parts(path, device_name, started, folder)
    plots.draw(results, folder)
    missed = report.write(results, folder)
    print(open(os.path.join(folder, "results.md")).read())
    logging.info("done in %.1f minutes; %d target(s) not met", (time.perf_counter() - started) / 60, len(missed))


if __name__ == "__main__":
    app.run(main)
