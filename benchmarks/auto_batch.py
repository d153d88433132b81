"""`AutoAccumulation` at its defaults against fixed effective batches, hand ramps and a KerasTuner search.

    python -m benchmarks.auto_batch                    # the full run: ~1.5-2 hours on 2 CPU cores
    python -m benchmarks.auto_batch --resume           # goes on with a cut run (auto_batch.json)
    python -m benchmarks.auto_batch --quick --tasks=digits,text   # a smoke run (~3 minutes)
    python -m benchmarks.auto_batch --check_pipeline --tasks=pydoc  # a few steps, timed, no loss shown

Three tasks (`benchmarks/auto_batch_data.py`; their recipes, fixed before any
run, in `benchmarks/auto_batch_tasks.md`): the demo's digits CNN and a causal
language model on synthetic text (both tuned on), and a byte-level language
model over the Python language reference (`pydoc`, held out: never tuned on).
Every run trains with `GradientAccumulator` at one micro-batch (16) and Adam,
so runs differ only in their effective batch and learning rate. Per task and
seed (seed s: the same initial weights and data order for every configuration):

* fixed: every effective batch 32, 64, 128, 256 at ×½, ×1, ×2 the square-root
  rule's learning rate lr(E) = lr0 × sqrt(E / 32), and at ×1 with cosine decay
  to 0 over the run (so a growing batch is not credited for annealing);
* auto: `AutoAccumulation(16, 256, start_accum_steps=2, lr_scaling="sqrt")`,
  every other argument at the library's default (recorded with the commit);
* ramp, late ramp: hand-made `AccumulationSchedule(by="update")` schedules
  doubling 32 -> 256 (equal shares of the samples; half at 32, then equal shares),
  with auto's learning-rate rule.

Each run records the validation loss at the first window boundary past every
`--evals`-th share of its samples (and auto the rule's logs along the run).
`benchmarks.auto_batch_analysis` derives the target, what each configuration
needs to reach it, bootstrap intervals and the verdicts;
`benchmarks.auto_batch_report` writes auto_batch.md and the plots. Results go
to auto_batch.json after every run, so `--resume` goes on with a cut run.

Cost: 19 configurations x 10 seeds x 3 tasks = 570 runs, plus the tuner (5
runs) and the goodput timing (a few minutes). Measured on 2 cores shared with
other work (load ~3): a digits run ~8 s, a text run ~14 s, a pydoc run ~11 s
(estimated from its per-step time and 41 evaluations of 1,457 sequences), so
~1.9 hours; less on idle cores. To fit, the digits budget is 12 passes over
899 images (the old report's 24 over 1,198) and every task tops out at an
effective batch of 256 (4 fixed batches).

`--goodput` times why updates cost: 2 worker processes on 127.0.0.1 under
MultiWorkerMirroredStrategy train the text model at accum_steps 1, 2, 4, 8;
time per sample as a ratio against accum_steps=1 in the same round.
"""

import datetime
import inspect
import json
import math
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

from benchmarks.auto_batch_analysis import final_loss, smooth  # noqa: E402  (pure Python)
from benchmarks.auto_batch_data import SETTINGS, Task, text_data, text_model  # noqa: E402  (TF imported lazily)

TASKS = tuple(SETTINGS)
GOODPUT_ACCUMS = (1, 2, 4, 8)
LR_FACTORS = (0.5, 1.0, 2.0)
# The benchmark's learning-rate rule for every run (fixed batches start at theirs; auto and the ramps scale by it).
LR_SCALING = "sqrt"
# What the rule writes into the logs at each batch's end (those present are recorded).
LOG_KEYS = ("accum_steps", "effective_batch_size", "lr_multiplier", "noise_scale", "noise_scale_preconditioned",
            "noise_scale_lower", "target_effective_batch_size")
TRACE_POINTS = 160          # at most about this many trace points per run (plus every change of the batch)

