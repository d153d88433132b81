"""`python -m benchmarks.effective_batch`: what `micro_batch_size=b` costs against its peers.

`GradientAccumulator(inner, micro_batch_size=b)` trains each batch `fit` draws (the
effective batch E) as one update: ceil(E / b) micro-batches in one training step. Four
measurements, each in fresh processes (their own traces, their own allocator), the
contenders interleaved in rounds (a round visits them in a random order), every ratio
taken round by round and summarized with its spread (`benchmarks.stats`):

* **steady**: samples per second after warm-up, one process, rounds interleaved: ours at
  `fit(batch_size=E)` against plain `fit(batch_size=E)` (E fits here) and against Keras'
  built-in `gradient_accumulation_steps=N` at `fit(batch_size=b)` (the same b and N),
  compiled with `BENCH_JIT_COMPILE` as the throughput part's contenders are; each round
  times every contender over the same segment of about 5 s (10 updates of E on 2 cores);
* **first epoch**: `jit_compile=True`, a fresh process per contender and round: the
  seconds from `fit`'s call to the end of its first epoch (trace, XLA compile and the
  epoch's updates) for ours, Keras' built-in accumulation and plain `fit` at b; the second
  epoch is timed too (steady, for scale);
* **memory**: the allocator's peak over what was allocated before `fit` (the CPU
  allocator keeps statistics under oneDNN: `TF_ENABLE_ONEDNN_OPTS=1`, one inter-op
  thread), ours against the window of today (`accum_steps=N` at b) plus the batch of E
  as input (ours reads E samples a step where the window reads b);
* **auto**: `micro_batch_size="auto"` on the same model behind a real out-of-memory cliff
  (`tests.accumulator.memory_cliff.MemoryCliff`: a micro-batch of `cliff` samples or more
  asks for 4 TiB): the out-of-memory errors it took, the seconds it says it lost, and its
  first epoch against a fresh run at the b it settled on, with the allocator's retry
  (oneDNN on: each refused allocation comes after about 10 s) and without
  (`TF_ENABLE_ONEDNN_OPTS=0`). No goal: the figures say what a run pays.

The goals (`GOALS`) are the issue's: steady >= 0.95x plain E and >= 1.05x the built-in;
first epoch <= 1.0x the built-in and <= 1.2x plain b; memory <= 1.0x the window's plus
the batch of E. The workload is the throughput part's CPU Transformer (b = 16, N = 4,
E = 64): its micro-step is compute on 2 cores. About 14 minutes on 2 idle cores.

`--quick` is a smoke run (tiny CNN, one round, the measurements grouped in two processes side
by side, one with oneDNN off, one with it on): it checks that every path runs and the files
are written, in under a minute on 2 idle cores; its figures mean nothing.

Writes effective_batch.json and effective_batch.md into `--out` (generated: never edit).
The parent process runs the measurements and never imports TensorFlow.
"""

import datetime
import json
import os
import platform
import random
import subprocess
import sys
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import stats  # noqa: E402  (no TensorFlow at import)

ACCUM = 4
# Per mode: the workload, the updates of an epoch in the first-epoch and auto runs, and the
# micro-batch from which auto's cliff asks for 4 TiB (the largest even split under it fits).
# Steady: a round times each contender over one segment of about `segment_seconds` (a whole
# number of updates, the same samples for all); a segment of a few updates let one slow update
# (another process, a page fault) swing a round's ratio by 20%: 5 s segments, 9 rounds.
SETTINGS = {"full": dict(workload="transformer", epoch_updates=4, cliff=24, rounds=9, first_epoch_rounds=3,
                         memory_repeats=2, auto_repeats=1, segment_seconds=5.0),
            "quick": dict(workload="tiny_cnn", epoch_updates=2, cliff=96, rounds=2, first_epoch_rounds=1,
                          memory_repeats=1, auto_repeats=1, segment_seconds=0.2)}
