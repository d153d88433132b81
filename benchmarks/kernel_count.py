"""`python -m benchmarks.kernel_count`: the cost of a step, counted in kernels (a part of `make bench`).

A GPU pays a launch (a few microseconds of host work, and a gap on the device) for every
kernel a step runs, whatever the kernel does; a small model's step is made of those
launches. This part counts them on the CPU, where the count is the same on every machine
(the executor runs the same graph; only the kernels' insides differ), so it needs no GPU:

* **Method.** Each step (one call of `fit`'s own `train_function`, or of a loop's
  `tf.function`) runs alone under `tf.profiler.experimental` (host tracer level 2,
  Python tracer off), and the events of the executor's threads named `node:OpType` are
  counted: one per kernel executed. Level 2 is what the executor traces for kernels
  that do work: it leaves out the kernels TensorFlow marks inexpensive (`Const`,
  `Identity`, `Reshape`, `Shape`, `Switch`/`Merge` of a `cond`, ...), which run inline
  on the host and launch nothing on a GPU. The `tf.data` pipeline's own threads are not
  counted (the step's `IteratorGetNext` is).
* **Steps.** After two whole windows (traced, run), `N` consecutive steps are traced: the
  first N - 1 are the non-closing steps (their largest count is reported), the N-th the
  closing one. Plain `fit` has one kind of step (both columns). The hand-written tape
  loop's closing step is its micro-step plus its `apply` function.
* **XLA** (`jit_compile=True`): the step is one compiled cluster. Counted: the kernels the
  executor runs around it (the same rule), the XLA thunks XLA:CPU's runtime executes
  inside it (`xla_thunks`: fusions, copies, matrix products; on a GPU, roughly its kernel
  launches), and the cluster's runs (`xla_runs`: its executable's `Execute` events).
* **Launching kernels**: the kernels less those that launch nothing on a GPU (`NO_LAUNCH`:
  a variable's read, which hands a reference, and assignment, which swaps buffers; an
  allocation; the input pipeline's host-side hand-over), shown and judged beside them.
* **Goals** (per model, N and XLA setting): a non-closing step of ours <= Keras' built-in;
  a closing step <= Keras' built-in + the exact sparse update's own kernels (those of the
  closing step under a `window_rows` name scope or of a sparse update's op types,
  `ResourceScatter*`, `ResourceSparse*`, `Unique*`, `UnsortedSegment*`, `ResourceGather`;
  under XLA, its scatter, gather and sort thunks); the noise scale's steps <= 1.25 x ours
  without it.

Writes docs/benchmarks/cpu/kernel_count.json and kernel_count.md (generated: never edit).
"""

import datetime
import glob
import json
import os
import platform
import re
import shutil
import sys
import tempfile

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CONTENDERS = ["plain_b", "keras_builtin", "tape_loop", "accumulator", "accumulator_noise_scale"]
LABELS = {"plain_b": "plain Keras fit at b", "keras_builtin": "Keras built-in `gradient_accumulation_steps`",
          "tape_loop": "hand-written GradientTape loop", "accumulator": "GradientAccumulator",
          "accumulator_noise_scale": "GradientAccumulator + noise scale"}
MODELS = {"dense": "MLP 16-64-64-64-4 (4 Dense layers, 8 variables)",
          "embedding": "per-token Embedding 1000x32 over 8 tokens, Flatten, 4 Dense (9 variables)"}
MICRO_BATCH = 8
NOISE_FACTOR = 1.25
# Op types of a sparse optimizer update and of exact rows: what the closing goal allows beyond Keras'.
SPARSE_OPS = re.compile(r"^(ResourceScatter\w*|ResourceSparse\w*|Unique\w*|UnsortedSegment\w*|ResourceGather)$")
# Kernels that launch nothing on a GPU: a variable's read (a reference) and assignment (a
# buffer swap), an allocation, the input pipeline's host-side hand-over.
NO_LAUNCH = frozenset({"ReadVariableOp", "AssignVariableOp", "Empty", "IteratorGetNext", "IteratorGetNextAsOptional",
                       "OptionalFromValue", "OptionalHasValue", "OptionalGetValue"})