OUT = flags.DEFINE_string("out", "docs/benchmarks/cpu", "Folder for auto_batch.json, .md and the plots.")
TASKS_FLAG = flags.DEFINE_list("tasks", list(TASKS), f"Tasks, of {list(TASKS)}.")
SEEDS = flags.DEFINE_integer("seeds", 10, "Paired seeds (weights and data order) per configuration.")
EVALS = flags.DEFINE_integer("evals", 40, "Validation evaluations per run.")
RESUME = flags.DEFINE_bool("resume", False, "Go on with the runs of an existing auto_batch.json of the same plan.")
TUNER = flags.DEFINE_bool("tuner", True, "Run the KerasTuner search against one auto run (digits, seed 0).")
GOODPUT = flags.DEFINE_bool("goodput", True, "Time accum_steps 1, 2, 4, 8 on 2 worker processes.")
GOODPUT_ROUNDS = flags.DEFINE_integer("goodput_rounds", 11, "Interleaved rounds of the goodput timing.")
GOODPUT_MICRO_STEPS = flags.DEFINE_integer("goodput_micro_steps", 128, "Micro-steps per cell and round "
                                           "(a multiple of 8).")
GOODPUT_WIDTH = flags.DEFINE_integer("goodput_width", 128, "The text model's width for the goodput timing.")
GOODPUT_ONLY = flags.DEFINE_bool("goodput_only", False, "Re-run the goodput timing alone and replace its part of "
                                 "an existing auto_batch.json (the training runs' figures stay).")
QUICK = flags.DEFINE_bool("quick", False, "A smoke run: 2 seeds, a fifth of the samples, batches 32 and 256 at ×1 "
                          "and cosine only, 2 goodput rounds.")
CHECK_PIPELINE = flags.DEFINE_bool("check_pipeline", False, "Train a few micro-steps of each --tasks at a fixed "
                                   "batch and time them; shows no loss (for the held-out task).")
REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Rewrite the report and plots from auto_batch.json.")
REVISED = flags.DEFINE_bool("revised_auto", False, "Add to an existing auto_batch.json the runs of the rule at the "
                            "library's current commit, as the configuration 'auto (revised)' (the first 'auto' and "
                            "every other configuration stay as they were run).")
WORKER = flags.DEFINE_bool("goodput_worker", False, "Internal: one goodput worker (TF_CONFIG set).")


def _check_flags():
    unknown = set(TASKS_FLAG.value) - set(TASKS)
    if unknown:
        raise app.UsageError(f"--tasks: unknown {sorted(unknown)}; choose from {list(TASKS)}")
    if SEEDS.value < 2:
        raise app.UsageError(f"--seeds must be >= 2 (the intervals resample seeds); received {SEEDS.value}")
    if EVALS.value < 2:
        raise app.UsageError(f"--evals must be >= 2; received {EVALS.value}")
    if GOODPUT_ROUNDS.value < 2:
        raise app.UsageError(f"--goodput_rounds must be >= 2 (ratios need spread); received {GOODPUT_ROUNDS.value}")
    if GOODPUT_MICRO_STEPS.value < 8 or GOODPUT_MICRO_STEPS.value % max(GOODPUT_ACCUMS):
        raise app.UsageError(f"--goodput_micro_steps must be a positive multiple of {max(GOODPUT_ACCUMS)}; "
                             f"received {GOODPUT_MICRO_STEPS.value}")


def _seeds():
    return list(range(2 if QUICK.value else SEEDS.value))


def make_task(name):
    return Task(name, budget_share=0.2 if QUICK.value else 1.0)


# ------------------------------------------------------------------ the rule (the one place that knows its API)
def rule_defaults() -> dict:
    """AutoAccumulation's keyword defaults in this library (what auto runs with), JSON-able."""
    from tfx_gradient_accumulator.accumulator import AutoAccumulation
    parameters = inspect.signature(AutoAccumulation.__init__).parameters
    return {name: p.default for name, p in parameters.items()
            if p.default is not inspect.Parameter.empty and isinstance(p.default, (int, float, str, type(None)))}