STEADY = ["effective", "plain_E", "keras_builtin"]
FIRST_EPOCH = ["effective", "keras_builtin", "plain_b"]
MEMORY = ["effective", "window"]
LABELS = {"effective": "ours: micro_batch_size=b, fit at E", "plain_E": "plain fit at E",
          "keras_builtin": "Keras built-in gradient_accumulation_steps=N, fit at b", "plain_b": "plain fit at b",
          "window": "ours today: accum_steps=N, fit at b"}
# key -> (label, measurement, numerator, denominator, target, higher is better)
GOALS = {
    "steady_vs_plain_E": ("steady samples/s: ours / plain fit at E", "steady", "effective", "plain_E", 0.95, True),
    "steady_vs_builtin": ("steady samples/s: ours / Keras built-in at b, N", "steady", "effective", "keras_builtin",
                          1.05, True),
    "first_epoch_vs_builtin": ("first epoch under XLA (s): ours / Keras built-in", "first_epoch", "effective",
                               "keras_builtin", 1.0, False),
    "first_epoch_vs_plain_b": ("first epoch under XLA (s): ours / plain fit at b", "first_epoch", "effective",
                               "plain_b", 1.2, False),
    "memory_vs_window": ("peak memory: ours / (the window's + the batch of E as input)", "memory", "effective",
                         "window", 1.0, False),
}


def _define_flags():
    global OUT, QUICK, ROUNDS, FIRST_EPOCH_ROUNDS, MEMORY_REPEATS, AUTO_REPEATS, MEASURE, FIXED, SEED
    OUT = flags.DEFINE_string("out", "docs/benchmarks/cpu", "Folder for effective_batch.json and .md.")
    QUICK = flags.DEFINE_bool("quick", False, "A smoke run (under a minute): tiny model, one round, grouped processes.")
    ROUNDS = flags.DEFINE_integer("rounds", None, "Steady rounds (default: 9; quick 2).", lower_bound=1)
    FIRST_EPOCH_ROUNDS = flags.DEFINE_integer("first_epoch_rounds", None, "First-epoch rounds, 3 processes each "
                                              "(default: 3; quick 1).", lower_bound=1)
    MEMORY_REPEATS = flags.DEFINE_integer("memory_repeats", None, "Memory repeats, 2 processes each (default: 2).",
                                          lower_bound=1)
    AUTO_REPEATS = flags.DEFINE_integer("auto_repeats", None, "Auto repeats, 4 processes each (default: 1).",
                                        lower_bound=1)
    SEED = flags.DEFINE_integer("seed", 0, "Seed of the round orders.")
    MEASURE = flags.DEFINE_list("measure", None, "Internal: measure KIND:CONTENDER ... in this process, one JSON "
                                "line each.")
    FIXED = flags.DEFINE_integer("fixed_micro_batch", None, "Internal: b of the auto part's fixed run.")


# ------------------------------------------------------------------ in a measuring process
def _settings(quick):
    return SETTINGS["quick" if quick else "full"]


def _sync(model):
    """Waits for the device: a host copy of a variable the step wrote."""
    import numpy as np
    np.asarray(model.optimizer.iterations)


def _versions():
    import keras
    import tensorflow as tf
    return {"tensorflow": tf.__version__, "keras": keras.__version__, "python": platform.python_version()}


def _model_and_data(workload, samples, cliff=None):
    """The workload's model (behind a `MemoryCliff(cliff)` on its input with a cliff) and data."""
    import keras

    from benchmarks import models
    model = models.build(workload, "cpu")
    if cliff is not None:
        from tests.accumulator.memory_cliff import MemoryCliff
        inputs = keras.Input(model.inputs[0].shape[1:], dtype=model.inputs[0].dtype)
        model = keras.Model(inputs, model(MemoryCliff(cliff)(inputs)))
    x, y = models.data(workload, "cpu", samples)
    return model, x, y