# XLA thunks of a sparse update (HLO scatter, gather, and sort: XLA's unique).
_SPARSE_THUNK = re.compile(r"^(scatter|gather|sort)")
_KERNEL = re.compile(r"^([^:\s]+):([A-Z_][A-Za-z0-9_]*)$")
# The names oneDNN gives the ops it takes over (`_MklMatMul`, `_MklNativeFusedMatMul`, ...), and
# Grappler's fusions (`_FusedMatMul`): the op a kernel computes is the name without them. oneDNN is
# on by default on CPUs with AVX-512 (and with TF_ENABLE_ONEDNN_OPTS=1 on any x86 CPU).
_RENAMED = re.compile(r"^_(?:Mkl(?:Native)?(?:Fused)?|Fused)(?=[A-Z])")
_ONEDNN = re.compile(r"^_Mkl")
# One event per compiled cluster run (XLA:CPU's executable; the launch ops of older runtimes).
_XLA_RUN = re.compile(r"(Executable::Execute|XlaLaunch|_XlaRun)")
# Events without ':' that are the runtime's own, not an XLA thunk.
_RUNTIME = {"BlockUntilReady", "ParallelFor", "ExecutorDoneCallback", "PrefetchConsume", "PrefetchProduce",
            "FunctionRun"}


# The command line's flags (`_define_flags`), None where the module is imported.
OUT = ACCUMS = MODEL_NAMES = XLA = CONTENDER_NAMES = None


def _define_flags():
    """The command line's flags, defined only when this module runs as a program: the
    tests import it beside other benchmarks whose flags share names (`out`)."""
    global OUT, ACCUMS, MODEL_NAMES, XLA, CONTENDER_NAMES
    OUT = flags.DEFINE_string("out", "docs/benchmarks/cpu", "Folder for kernel_count.json and .md.")
    ACCUMS = flags.DEFINE_list("accums", ["2", "8"], "Window lengths N.")
    MODEL_NAMES = flags.DEFINE_list("models", list(MODELS), f"Models, of {list(MODELS)}.")
    XLA = flags.DEFINE_list("xla", ["off", "on"], "XLA settings to count: off, on.")
    CONTENDER_NAMES = flags.DEFINE_list("contenders", CONTENDERS, f"Contenders, of {CONTENDERS}.")


# ------------------------------------------------------------------ counting
def _xplane_module():
    try:
        from tensorflow.tsl.profiler.protobuf import xplane_pb2
    except ImportError:     # older TensorFlow
        from tensorflow.core.profiler.protobuf import xplane_pb2
    return xplane_pb2


def count_events(space):
    """Of an XSpace: (kernels by op type, kernels under a sparse name scope or of a sparse op type,
    XLA cluster runs, XLA thunks executed)."""
    kernels, sparse, xla, thunks = {}, 0, 0, 0
    for plane in space.planes:
        names = plane.event_metadata
        for line in plane.lines:
            if line.name == "python":
                continue
            data_thread = line.name.startswith("tf_data") or "iterator_resource" in line.name
            for event in line.events:
                name = names[event.metadata_id].name
                if _XLA_RUN.search(name):
                    xla += 1
                if not data_thread and ":" not in name and name not in _RUNTIME:
                    thunks += 1
                    sparse += bool(_SPARSE_THUNK.match(name))
                match = _KERNEL.match(name)
                if not match or data_thread or "::" in name:
                    continue
                node, op = match.groups()
                kernels[op] = kernels.get(op, 0) + 1
                if "window_rows" in node or SPARSE_OPS.match(op):
                    sparse += 1
    return kernels, sparse, xla, thunks