def make_auto_rule(task):
    """`AutoAccumulation` from the smallest to the largest effective batch at `LR_SCALING`, the rest its defaults."""
    from tfx_gradient_accumulator.accumulator import AutoAccumulation
    s = task.settings
    return AutoAccumulation(s["micro"], s["max"], start_accum_steps=s["start"] // s["micro"], lr_scaling=LR_SCALING)


def make_ramp(schedule):
    """`AccumulationSchedule(schedule, by="update")` with auto's learning-rate rule (and its default ramp)."""
    from tfx_gradient_accumulator.accumulator import AccumulationSchedule
    kwargs = {"lr_scaling": LR_SCALING}
    defaults = rule_defaults()
    if "lr_ramp_updates" in inspect.signature(AccumulationSchedule.__init__).parameters \
            and "lr_ramp_updates" in defaults:
        kwargs["lr_ramp_updates"] = defaults["lr_ramp_updates"]
    return AccumulationSchedule(schedule, by="update", **kwargs)


# ------------------------------------------------------------------ configurations
def ramp_schedule(task, late=False):
    """{update: accum_steps}: doubling from the smallest to the largest batch in equal shares of the samples
    (`late`: half the samples at the smallest, the other half in equal shares)."""
    s, batches = task.settings, task.batches()
    if late:
        shares = [task.budget / 2] + [task.budget / 2 / (len(batches) - 1)] * (len(batches) - 1)
    else:
        shares = [task.budget / len(batches)] * len(batches)
    schedule, update = {}, 0.0
    for e, share in zip(batches, shares):
        schedule[int(round(update))] = e // s["micro"]
        update += share / e
    return schedule


def _batches(task):
    """The fixed effective batches (--quick: the smallest and the largest)."""
    batches = task.batches()
    return [batches[0], batches[-1]] if QUICK.value else batches


REVISED_LABEL = "auto (revised)"


def configurations(task) -> list:
    """Every configuration of a task: [{"label", "kind", ...}] (fixed, auto, ramps); with --revised_auto,
    only the rule at the library's current commit, its commit and defaults recorded."""
    if REVISED.value:
        return [{"label": REVISED_LABEL, "kind": "auto", "code": _commit(), "rule_defaults": rule_defaults()}]
    batches = _batches(task)
    out = []
    for e in batches:
        for factor in (1.0,) if QUICK.value else LR_FACTORS:
            out.append({"label": f"fixed {e} ×{factor:g}", "kind": "fixed", "effective_batch": e,
                        "lr_factor": factor, "decay": False})
        out.append({"label": f"fixed {e} cosine", "kind": "fixed", "effective_batch": e, "lr_factor": 1.0,
                    "decay": True})
    out.append({"label": "auto", "kind": "auto"})
    out.append({"label": "ramp", "kind": "ramp", "schedule": ramp_schedule(task)})
    out.append({"label": "late ramp", "kind": "ramp", "schedule": ramp_schedule(task, late=True)})
    return out


# ------------------------------------------------------------------ one run
def _finite(value, digits=5):
    """`value` to `digits` significant digits (the JSON stays small), None where not finite."""
    value = float(value)
    return float(f"{value:.{digits}g}") if math.isfinite(value) else None


def _recorder(task, evaluate, trace_every):
    """Evaluates at window boundaries past every share of the samples, traces the logs, stops at the budget."""
    import keras
    micro, budget = task.settings["micro"], task.budget
    every = budget / EVALS.value

    class Recorder(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.micro_batches, self.next, self.points, self.trace, self.last = 0, every, [], [], {}
            self._evaluate(0, {})

        def _state(self, samples, logs):
            optimizer = self.model.optimizer
            point = {"samples": samples, "updates": int(optimizer.iterations.numpy()),
                     "effective_batch": int(optimizer.accum_steps) * micro}
            for key in LOG_KEYS:
                if key in logs:
                    point[key] = _finite(logs[key])
            return point

        def _evaluate(self, samples, logs):
            loss = float(evaluate())
            self.points.append({**self._state(samples, logs), "val_loss": _finite(loss, 6) if math.isfinite(loss) else loss})

        def on_train_batch_end(self, batch, logs=None):
            self.micro_batches += 1
            optimizer = self.model.optimizer
            if optimizer.held_micro_batches:
                return
            samples, logs = self.micro_batches * micro, logs or {}
            updates = int(optimizer.iterations.numpy())
            if trace_every and (updates % trace_every == 0 or optimizer.accum_steps != self.last.get("accum")):
                self.trace.append(self._state(samples, logs))
                self.last["accum"] = optimizer.accum_steps
            if samples >= self.next or samples >= budget:
                self._evaluate(samples, logs)
                while self.next <= samples:
                    self.next += every
            if samples >= budget:
                self.model.stop_training = True

    return Recorder()


def _optimizer(task, config):
    import keras

    from tfx_gradient_accumulator.accumulator import GradientAccumulator
    s = task.settings
    first = config.get("effective_batch") or s["start"]
    lr = task.lr(first) * config.get("lr_factor", 1.0)
    if config.get("decay"):
        lr = keras.optimizers.schedules.CosineDecay(lr, decay_steps=max(1, task.budget // first))
    return GradientAccumulator(keras.optimizers.Adam(lr), first // s["micro"], schedulable=True,
                               measure_noise_scale=True)


def train(task, seed, config, model=None, callbacks=()):
    """One run of `config` ({"kind": "fixed" | "auto" | "ramp", ...}); {"seed", "curve", "trace", "schedule", "seconds"}.

    `model`: one built after `keras.utils.set_random_seed(seed)` (default: built here).
    `callbacks`: more of `fit`'s callbacks, run after the rule or ramp and before the
    recorder (adam_moment.py's probe reads the optimizer there)."""
    import keras
    import tensorflow as tf

    s = task.settings
    keras.utils.set_random_seed(seed)
    if model is None:
        model = task.build()
    model.compile(optimizer=_optimizer(task, config), loss=task.loss)
    x_val, y_val = task.x_val, task.y_val

    @tf.function
    def evaluate():
        return task.loss(y_val, model(x_val, training=False))

    extra, callbacks, rule = list(callbacks), [], None
    if config["kind"] == "auto":
        rule = make_auto_rule(task)
        callbacks.append(rule)
    elif config["kind"] == "ramp":
        callbacks.append(make_ramp(config["schedule"]))
    callbacks += extra
    trace_every = max(1, task.budget // s["start"] // TRACE_POINTS) if config["kind"] == "auto" else 0
    recorder = _recorder(task, evaluate, trace_every)
    callbacks.append(recorder)
    started = time.perf_counter()
    model.fit(task.dataset(seed), steps_per_epoch=task.budget // s["micro"] + s["max"] // s["micro"], epochs=1,
              verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - started
    first = config.get("effective_batch") or s["start"]
    done = rule.schedule if rule is not None else (config.get("schedule") or {0: first // s["micro"]})
    return {"seed": seed, "curve": recorder.points, "trace": recorder.trace,
            "schedule": {str(k): int(v) for k, v in done.items()}, "seconds": round(seconds, 1)}


# ------------------------------------------------------------------ the runs, resumable
class Progress:
    """Counts runs and logs each with an ETA (mean wall seconds of this task's runs so far × those left)."""

    def __init__(self, total_by_task):
        self.left = dict(total_by_task)
        self.seconds = {name: [] for name in total_by_task}
        self.done = 0
        self.total = sum(total_by_task.values())
        self.started = time.perf_counter()

    def ran(self, task, label, run):
        self.left[task.name] -= 1
        self.done += 1
        self.seconds[task.name].append(run.get("wall", run["seconds"]))
        every = [s for v in self.seconds.values() for s in v]
        mean = sum(every) / len(every)
        eta = sum(n * (sum(self.seconds[t]) / len(self.seconds[t]) if self.seconds[t] else mean)
                  for t, n in self.left.items())
        last = run["curve"][-1]
        logging.info("[%d/%d] %s %-16s seed %d: %d samples, %d updates, final batch %d (%.0f s); ETA %s",
                     self.done, self.total, task.name, label, run["seed"], last["samples"], last["updates"],
                     last["effective_batch"], run.get("wall", run["seconds"]), _hms(eta))


def _hms(seconds):
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _save(results, path):
    with open(path + ".partial", "w") as f:
        json.dump(results, f, indent=None, separators=(",", ":"))
    os.replace(path + ".partial", path)


def plan() -> dict:
    """What decides the runs' figures; --resume refuses a JSON of another plan."""
    return {"quick": QUICK.value, "seeds": len(_seeds()), "evals": EVALS.value,
            "settings": {name: SETTINGS[name] for name in TASKS_FLAG.value}}


def run_tasks(results, path):
    """Every configuration of every task, seed-major (a cut run has whole seeds), saved after each run."""
    tasks = {name: make_task(name) for name in TASKS_FLAG.value}
    configs = {name: configurations(task) for name, task in tasks.items()}
    for name, task in tasks.items():
        entry = results["tasks"].setdefault(name, {**task.record(), "runs": {}})
        logging.info("%s: %s; %d samples per run (%.2f passes), micro-batch %d", name, task.description,
                     task.budget, task.budget / task.train_size, task.settings["micro"])
        for config in configs[name]:
            entry["runs"].setdefault(config["label"], {**{k: v for k, v in config.items() if k != "schedule"},
                                                       "schedule": config.get("schedule"), "lr": None, "runs": []})
    todo = {name: [(seed, c) for seed in _seeds() for c in configs[name]
                   if seed not in {r["seed"] for r in results["tasks"][name]["runs"][c["label"]]["runs"]}]
            for name in tasks}
    progress = Progress({name: len(v) for name, v in todo.items()})
    for name, task in tasks.items():
        for seed, config in todo[name]:
            started = time.perf_counter()
            run = train(task, seed, config)
            run["wall"] = round(time.perf_counter() - started, 1)
            entry = results["tasks"][name]["runs"][config["label"]]
            entry["lr"] = task.lr(config.get("effective_batch") or task.settings["start"]) * config.get("lr_factor", 1)
            entry["runs"] = sorted(entry["runs"] + [run], key=lambda r: r["seed"])
            _save(results, path)
            progress.ran(task, config["label"], run)


# ------------------------------------------------------------------ KerasTuner
def run_tuner(task_name="digits", seed=0):
    """A KerasTuner grid over fixed effective batches (×1, constant), each trial the full budget; against one auto run."""
    import keras_tuner

    task = make_task(task_name)
    grid = _batches(task)
    trials = []

    class BatchSearch(keras_tuner.HyperModel):
        def build(self, hp):
            hp.Choice("effective_batch_size", grid)
            import keras
            keras.utils.set_random_seed(seed)
            return task.build()

        def fit(self, hp, model, *args, **kwargs):
            effective = hp.get("effective_batch_size")
            run = train(task, seed, {"kind": "fixed", "effective_batch": effective}, model=model)
            logging.info("tuner: fixed %d, seed %d: %.0f s", effective, seed, run["seconds"])
            final = final_loss(smooth(run["curve"]))
            trials.append({"effective_batch": effective, "samples": run["curve"][-1]["samples"],
                           "final_val_loss": final, "seconds": run["seconds"]})
            return final

    with tempfile.TemporaryDirectory() as directory:
        tuner = keras_tuner.GridSearch(BatchSearch(), objective=keras_tuner.Objective("val_loss", "min"),
                                       max_trials=len(grid), directory=directory, project_name="batch",
                                       overwrite=True, seed=seed)
        tuner.search(verbose=0)
        best = tuner.get_best_hyperparameters(1)[0].get("effective_batch_size")
    auto = train(task, seed, {"kind": "auto"})
    logging.info("tuner: auto, seed %d: %.0f s", seed, auto["seconds"])
    return {"task": task_name, "seed": seed, "grid": grid, "trials": trials, "best_effective_batch": best,
            "search_samples": sum(t["samples"] for t in trials),
            "auto": {"samples": auto["curve"][-1]["samples"], "final_val_loss": final_loss(smooth(auto["curve"])),
                     "schedule": auto["schedule"], "seconds": auto["seconds"]}}


# ------------------------------------------------------------------ a pipeline check (no loss shown)
def check_pipeline(micro_steps=32):
    """Trains `micro_steps` micro-steps of each task at its smallest fixed batch and times them; no loss is read."""
    import keras
    import tensorflow as tf
    for name in TASKS_FLAG.value:
        task = make_task(name)
        keras.utils.set_random_seed(0)
        model = task.build()
        model.compile(optimizer=_optimizer(task, {"kind": "fixed", "effective_batch": task.settings["start"]}),
                      loss=task.loss)
        data = task.dataset(0)
        model.fit(data, steps_per_epoch=4, epochs=1, verbose=0)             # trace
        started = time.perf_counter()
        model.fit(data, steps_per_epoch=micro_steps, epochs=1, verbose=0)
        per_step = (time.perf_counter() - started) / micro_steps
        evaluate = tf.function(lambda: task.loss(task.y_val, model(task.x_val, training=False)))
        evaluate()
        started = time.perf_counter()
        evaluate()
        per_eval = time.perf_counter() - started
        steps = task.budget // task.settings["micro"]
        logging.info("%s: %s; budget %d samples (%d micro-steps): %.1f ms per micro-step, %.0f ms per evaluation, "
                     "so ~%.0f s of steps and %.0f s of evaluations per run; facts %s", name, task.description,
                     task.budget, steps, per_step * 1e3, per_eval * 1e3, per_step * steps, per_eval * EVALS.value,
                     task.facts)


# ------------------------------------------------------------------ goodput (2 workers)
def goodput_worker():
    """One worker of the goodput timing: prints its figures as the last JSON line."""
    import keras
    import numpy as np
    import tensorflow as tf

    from tfx_gradient_accumulator.accumulator import GradientAccumulator, strategy_from_environment

    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    strategy = strategy_from_environment()
    workers = strategy.num_replicas_in_sync
    micro = SETTINGS["text"]["micro"]
    x, y, _, _, _ = text_data(train=2048, val=1)
    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(micro * workers, drop_remainder=True)
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    built = {}
    for accum in GOODPUT_ACCUMS:
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = text_model(width=GOODPUT_WIDTH.value)
            optimizer = GradientAccumulator(keras.optimizers.Adam(1e-3), accum)
            optimizer.build(model.trainable_variables)
        iterator = iter(strategy.experimental_distribute_dataset(data))

        def make(model, optimizer, iterator):
            @tf.function
            def micro_step():
                def replica(xb, yb):
                    with tf.GradientTape() as tape:
                        loss = tf.nn.compute_average_loss(tf.reduce_mean(per_example(yb, model(xb, training=True)), -1),
                                                          global_batch_size=micro * workers)
                    grads = tape.gradient(loss, model.trainable_variables)
                    optimizer.apply_gradients(zip(grads, model.trainable_variables))
                strategy.run(replica, args=next(iterator))

            def steps(n):
                for _ in range(n):
                    micro_step()
                return int(optimizer.iterations.numpy())
            return steps

        built[accum] = make(model, optimizer, iterator)
        built[accum](2 * max(GOODPUT_ACCUMS))      # trace and warm
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables))
    n = GOODPUT_MICRO_STEPS.value
    rounds = 2 if QUICK.value else GOODPUT_ROUNDS.value
    seconds = {accum: [] for accum in GOODPUT_ACCUMS}
    for r in range(rounds):
        order = list(GOODPUT_ACCUMS) if r % 2 == 0 else list(GOODPUT_ACCUMS)[::-1]   # the same on every worker
        for accum in order:
            started = time.perf_counter()
            built[accum](n)
            seconds[accum].append(time.perf_counter() - started)
    print(json.dumps({"workers": workers, "micro_per_worker": micro, "micro_steps_per_cell": n,
                      "params": params, "width": GOODPUT_WIDTH.value, "rounds": rounds,
                      "seconds": {str(k): v for k, v in seconds.items()}}))


def run_goodput():
    """Starts 2 goodput workers on 127.0.0.1; worker 0's figures."""
    import portpicker
    cluster = {"worker": [f"127.0.0.1:{portpicker.pick_unused_port()}" for _ in range(2)]}
    args = [f"--goodput_rounds={GOODPUT_ROUNDS.value}", f"--goodput_micro_steps={GOODPUT_MICRO_STEPS.value}",
            f"--goodput_width={GOODPUT_WIDTH.value}"] + (["--quick"] if QUICK.value else [])
    logging.info("goodput: 2 worker processes on 127.0.0.1, accum_steps %s", list(GOODPUT_ACCUMS))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "benchmarks.auto_batch", "--goodput_worker", *args], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow",
                 TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})))
        for i in range(2)]
    try:
        outputs = [p.communicate(timeout=900) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise
    if any(p.returncode for p in procs):
        raise RuntimeError("goodput workers failed:\n" + "\n".join(e[-3000:] for _, e in outputs))
    return json.loads(outputs[0][0].strip().splitlines()[-1])


# ------------------------------------------------------------------ main
def _commit():
    """The library's commit (and whether the tree has changes), for the report."""
    def git(*args):
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None
    return {"commit": git("rev-parse", "HEAD"), "subject": git("log", "-1", "--format=%s"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def _start(path):
    """The results so far: a new record, or (--resume) the one at `path` if it is of the same plan."""
    import keras
    import tensorflow as tf
    if REVISED.value and not os.path.exists(path):
        raise app.UsageError(f"--revised_auto adds to an existing {path}: run the benchmark first")
    if (RESUME.value or REVISED.value) and os.path.exists(path):
        with open(path) as f:
            results = json.load(f)
        if results.get("plan") != json.loads(json.dumps(plan())):
            raise app.UsageError(f"--resume: {path} is of another plan ({results.get('plan')}); "
                                 "run without --resume to start over")
        if RESUME.value:
            results.setdefault("resumed", []).append(datetime.datetime.now().isoformat(timespec="seconds"))
        return results
    return {"date": datetime.date.today().isoformat(), "plan": plan(), "code": _commit(),
            "rule_defaults": rule_defaults(),
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                         "python": platform.python_version()},
            "cpus": os.cpu_count(), "load_at_start": [round(v, 2) for v in os.getloadavg()],
            "settings": {"seeds": len(_seeds()), "evals": EVALS.value, "quick": QUICK.value,
                         "lr_factors": list(LR_FACTORS), "lr_scaling": LR_SCALING},
            "tasks": {}}


def _measure(path):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    started = time.perf_counter()
    results = _start(path)
    _save(results, path)
    run_tasks(results, path)
    if TUNER.value and "digits" in TASKS_FLAG.value and not results.get("tuner") and not REVISED.value:
        results["tuner"] = run_tuner()
        _save(results, path)
    if GOODPUT.value and not results.get("goodput") and not REVISED.value:
        results["goodput"] = run_goodput()
    key = "revised_wall_seconds" if REVISED.value else "wall_seconds"
    if not REVISED.value:
        results["load_at_end"] = [round(v, 2) for v in os.getloadavg()]
    results[key] = round(results.get(key, 0) + time.perf_counter() - started, 1)
    _save(results, path)
    return results


def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    if WORKER.value:
        goodput_worker()
        return
    _check_flags()
    if CHECK_PIPELINE.value:
        check_pipeline()
        return
    from benchmarks import auto_batch_report
    folder = os.path.join(ROOT, OUT.value) if not os.path.isabs(OUT.value) else OUT.value
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "auto_batch.json")
    if REPORT_ONLY.value or GOODPUT_ONLY.value:
        if not os.path.exists(path):
            raise app.UsageError(f"--report_only/--goodput_only need an existing {path}")
        with open(path) as f:
            results = json.load(f)
        if GOODPUT_ONLY.value:
            results["goodput"] = run_goodput()
            results["goodput"]["date"] = datetime.date.today().isoformat()
            _save(results, path)
    else:
        results = _measure(path)
    summary = auto_batch_report.write(results, folder)
    print(json.dumps(summary))
    logging.info("wrote %s", os.path.join(folder, "auto_batch.md"))


if __name__ == "__main__":
    app.run(main)