def _optimizer(contender, micro):
    """The optimizer a contender compiles with: Adam(1e-3), wrapped or told to accumulate."""
    import keras

    from tfx_gradient_accumulator import GradientAccumulator
    if contender == "effective":
        return GradientAccumulator(keras.optimizers.Adam(1e-3), micro_batch_size=micro)
    if contender == "window":
        return GradientAccumulator(keras.optimizers.Adam(1e-3), ACCUM)
    if contender == "keras_builtin":
        return keras.optimizers.Adam(1e-3, gradient_accumulation_steps=ACCUM)
    if contender in ("plain_E", "plain_b"):
        return keras.optimizers.Adam(1e-3)
    raise ValueError(f"unknown contender {contender!r}; choose from {sorted(LABELS)}")


def _batch(contender, micro):
    """The batch `fit` is given: E for ours and plain E, b for the others."""
    return micro * ACCUM if contender in ("effective", "plain_E") else micro


def _steps_per_update(contender):
    return ACCUM if contender in ("keras_builtin", "window") else 1


def _compiled(contender, model, micro, jit_compile):
    import keras
    model.compile(optimizer=_optimizer(contender, micro),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit_compile)
    return model


def _timed_fit(model, data, warm_steps, steps):
    """`fit` over `warm_steps + steps` steps; the seconds of the last `steps` (ends of steps, synced)."""
    import keras
    marks = []

    class Marks(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch in (warm_steps - 1, warm_steps - 1 + steps):
                _sync(self.model)
                marks.append(time.perf_counter())

    model.fit(data, steps_per_epoch=warm_steps + steps, epochs=1, verbose=0, callbacks=[Marks()])
    return marks[1] - marks[0]


def measure_steady(workload, rounds, segment_seconds, seed=0):
    """The steady contenders, built once each, timed over the same samples per round in a random
    order: {contender: [seconds per round]}, with the samples of a segment."""
    from benchmarks import models
    from benchmarks.contenders import dataset
    from benchmarks.parts import jit_compile_setting, jit_compile_value

    micro = models.config(workload, "cpu")["micro"]
    effective = micro * ACCUM
    jit = jit_compile_value(jit_compile_setting())
    built = {}
    for name in STEADY:
        model, x, y = _model_and_data(workload, effective * 8)
        built[name] = (_compiled(name, model, micro, jit), dataset(x, y, _batch(name, micro)))
        _timed_fit(*built[name], _steps_per_update(name), _steps_per_update(name))     # trace, warm up
    model, data = built["effective"]
    update = min(_timed_fit(model, data, 1, 2) for _ in range(2)) / 2
    updates = max(1, round(segment_seconds / update))
    seconds = {name: [] for name in STEADY}
    order = random.Random(seed)
    for _ in range(rounds):
        for name in order.sample(STEADY, len(STEADY)):
            per = _steps_per_update(name)
            seconds[name].append(_timed_fit(*built[name], per, updates * per))
    return {"seconds": seconds, "segment_samples": updates * effective, "segment_updates": updates,
            "warm_update_seconds": update, "jit_compile": jit_compile_setting(), "micro": micro,
            "description": models.describe(workload, "cpu")}


def measure_first_epoch(workload, contender, updates):
    """`compile(jit_compile=True)` and `fit` for 2 epochs of `updates` updates: the seconds from the
    call to the first epoch's end (trace, compile, train), and of the second epoch."""
    import keras

    from benchmarks import models
    micro = models.config(workload, "cpu")["micro"]
    model, x, y = _model_and_data(workload, updates * micro * ACCUM)
    _compiled(contender, model, micro, True)
    ends = []

    class EpochEnds(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            _sync(self.model)
            ends.append(time.perf_counter())

    start = time.perf_counter()
    model.fit(x, y, batch_size=_batch(contender, micro), epochs=2, shuffle=False, verbose=0, callbacks=[EpochEnds()])
    return {"first_epoch_seconds": ends[0] - start, "second_epoch_seconds": ends[1] - ends[0],
            "updates": int(model.optimizer.iterations.numpy())}


def measure_memory(workload, contender, updates=2):
    """The allocator's peak while one `fit` call trains `updates + 1` updates (the first traces),
    over what was allocated before it; what it holds after; the bytes of a batch of E as input."""
    import tensorflow as tf

    from benchmarks import models
    micro = models.config(workload, "cpu")["micro"]
    model, x, y = _model_and_data(workload, micro * ACCUM * (updates + 1))
    _compiled(contender, model, micro, False)
    # No prefetch: the pipeline holds no batch beyond the one a step reads.
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(_batch(contender, micro), drop_remainder=True).repeat()

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"

    def allocated(key):
        return tf.config.experimental.get_memory_info(device)[key] / 2**20

    tf.config.experimental.reset_memory_stats(device)
    before = allocated("current")
    per = _steps_per_update(contender)
    model.fit(data, steps_per_epoch=per * (updates + 1), epochs=1, verbose=0)
    _sync(model)
    sample_bytes = x[0].nbytes + y[0].nbytes
    return {"growth_mb": allocated("peak") - before, "held_mb": allocated("current") - before,
            "input_e_mb": micro * ACCUM * sample_bytes / 2**20,
            "param_mb": models.parameter_bytes(model) / 2**20, "device": device}


def measure_auto(workload, contender, updates, cliff, fixed=None):
    """`fit(batch_size=E)` for one epoch behind the cliff: `micro_batch_size="auto"` (contender
    "auto") or `fixed`; its seconds, the b it used, and auto's changes (errors, seconds lost)."""
    import keras

    from benchmarks import models
    from benchmarks.parts import jit_compile_setting, jit_compile_value
    from tfx_gradient_accumulator import GradientAccumulator
    micro = models.config(workload, "cpu")["micro"]
    effective = micro * ACCUM
    size = "auto" if contender == "auto" else fixed
    try:
        optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), micro_batch_size=size)
    except (TypeError, ValueError) as refused:
        return {"available": False, "why": str(refused)}
    model, x, y = _model_and_data(workload, updates * effective, cliff)
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile_value(jit_compile_setting()))
    start, cpu = time.perf_counter(), _cpu_seconds()
    model.fit(x, y, batch_size=effective, epochs=1, shuffle=False, verbose=0)
    seconds, cpu = time.perf_counter() - start, _cpu_seconds() - cpu
    changes = [c.as_record() if hasattr(c, "as_record") else dict(c)
               for c in getattr(optimizer, "micro_batch_changes", [])]
    # CPU seconds beside the wall's: an allocator that retries before it refuses waits, it does not compute.
    return {"available": True, "seconds": seconds, "cpu_seconds": cpu, "micro_batch": optimizer.micro_batch_size,
            "effective": effective, "cliff": cliff, "changes": changes,
            "out_of_memory_errors": sum(int(c.get("out_of_memory_errors", 0)) for c in changes),
            "seconds_lost": sum(float(c.get("seconds_lost", 0.0)) for c in changes),
            "updates": int(model.optimizer.iterations.numpy())}