def op_family(op):
    """The op a kernel named `op` computes, without oneDNN's and Grappler's renaming:
    `_MklMatMul`, `_MklNativeFusedMatMul` and `_FusedMatMul` are `MatMul`."""
    return _RENAMED.sub("", op)


def by_family(by_op):
    """Kernels by op type, summed over the names one op runs under (`op_family`)."""
    families = {}
    for op, n in by_op.items():
        families[op_family(op)] = families.get(op_family(op), 0) + n
    return families


def cpu():
    """The kind of CPU the counts come from: oneDNN renames and fuses ops where it is on, so
    the counts of two kinds of CPU differ (the goals compare counts from one run)."""
    flags_line = ""
    try:
        with open("/proc/cpuinfo") as f:
            flags_line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        pass
    return {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
            "avx512": " avx512f" in flags_line, "onednn_setting": os.environ.get("TF_ENABLE_ONEDNN_OPTS")}


def traced(run):
    """Runs `run()` under the profiler: {"kernels", "launching", "by_op", "sparse", "xla_runs", "xla_thunks"}."""
    import tensorflow as tf
    folder = tempfile.mkdtemp(prefix="kernel_count_")
    try:
        options = tf.profiler.experimental.ProfilerOptions(host_tracer_level=2, python_tracer_level=0,
                                                           device_tracer_level=0)
        tf.profiler.experimental.start(folder, options=options)
        try:
            run()
        finally:
            tf.profiler.experimental.stop()
        space = _xplane_module().XSpace()
        with open(glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)[0], "rb") as f:
            space.ParseFromString(f.read())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    by_op, sparse, xla, thunks = count_events(space)
    return {"kernels": sum(by_op.values()), "launching": sum(n for op, n in by_op.items() if op not in NO_LAUNCH),
            "by_op": by_op, "by_family": by_family(by_op), "sparse": sparse, "xla_runs": xla, "xla_thunks": thunks}


# ------------------------------------------------------------------ contenders
def _model(name):
    import keras
    keras.utils.set_random_seed(0)
    if name == "dense":
        layers = [keras.Input((16,))]
    else:
        layers = [keras.Input((8,), dtype="int32"), keras.layers.Embedding(1000, 32), keras.layers.Flatten()]
    layers += [keras.layers.Dense(64 if name == "dense" else 32, activation="relu") for _ in range(3)]
    return keras.Sequential(layers + [keras.layers.Dense(4)])


def _data(name):
    import numpy as np
    import tensorflow as tf
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(256, 16)).astype("float32") if name == "dense"
         else rng.integers(0, 1000, size=(256, 8)).astype("int32"))
    y = rng.integers(0, 4, size=256).astype("int32")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO_BATCH, drop_remainder=True).repeat()


def _fit_steps(contender, model, accum, xla, data):
    """A function running one of `fit`'s steps (its own `train_function`), after two windows."""
    import keras
    from tfx_gradient_accumulator.accumulator import GradientAccumulator
    if contender == "plain_b":
        optimizer = keras.optimizers.Adam(1e-3)
    elif contender == "keras_builtin":
        optimizer = keras.optimizers.Adam(1e-3, gradient_accumulation_steps=accum)
    else:
        optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), accum,
                                        measure_noise_scale=contender == "accumulator_noise_scale")
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=xla)
    model.fit(data, steps_per_epoch=2 * accum, epochs=1, verbose=0)
    iterator = iter(data)
    train = model.make_train_function()
    return lambda: train(iterator)