def measure(spec, quick, seed=0, fixed=None, context=None):
    """One measurement `KIND:CONTENDER` in this process; its dict (with the versions and load)."""
    s = _settings(quick)
    kind, _, contender = spec.partition(":")
    load_start, started = _load(), time.perf_counter()
    if kind == "steady":
        result = measure_steady(s["workload"], ROUNDS.value or s["rounds"], s["segment_seconds"], seed)
    elif kind == "first_epoch":
        result = measure_first_epoch(s["workload"], contender, s["epoch_updates"])
    elif kind == "memory":
        result = measure_memory(s["workload"], contender)
    elif kind == "auto":
        fixed = fixed if fixed is not None else (context or {}).get("auto_micro_batch")
        if contender == "fixed" and fixed is None:
            result = {"available": False, "why": "no b to fix: auto did not run"}
        else:
            result = measure_auto(s["workload"], contender, s["epoch_updates"], s["cliff"], fixed)
        if contender == "auto" and result.get("available") and context is not None:
            context["auto_micro_batch"] = result["micro_batch"]
    else:
        raise ValueError(f"unknown measurement {spec!r}: steady, first_epoch, memory or auto")
    return {**result, "measured": spec, "versions": _versions(), "load_start": load_start, "load_end": _load(),
            "measure_seconds": time.perf_counter() - started, "process_cpu_seconds": _cpu_seconds(),
            "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")}


def _cpu_name():
    """The CPU's model name and whether it has AVX-512 (where TensorFlow turns oneDNN on by default)."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return platform.processor() or platform.machine(), None
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")),
                platform.machine())
    return name, "avx512f" in info


def _cpu_seconds():
    """The CPU seconds this process has used so far (its import of TensorFlow included)."""
    import resource
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ------------------------------------------------------------------ the parent: processes, rounds
def _load():
    return [round(v, 2) for v in os.getloadavg()]


def _environment(spec, onednn=None):
    """A measuring process's environment: the memory part's allocator statistics (oneDNN's
    allocator) and one inter-op thread; the auto part's oneDNN setting."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow")
    if spec.startswith("memory"):
        env.update(TF_ENABLE_ONEDNN_OPTS="1", TF_NUM_INTEROP_THREADS="1")
    if onednn is not None:
        env["TF_ENABLE_ONEDNN_OPTS"] = onednn
    return env


def _launch(specs, quick, onednn=None, fixed=None):
    """`specs` measured in one fresh process (started, not waited for)."""
    command = [sys.executable, "-m", "benchmarks.effective_batch", f"--measure={','.join(specs)}",
               f"--seed={SEED.value}"] + (["--quick"] if quick else [])
    command += [f"--rounds={ROUNDS.value}"] if ROUNDS.value else []
    command += [f"--fixed_micro_batch={fixed}"] if fixed is not None else []
    env = _environment(specs[0], onednn)
    print(f"measuring {','.join(specs)} (TF_ENABLE_ONEDNN_OPTS={env.get('TF_ENABLE_ONEDNN_OPTS', 'unset')}; "
          f"load {_load()})", file=sys.stderr, flush=True)
    return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _results_of(process, specs):
    out, err = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{','.join(specs)} failed (exit {process.returncode}):\n{err[-3000:]}")
    lines = [json.loads(line) for line in out.strip().splitlines() if line.startswith("{")]
    if len(lines) != len(specs):
        raise RuntimeError(f"{','.join(specs)}: {len(lines)} results for {len(specs)} measurements:\n{err[-3000:]}")
    return lines


def _one(spec, quick, onednn=None, fixed=None):
    return _results_of(_launch([spec], quick, onednn, fixed), [spec])[0]


def _auto_round(runs, quick, onednn):
    """Auto, then a fresh run at the b it settled on, for one oneDNN setting."""
    found = _one("auto:auto", quick, onednn)
    runs["auto"].append(found)
    fixed = found.get("micro_batch") if found.get("available") else None
    runs["fixed"].append(_one("auto:fixed", quick, onednn, fixed) if fixed is not None
                         else {"available": False, "why": "auto did not run"})


def run_full(settings, quick=False):
    """Every measurement in its own fresh process, contenders interleaved in rounds (`quick`: the
    smoke run's model and sizes in the children)."""
    order = random.Random(SEED.value)
    measured = {"steady": _one("steady", quick), "first_epoch": {c: [] for c in FIRST_EPOCH},
                "memory": {c: [] for c in MEMORY}, "auto": {}}
    for _ in range(FIRST_EPOCH_ROUNDS.value or settings["first_epoch_rounds"]):
        for contender in order.sample(FIRST_EPOCH, len(FIRST_EPOCH)):
            measured["first_epoch"][contender].append(_one(f"first_epoch:{contender}", quick))
    for _ in range(MEMORY_REPEATS.value or settings["memory_repeats"]):
        for contender in order.sample(MEMORY, len(MEMORY)):
            measured["memory"][contender].append(_one(f"memory:{contender}", quick))
    auto = {setting: {"auto": [], "fixed": []} for setting in ("on", "off")}
    for _ in range(AUTO_REPEATS.value or settings["auto_repeats"]):
        for setting in order.sample(["on", "off"], 2):
            _auto_round(auto[setting], quick, "1" if setting == "on" else "0")
    measured["auto"] = auto
    return measured