def _tape_loop(model, accum, xla, data):
    """The hand-written loop (tests/accumulator/reference.py's shape): (micro-step, apply)."""
    import keras
    import tensorflow as tf
    optimizer, loss_fn = keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    variables = model.trainable_variables
    optimizer.build(variables)
    buffers = [tf.Variable(tf.zeros(v.shape, v.dtype), trainable=False) for v in variables]
    iterator = iter(data)

    @tf.function(jit_compile=xla)
    def compute(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        for buffer, grad in zip(buffers, tape.gradient(loss, variables)):
            if isinstance(grad, tf.IndexedSlices):
                buffer.scatter_add(grad)
            else:
                buffer.assign_add(grad)
        return loss

    @tf.function
    def micro_step():       # the batch read outside the compiled part, as `fit` reads it
        return compute(*next(iterator))

    @tf.function(jit_compile=xla)
    def apply():
        optimizer.apply_gradients([(b / float(accum), v) for b, v in zip(buffers, variables)])
        for buffer in buffers:
            buffer.assign(tf.zeros_like(buffer))

    for _ in range(2):
        for _ in range(accum):
            micro_step()
        apply()
    return micro_step, apply


def count_cell(model_name, contender, accum, xla):
    """{"non_closing", "closing"}: each `traced`'s figures, for one cell."""
    model, data = _model(model_name), _data(model_name)
    if contender == "tape_loop":
        micro_step, apply = _tape_loop(model, accum, xla, data)
        steps = [micro_step] * (accum - 1) + [lambda: (micro_step(), apply())]
    else:
        step = _fit_steps(contender, model, accum, xla, data)
        steps = [step] * (1 if contender == "plain_b" else accum)
    counts = [traced(run) for run in steps]
    non_closing = max(counts[:-1], key=lambda c: c["kernels"]) if len(counts) > 1 else counts[0]
    return {"non_closing": non_closing, "closing": counts[-1]}


# ------------------------------------------------------------------ goals and report
def executed(step, xla, key="kernels"):
    """What a step runs: its kernels (`key`: all, or those that launch device work), and under XLA
    its XLA thunks besides."""
    return step[key] + (step["xla_thunks"] if xla == "on" else 0)


def goals(cells):
    """The goals, per (model, N, XLA, step kind): [{"goal", "model", "accum", "xla", "step", "contender",
    "count", "bound", "met", "launching", "launching_bound", "launching_met"}]; counts are `executed`."""
    by_key = {(c["model"], c["accum"], c["xla"], c["contender"]): c for c in cells if "error" not in c}
    # A TensorFlow whose XLA:CPU traces neither its runs nor its thunks (2.16) shows nothing of the
    # cluster's work (what has no ':' there is its runtime's own events): no XLA goals then.
    traces_thunks = any(c[s]["xla_runs"] for c in by_key.values() for s in ("non_closing", "closing"))
    found = []
    for (model, accum, xla, contender), cell in sorted(by_key.items()):
        if contender != "accumulator" or (xla == "on" and not traces_thunks):
            continue
        keras_cell = by_key.get((model, accum, xla, "keras_builtin"))
        noise_cell = by_key.get((model, accum, xla, "accumulator_noise_scale"))
        for step in ("non_closing", "closing"):
            common = {"model": model, "accum": accum, "xla": xla, "step": step}
            if keras_cell:
                name = "<= Keras' built-in"
                if step == "closing":
                    name = "<= Keras' built-in + the exact sparse update's own kernels"
                goal = {"goal": name, **common, "contender": "accumulator"}
                for key, prefix in (("kernels", ""), ("launching", "launching_")):
                    ours = executed(cell[step], xla, key)
                    bound = executed(keras_cell[step], xla, key) + (cell[step]["sparse"] if step == "closing" else 0)
                    goal.update({prefix + "count": ours, prefix + "bound": bound,
                                 prefix + "met": ours <= bound})
                found.append(goal)
            if noise_cell:
                goal = {"goal": f"<= {NOISE_FACTOR} x ours without it", **common,
                        "contender": "accumulator_noise_scale"}
                for key, prefix in (("kernels", ""), ("launching", "launching_")):
                    noise, ours = executed(noise_cell[step], xla, key), executed(cell[step], xla, key)
                    goal.update({prefix + "count": noise,
                                 prefix + "bound": round(NOISE_FACTOR * ours, 1),
                                 prefix + "met": noise <= NOISE_FACTOR * ours})
                found.append(goal)
    return found


def markdown(results):
    """kernel_count.md from the results."""
    lines = ["# Kernels per step", "",
             "Generated by `python -m benchmarks.kernel_count` (a part of `make bench`); do not edit. "
             "Explained in [the benchmarks page](../../benchmarks.md#kernels-per-step).", "",
             f"{results['date']}, TensorFlow {results['versions']['tensorflow']}, Keras {results['versions']['keras']}, "
             f"micro-batch b = {results['micro_batch']}.", "",
             cpu_line(results.get("cpu")), "",
             "**Method.** " + results["method"], "",
             "Models: " + "; ".join(f"`{k}`: {v}" for k, v in MODELS.items()) + ".", "",
             "## Goals", "",
             "Counts: kernels with XLA off; kernels plus XLA thunks with XLA on. The verdict is on every "
             "kernel; *launching* leaves out those that launch nothing on a GPU (" +
             ", ".join(f"`{op}`" for op in sorted(NO_LAUNCH)) + "), judged beside it.", "",
             "| model | N | XLA | step | contender | goal | count | bound | | launching | bound | |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for g in results["goals"]:
        lines.append(f"| {g['model']} | {g['accum']} | {g['xla']} | {g['step'].replace('_', '-')} | "
                     f"{LABELS[g['contender']]} | {g['goal']} | {g['count']} | {g['bound']} | "
                     f"{'met' if g['met'] else '**missed**'} | {g['launching_count']} | {g['launching_bound']} | "
                     f"{'met' if g['launching_met'] else '**missed**'} |")
    met = sum(g["met"] for g in results["goals"])
    launching = sum(g["launching_met"] for g in results["goals"])
    lines += ["", f"{met} of {len(results['goals'])} goals met ({launching} counting launching kernels only).", ""]
    for xla in ("off", "on"):
        cells = [c for c in results["cells"] if c["xla"] == xla]
        if not cells:
            continue
        lines += [f"## Kernels per step, XLA {xla}", ""]
        if xla == "on" and not any(c.get("non_closing", {}).get("xla_runs") for c in cells):
            lines += ["This TensorFlow's XLA:CPU traces neither its runs nor its thunks: the rows below are not "
                      "the cluster's work (its thunk column holds runtime events), and no XLA goal is judged (TensorFlow 2.21's does: "
                      "`python -m benchmarks.kernel_count` in the newest environment).", ""]
        if xla == "on":
            lines += ["Under XLA the step is one compiled cluster: *kernels* are those the executor runs around "
                      "it, *XLA thunks* the operations XLA:CPU's runtime executed inside it (fusions, copies, "
                      "matrix products: on a GPU, roughly its kernel launches), *runs* the cluster executions.", ""]
        extra = " XLA thunks (non-closing / closing) | runs (non-closing / closing) |" if xla == "on" else ""
        lines += ["| model | N | contender | kernels, non-closing | kernels, closing | launching, non-closing | "
                  "launching, closing | sparse (closing) |" + extra,
                  "|---|---|---|---|---|---|---|---|" + ("---|---|" if xla == "on" else "")]
        for c in cells:
            if "error" in c:
                lines.append(f"| {c['model']} | {c['accum']} | {LABELS[c['contender']]} | failed: {c['error']} | | | | |"
                             + (" | |" if xla == "on" else ""))
                continue
            row = (f"| {c['model']} | {c['accum']} | {LABELS[c['contender']]} | {c['non_closing']['kernels']} | "
                   f"{c['closing']['kernels']} | {c['non_closing']['launching']} | {c['closing']['launching']} | "
                   f"{c['closing']['sparse']} |")
            if xla == "on":
                row += (f" {c['non_closing']['xla_thunks']} / {c['closing']['xla_thunks']} |"
                        f" {c['non_closing']['xla_runs']} / {c['closing']['xla_runs']} |")
            lines.append(row)
        lines.append("")
    return "\n".join(lines)


def cpu_line(machine):
    """Which kind of CPU counted, and which op names it counts under."""
    if not machine:
        return "Counted on a CPU not recorded (before the kind of CPU was noted)."
    onednn = ("oneDNN on (its kernels counted under the names it runs them, `_MklMatMul`, "
              "`_MklNativeFusedMatMul`, ...: it fuses some ops, so its counts are lower than without it)"
              if machine["onednn"] else "oneDNN off (TensorFlow's own kernels: `MatMul`, `BiasAdd`, ...)")
    return (f"**CPU.** {machine['processor']} ({machine['machine']}, AVX-512 "
            f"{'yes' if machine['avx512'] else 'no'}), {onednn}. TensorFlow turns oneDNN on by default on CPUs "
            "with AVX-512; `TF_ENABLE_ONEDNN_OPTS=0` or `1` sets it. Every goal compares counts from one run, "
            "on one CPU.")


METHOD = ("each step runs alone under `tf.profiler.experimental` (host tracer level 2); the executor's events "
          "named `node:OpType` are counted, one per kernel executed. Level 2 leaves out the kernels TensorFlow marks "
          "inexpensive (`Const`, `Identity`, `Reshape`, `Shape`, a `cond`'s `Switch`/`Merge`: run inline on the host, "
          "no device launch) and the `tf.data` pipeline's own threads. After two whole windows, N steps are traced: "
          "non-closing = the largest of the first N - 1, closing = the N-th (the tape loop's: its micro-step and "
          "its apply). Sparse (closing): kernels under `window_rows` name scopes or of a sparse update's op types "
          "(`ResourceScatter*`, `ResourceSparse*`, `Unique*`, `UnsortedSegment*`, `ResourceGather`; under XLA its "
          "scatter, gather and sort thunks). Under XLA: the executor's kernels around the cluster, the XLA thunks "
          "XLA:CPU's runtime executed inside it, and the cluster's runs.")


def run(models, accums, xla_settings, contenders):
    """Counts every cell; the results' dict (cells, goals, method, versions)."""
    import keras
    import tensorflow as tf
    cells = []
    for model in models:
        for accum in accums:
            for xla in xla_settings:
                for contender in contenders:
                    cell = {"model": model, "accum": accum, "xla": xla, "contender": contender}
                    try:
                        cell.update(count_cell(model, contender, accum, xla == "on"))
                    except Exception as error:      # a cell that cannot run says why, the others go on
                        cell["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"
                    cells.append(cell)
                    print(json.dumps({k: (v if not isinstance(v, dict) else v["kernels"]) for k, v in cell.items()}),
                          flush=True)
    ran = [op for c in cells for step in ("non_closing", "closing") for op in c.get(step, {}).get("by_op", {})]
    machine = dict(cpu(), onednn=any(_ONEDNN.match(op) for op in ran))
    return {"date": datetime.date.today().isoformat(), "method": METHOD, "micro_batch": MICRO_BATCH, "cpu": machine,
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                         "python": platform.python_version()},
            "cells": cells, "goals": goals(cells)}


def write(results, folder):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "kernel_count.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(folder, "kernel_count.md"), "w") as f:
        f.write(markdown(results))


def main(argv):
    del argv
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    unknown = set(CONTENDER_NAMES.value) - set(CONTENDERS) | set(MODEL_NAMES.value) - set(MODELS) | (
        set(XLA.value) - {"off", "on"})
    if unknown:
        raise ValueError(f"unknown --contenders/--models/--xla values {sorted(unknown)}")
    results = run(MODEL_NAMES.value, [int(a) for a in ACCUMS.value], XLA.value, CONTENDER_NAMES.value)
    folder = OUT.value if os.path.isabs(OUT.value) else os.path.join(ROOT, OUT.value)
    write(results, folder)
    print(markdown(results))


if __name__ == "__main__":
    _define_flags()
    app.run(main)