def _quick_measured():
    """The smoke run, in two processes side by side (not fresh per measurement: its figures mean
    nothing): the steady and first-epoch measurements and auto with oneDNN off in one; the
    memory (oneDNN's allocator keeps the statistics) and auto with oneDNN on in the other."""
    off = ["steady"] + [f"first_epoch:{c}" for c in FIRST_EPOCH] + ["auto:auto", "auto:fixed"]
    on = [f"memory:{c}" for c in MEMORY] + ["auto:auto", "auto:fixed"]
    processes = (_launch(off, True, "0"), _launch(on, True, "1"))
    got_off, got_on = (_results_of(p, specs) for p, specs in zip(processes, (off, on)))
    return {"steady": got_off[0], "first_epoch": {c: [got_off[1 + i]] for i, c in enumerate(FIRST_EPOCH)},
            "memory": {c: [got_on[i]] for i, c in enumerate(MEMORY)},
            "auto": {"on": {"auto": [got_on[2]], "fixed": [got_on[3]]},
                     "off": {"auto": [got_off[4]], "fixed": [got_off[5]]}}}


# ------------------------------------------------------------------ figures, verdicts, page
def _per_round(measured, kind, contender):
    """The per-round values a goal compares: samples/s (steady), seconds (first epoch), or MB
    (memory: the window's with the batch of E added)."""
    if kind == "steady":
        steady = measured["steady"]
        return [steady["segment_samples"] / s for s in steady["seconds"][contender]]
    if kind == "first_epoch":
        return [r["first_epoch_seconds"] for r in measured["first_epoch"][contender]]
    runs = measured["memory"][contender]
    return [r["growth_mb"] + (r["input_e_mb"] if contender == "window" else 0.0) for r in runs]


def goals(measured):
    """Each goal: its per-round ratios' summary and its verdict (`stats.verdict`)."""
    found = []
    for key, (label, kind, numerator, denominator, target, higher) in GOALS.items():
        ratio = stats.ratio_summary(_per_round(measured, kind, numerator), _per_round(measured, kind, denominator))
        found.append({"key": key, "label": label, "target": target, "higher_is_better": higher, "ratio": ratio,
                      "verdict": stats.verdict(ratio, target, higher)})
    return found


def ceiling_of_the_builtin_goal(measured):
    """Per round, plain fit at E over Keras' built-in: the most any split at b can reach
    against the built-in (a split trains the batch of E in smaller products)."""
    return stats.ratio_summary(_per_round(measured, "steady", "plain_E"),
                               _per_round(measured, "steady", "keras_builtin"))


def auto_summary(auto):
    """Per oneDNN setting: auto's out-of-memory errors, the seconds it says it lost, the b it
    settled on, and its epoch's seconds minus the fixed run's (per repeat), or why it did not run."""
    summary = {}
    for setting, runs in auto.items():
        found = [r for r in runs["auto"] if r.get("available")]
        if not found:
            summary[setting] = {"available": False, "why": runs["auto"][0].get("why", "not run") if runs["auto"]
                                else "not run"}
            continue
        paired = [(a, f) for a, f in zip(runs["auto"], runs["fixed"]) if a.get("available") and f.get("available")]
        summary[setting] = {
            "available": True, "micro_batches": sorted({r["micro_batch"] for r in found}),
            "out_of_memory_errors": stats.summary([r["out_of_memory_errors"] for r in found]),
            "seconds_lost": stats.summary([r["seconds_lost"] for r in found]),
            "epoch_seconds": stats.summary([r["seconds"] for r in found]),
            "extra_seconds": stats.summary([a["seconds"] - f["seconds"] for a, f in paired]) if paired else None,
            "epoch_ratio": stats.ratio_summary([a["seconds"] for a, _ in paired],
                                               [f["seconds"] for _, f in paired]) if paired else None}
    return summary


def summarize(measured, quick, started):
    """The results' dict: the measurements, the goals, auto's figures (no TensorFlow here: the
    workload's description and b come from the steady measurement)."""
    s = _settings(quick)
    steady = measured["steady"]
    return {"date": datetime.date.today().isoformat(), "quick": quick, "versions": steady["versions"],
            "python_parent": platform.python_version(), "cpus": os.cpu_count(), "load_end": _load(),
            "cpu": _cpu_name()[0], "avx512": _cpu_name()[1],
            "workload": steady["description"], "micro": steady["micro"], "accum": ACCUM,
            "effective": steady["micro"] * ACCUM, "epoch_updates": s["epoch_updates"], "cliff": s["cliff"],
            "jit_compile_steady": steady.get("jit_compile"), "goals": goals(measured),
            "auto": auto_summary(measured["auto"]), "measured": measured,
            "wall_seconds": time.perf_counter() - started}


def _cell(summary, digits=2, scale=1.0):
    return stats.fmt(summary, digits, scale) if summary else "–"


def _table(contenders, value, digits):
    rows = ["| contender | median [min–max] |", "|---|---|"]
    for c in contenders:
        rows.append(f"| {LABELS[c]} | {_cell(stats.summary(value(c)), digits)} |")
    return rows


def markdown(results):
    m, e, b = results["measured"], results["effective"], results["micro"]
    steady = m["steady"]
    lines = [
        "# The effective batch: `micro_batch_size` against its peers", "",
        "Generated by `python -m benchmarks.effective_batch` (the `effective_batch` part of `make bench`); "
        "do not edit." + (" **A smoke run (`--quick`): its figures mean nothing.**" if results["quick"] else ""), "",
        f"{results['date']}; TensorFlow {results['versions']['tensorflow']}, Keras {results['versions']['keras']}, "
        f"Python {results['versions']['python']}; {results['cpu']} (AVX-512 "
        f"{ {True: 'yes: oneDNN on', False: 'no: oneDNN off', None: '?'}[results['avx512']]} where not set), "
        f"{results['cpus']} cores, load average at the end "
        f"{results['load_end'][0]} (every measurement records its own in the JSON); "
        f"{results['wall_seconds'] / 60:.1f} minutes.", "",
        f"Workload: {results['workload']}; b = {b}, N = {results['accum']}, E = {e}; Adam(1e-3). "
        "Every ratio is taken round by round (both sides measured in the same round, in a random order) and "
        "shown as the median [min–max] of the rounds; a goal is *met* when the median is on its side, "
        "*missed* when every round is on the other, *within noise* otherwise.", "",
        "## Goals", "", "| goal | target | ratio, median [min–max] | verdict |", "|---|---|---|---|"]
    for g in results["goals"]:
        sign = "≥" if g["higher_is_better"] else "≤"
        lines.append(f"| {g['label']} | {sign} {g['target']:.2f} | {_cell(g['ratio'], 3)} | {g['verdict']} |")
    lines += ["", f"The ceiling of the goal against Keras' built-in, in the same rounds: plain fit at E / Keras "
              f"built-in = {_cell(ceiling_of_the_builtin_goal(m), 3)}. A split into micro-batches of b trains the same "
              "samples as the batch of E in smaller matrix products, so it can at most match training the batch "
              "whole; the goal is reachable only where this ratio is above it (where each of the built-in's "
              "N dispatches costs more than here: a device with a launch cost, a small model)."]
    lines += ["", f"## Steady throughput (samples/s, {len(steady['seconds']['effective'])} rounds, one process; "
              f"jit_compile {steady.get('jit_compile')}; each contender timed over {steady['segment_updates']} "
              f"updates of E a round)", ""]
    lines += _table(STEADY, lambda c: _per_round(m, "steady", c), 1)
    processes = "grouped in two processes: a smoke run" if results["quick"] else "a fresh process each"
    lines += ["", f"## First epoch under `jit_compile=True` (s; {processes}, "
              f"rounds: {len(m['first_epoch']['effective'])}, {results['epoch_updates']} updates an epoch)", "",
              "| contender | first epoch (trace, compile, train) | second epoch |", "|---|---|---|"]
    for c in FIRST_EPOCH:
        runs = m["first_epoch"][c]
        lines.append(f"| {LABELS[c]} | {_cell(stats.summary([r['first_epoch_seconds'] for r in runs]))} | "
                     f"{_cell(stats.summary([r['second_epoch_seconds'] for r in runs]))} |")
    input_mb = m["memory"]["effective"][0]["input_e_mb"]
    lines += ["", f"## Peak memory (MB over what was allocated before `fit`; oneDNN's allocator, one inter-op "
              f"thread; {processes}, repeats: {len(m['memory']['effective'])})", "",
              "| contender | peak growth | held after |", "|---|---|---|"]
    for c in MEMORY:
        runs = m["memory"][c]
        lines.append(f"| {LABELS[c]} | {_cell(stats.summary([r['growth_mb'] for r in runs]), 1)} | "
                     f"{_cell(stats.summary([r['held_mb'] for r in runs]), 1)} |")
    lines += ["", f"The batch of E as input: {input_mb:.2f} MB; parameters "
              f"{m['memory']['effective'][0]['param_mb']:.2f} MB.", ""]
    lines += _auto_lines(results)
    return "\n".join(lines) + "\n"


def _auto_lines(results):
    lines = [f"## `micro_batch_size=\"auto\"` behind an out-of-memory cliff (b ≥ {results['cliff']} asks for 4 TiB; "
             f"E = {results['effective']}, one epoch of {results['epoch_updates']} updates)", "",
             "Each run starts at b = E; a step that runs out of memory is trained again at a smaller b. "
             "\"Seconds it says it lost\": the sum of `seconds_lost` over `optimizer.micro_batch_changes`; the "
             "last column takes, repeat by repeat, the epoch of a fresh run at the b auto settled on from auto's "
             "(both trace their step once at that b).", "",
             "| oneDNN | b it settled on | out-of-memory errors | seconds it says it lost | epoch (s) | "
             "epoch − a fresh run at that b (s) |", "|---|---|---|---|---|---|"]
    for setting, s in results["auto"].items():
        name = "on (the allocator retries)" if setting == "on" else "off (refused at once)"
        if not s["available"]:
            lines.append(f"| {name} | not measured: {s['why'].splitlines()[0][:160]} | | | | |")
            continue
        lines.append(f"| {name} | {', '.join(map(str, s['micro_batches']))} | "
                     f"{_cell(s['out_of_memory_errors'], 0)} | {_cell(s['seconds_lost'], 1)} | "
                     f"{_cell(s['epoch_seconds'], 1)} | {_cell(s['extra_seconds'], 1)} |")
    return lines + [""]


def write(results, folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "effective_batch.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(folder, "effective_batch.md"), "w") as f:
        f.write(markdown(results))


def main(argv):
    del argv
    if MEASURE.value:
        context = {}
        for spec in MEASURE.value:
            print(json.dumps(measure(spec, QUICK.value, SEED.value, FIXED.value, context)), flush=True)
        return
    started = time.perf_counter()
    measured = _quick_measured() if QUICK.value else run_full(_settings(False))
    results = summarize(measured, QUICK.value, started)
    folder = OUT.value if os.path.isabs(OUT.value) else os.path.join(ROOT, OUT.value)
    write(results, folder)
    print(markdown(results))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
