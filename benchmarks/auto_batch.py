"""`AutoAccumulation` against fixed effective batches, a hand ramp and a KerasTuner search.

    python -m benchmarks.auto_batch            # ~18 minutes on 2 shared CPU cores
    python -m benchmarks.auto_batch --quick    # a smoke run (~3 minutes)

Two tasks: the demo's digits CNN (`pipelines.digits.model.build_model`) on the
shipped 8x8 digits (the demo's two thirds for training, the rest for
validation), and a small causal language model (token embedding, two causal
convolutions) on synthetic text drawn from a fixed random trigram source.
Every run trains with `GradientAccumulator` at one micro-batch, so runs differ
only in their effective batch (accum_steps x micro-batch), for the same number
of samples, with Adam and one learning-rate rule for all: the square-root rule,
lr(E) = lr0 x sqrt(E / E0), E0 the smallest effective batch (`lr_scaling="sqrt"`
for the ramp and auto; fixed batches start at their lr(E)). Per task and seed:

* auto: `AutoAccumulation` from E0 up to the largest batch;
* fixed: every effective batch from E0 to the largest, doubling (among them
  the smallest, the one auto ended with and the largest);
* auto's variants (`--auto_variants`): other margin/patience/growth settings,
  shown next to the headline setting (the library's defaults);
* ramp: a hand-made `AccumulationSchedule(by="update")` that doubles the
  effective batch from E0 to the largest in equal shares of the samples.

Each run records the validation loss after the first update past every
`--evals`-th share of its samples. `benchmarks.auto_batch_analysis` derives the
target (the best fixed batch's final validation loss), the samples and updates
each run needs to reach it, and the verdicts. A KerasTuner grid search over
the effective batch (seed 0, digits) is set against one auto run: the samples
each spends, and the final validation loss each ends with.

`--goodput` (on by default) times why updates cost: 2 worker processes on
127.0.0.1 under MultiWorkerMirroredStrategy (TF_CONFIG) train the text model at
accum_steps 1, 2, 4, 8 at one micro-batch, interleaved rounds, one all-reduce
per update; time per sample as a ratio against accum_steps=1 in the same round.

Writes <out>/auto_batch.json, auto_batch.md, auto_batch.png and
auto_batch_goodput.png (`--report_only` rewrites the last three from the JSON).
"""

import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags, logging

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.auto_batch_analysis import final_loss, smooth  # noqa: E402  (pure Python)

TASKS = ("digits", "text")
GOODPUT_ACCUMS = (1, 2, 4, 8)

OUT = flags.DEFINE_string("out", "docs/benchmarks/cpu", "Folder for auto_batch.json, .md and the plots.")
TASKS_FLAG = flags.DEFINE_list("tasks", list(TASKS), f"Tasks, of {list(TASKS)}.")
SEEDS = flags.DEFINE_integer("seeds", 3, "Seeds per configuration (weights and shuffling).")
EPOCHS = flags.DEFINE_float("epochs", None, "Samples per run in passes over the training set "
                            "(default: digits 24, text 5; --quick: a fifth).")
EVALS = flags.DEFINE_integer("evals", 40, "Validation evaluations per run.")
MARGIN = flags.DEFINE_float("margin", 2.0, "AutoAccumulation's margin.")
PATIENCE = flags.DEFINE_integer("patience", 3, "AutoAccumulation's patience.")
GROWTH = flags.DEFINE_integer("growth", 2, "AutoAccumulation's growth.")
LR_SCALING = flags.DEFINE_enum("lr_scaling", "sqrt", ["sqrt", "linear", "none"],
                               "The learning-rate rule of every run (auto, ramp, fixed batches).")
AUTO_VARIANTS = flags.DEFINE_list("auto_variants", ["4:3:2", "8:10:2"],
                                  "Other AutoAccumulation settings to run alongside, as margin:patience:growth "
                                  "(the report's verdicts are those of --margin/--patience/--growth).")
TUNER = flags.DEFINE_bool("tuner", True, "Run the KerasTuner search against one auto run (digits, seed 0).")
GOODPUT = flags.DEFINE_bool("goodput", True, "Time accum_steps 1, 2, 4, 8 on 2 worker processes.")
GOODPUT_ROUNDS = flags.DEFINE_integer("goodput_rounds", 11, "Interleaved rounds of the goodput timing.")
GOODPUT_MICRO_STEPS = flags.DEFINE_integer("goodput_micro_steps", 128, "Micro-steps per cell and round "
                                           "(a multiple of 8).")
GOODPUT_WIDTH = flags.DEFINE_integer("goodput_width", 128, "The text model's width for the goodput timing.")
GOODPUT_ONLY = flags.DEFINE_bool("goodput_only", False, "Re-run the goodput timing alone and replace its part of "
                                 "an existing auto_batch.json (the training runs' figures stay).")
QUICK = flags.DEFINE_bool("quick", False, "A smoke run: 1 seed, a fifth of the samples, 2 goodput rounds.")
REPORT_ONLY = flags.DEFINE_bool("report_only", False, "Rewrite the report and plots from auto_batch.json.")
WORKER = flags.DEFINE_bool("goodput_worker", False, "Internal: one goodput worker (TF_CONFIG set).")

# Per task: micro-batch, smallest and largest effective batch, lr0 at the smallest, default passes.
SETTINGS = {
    "digits": {"micro": 16, "start": 32, "max": 256, "lr0": 7e-3, "epochs": 24},
    "text": {"micro": 16, "start": 32, "max": 512, "lr0": 1e-2, "epochs": 5},
}
TEXT = {"vocab": 32, "length": 24, "train": 8192, "val": 512, "width": 64, "concentration": 0.1}


def _check_flags():
    unknown = set(TASKS_FLAG.value) - set(TASKS)
    if unknown:
        raise app.UsageError(f"--tasks: unknown {sorted(unknown)}; choose from {list(TASKS)}")
    if SEEDS.value < 1:
        raise app.UsageError(f"--seeds must be >= 1; received {SEEDS.value}")
    if EPOCHS.value is not None and not EPOCHS.value > 0:
        raise app.UsageError(f"--epochs must be > 0; received {EPOCHS.value}")
    if EVALS.value < 2:
        raise app.UsageError(f"--evals must be >= 2; received {EVALS.value}")
    if GROWTH.value < 2 or PATIENCE.value < 1 or not MARGIN.value > 0:
        raise app.UsageError("--growth must be >= 2, --patience >= 1 and --margin > 0")
    for variant in AUTO_VARIANTS.value:
        _variant(variant)
    if GOODPUT_ROUNDS.value < 2:
        raise app.UsageError(f"--goodput_rounds must be >= 2 (ratios need spread); received {GOODPUT_ROUNDS.value}")
    if GOODPUT_MICRO_STEPS.value < 8 or GOODPUT_MICRO_STEPS.value % max(GOODPUT_ACCUMS):
        raise app.UsageError(f"--goodput_micro_steps must be a positive multiple of {max(GOODPUT_ACCUMS)}; "
                             f"received {GOODPUT_MICRO_STEPS.value}")


def _variant(text):
    """"margin:patience:growth" -> (float, int, int), or a usage error naming the flag."""
    try:
        margin, patience, growth = text.split(":")
        margin, patience, growth = float(margin), int(patience), int(growth)
    except ValueError:
        raise app.UsageError(f"--auto_variants: {text!r} is not margin:patience:growth (e.g. 4:3:2)") from None
    if not margin > 0 or patience < 1 or growth < 2:
        raise app.UsageError(f"--auto_variants: {text!r} needs margin > 0, patience >= 1, growth >= 2")
    return margin, patience, growth


# ------------------------------------------------------------------ tasks
def digits_data():
    """(train features, train labels, val features, val labels): the demo's split of the digits."""
    import numpy as np
    from sklearn.datasets import load_digits

    from tfx_gradient_accumulator.pipelines.digits.data import FEATURE_KEYS

    digits = load_digits()
    order = np.random.RandomState(0).permutation(len(digits.target))
    cut = 2 * len(order) // 3
    images, labels = digits.data.astype("float32"), digits.target.astype("int64")[:, None]

    def features(rows):
        return {key: images[rows, i:i + 1] for i, key in enumerate(FEATURE_KEYS)}

    return features(order[:cut]), labels[order[:cut]], features(order[cut:]), labels[order[cut:]]


def text_data(vocab=TEXT["vocab"], length=TEXT["length"], train=TEXT["train"], val=TEXT["val"],
              concentration=TEXT["concentration"], seed=1234):
    """Sequences from a fixed random trigram source: (train x, train y, val x, val y, entropy rate in nats).

    Every pair of tokens has its own next-token distribution, drawn once from a
    Dirichlet(`concentration`) (peaked: the text is learnable, not deterministic);
    y is x shifted by one token."""
    import numpy as np
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(vocab, concentration), size=(vocab, vocab))
    cumulative = table.cumsum(-1)
    n = train + val
    tokens = np.zeros((n, length + 1), dtype="int32")
    tokens[:, :2] = rng.integers(0, vocab, size=(n, 2))
    for t in range(2, length + 1):
        u = rng.random(n)[:, None]
        rows = cumulative[tokens[:, t - 2], tokens[:, t - 1]]
        tokens[:, t] = np.minimum((u > rows).sum(-1), vocab - 1)
    entropy = float(-(table * np.log(np.maximum(table, 1e-12))).sum(-1).mean())
    x, y = tokens[:, :-1], tokens[:, 1:]
    return x[:train], y[:train], x[train:], y[train:], entropy


def text_model(vocab=TEXT["vocab"], width=TEXT["width"], length=TEXT["length"]):
    """A small causal language model: embedding, two causal convolutions, next-token logits."""
    import keras
    inputs = keras.Input((length,), dtype="int32")
    x = keras.layers.Embedding(vocab, width)(inputs)
    x = keras.layers.Conv1D(width, 3, padding="causal", activation="relu")(x)
    x = keras.layers.Conv1D(width, 3, padding="causal", activation="relu")(x)
    return keras.Model(inputs, keras.layers.Dense(vocab)(x))


class Task:
    """The data, the model and the validation loss of one task."""

    def __init__(self, name):
        import keras
        self.name = name
        self.settings = dict(SETTINGS[name])
        if name == "digits":
            self.x, self.y, self.x_val, self.y_val = digits_data()
            self.loss = keras.losses.SparseCategoricalCrossentropy()
            self.description = ("the demo's digits CNN (2 convolutions with AccumBatchNormalization, 64 "
                                "per-pixel inputs) on the 8x8 digits: 1,198 training, 599 validation images")
            self.entropy = None
        else:
            self.x, self.y, self.x_val, self.y_val, self.entropy = text_data()
            self.loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
            self.description = (f"a causal language model (embedding {TEXT['width']}, two causal convolutions "
                                f"of width 3, {TEXT['vocab']}-token vocabulary) on synthetic text from a fixed "
                                f"random trigram source: {TEXT['train']:,} training and {TEXT['val']:,} "
                                f"validation sequences of {TEXT['length']} tokens (entropy rate "
                                f"{self.entropy:.3f} nats/token, the lowest loss possible)")
        self.train_size = len(self.y)
        epochs = EPOCHS.value or self.settings["epochs"] / (5 if QUICK.value else 1)
        micro, largest = self.settings["micro"], self.settings["max"]
        self.budget = max(largest, int(round(epochs * self.train_size / largest)) * largest)

    def build(self):
        """A fresh model (the seed set before)."""
        if self.name == "digits":
            import keras_tuner

            from tfx_gradient_accumulator.pipelines.digits.model import build_model
            hp = keras_tuner.HyperParameters()
            hp.Fixed("learning_rate", self.settings["lr0"])
            return build_model(hp)
        return text_model()

    def dataset(self, seed):
        import tensorflow as tf
        return (tf.data.Dataset.from_tensor_slices((self.x, self.y))
                .shuffle(self.train_size, seed=seed, reshuffle_each_iteration=True).repeat()
                .batch(self.settings["micro"], drop_remainder=True).prefetch(2))

    def lr(self, effective):
        from tfx_gradient_accumulator.accumulator.lr_scaling import lr_multiplier
        return self.settings["lr0"] * lr_multiplier(LR_SCALING.value, effective, self.settings["start"])


# ------------------------------------------------------------------ one run
def _recorder(task, evaluate):
    """A callback that evaluates at window boundaries past every share of the samples and stops at the budget."""
    import keras
    micro, budget = task.settings["micro"], task.budget
    every = budget / EVALS.value

    class Recorder(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            self.micro_batches, self.next, self.points = 0, every, []
            self._record(0)

        def _record(self, samples):
            optimizer = self.model.optimizer
            noise = float(optimizer.noise_scale)
            self.points.append({"samples": samples, "updates": int(optimizer.iterations.numpy()),
                                "val_loss": float(evaluate()),
                                "effective_batch": int(optimizer.accum_steps) * micro,
                                "noise_scale": noise if math.isfinite(noise) else None})

        def on_train_batch_end(self, batch, logs=None):
            self.micro_batches += 1
            if self.model.optimizer.held_micro_batches:
                return
            samples = self.micro_batches * micro
            if samples >= self.next or samples >= budget:
                self._record(samples)
                while self.next <= samples:
                    self.next += every
            if samples >= budget:
                self.model.stop_training = True

    return Recorder()


def train(task, seed, kind, effective=None, schedule=None, model=None, rule_settings=None):
    """One run; returns {"curve", "schedule", "seconds"}.

    kind: "fixed" (at `effective`), "ramp" (`schedule` by update) or "auto";
    `model`: one built after `keras.utils.set_random_seed(seed)` (default: built here);
    `rule_settings`: auto's (margin, patience, growth) (default: the flags')."""
    import keras
    import tensorflow as tf

    from tfx_gradient_accumulator.accumulator import AccumulationSchedule, AutoAccumulation, GradientAccumulator

    s = task.settings
    micro, start = s["micro"], s["start"]
    if model is None:
        keras.utils.set_random_seed(seed)
        model = task.build()
    else:
        keras.utils.set_random_seed(seed)       # the shuffling and dropout as in a run built here
    first = effective if kind == "fixed" else start
    optimizer = GradientAccumulator(keras.optimizers.Adam(task.lr(first)), first // micro, schedulable=True,
                                    measure_noise_scale=True)
    model.compile(optimizer=optimizer, loss=task.loss)
    x_val, y_val = task.x_val, task.y_val

    @tf.function
    def evaluate():
        return task.loss(y_val, model(x_val, training=False))

    callbacks = []
    rule = None
    if kind == "auto":
        margin, patience, growth = rule_settings or (MARGIN.value, PATIENCE.value, GROWTH.value)
        rule = AutoAccumulation(micro, s["max"], start_accum_steps=start // micro, growth=growth,
                                margin=margin, patience=patience, lr_scaling=LR_SCALING.value)
        callbacks.append(rule)
    elif kind == "ramp":
        callbacks.append(AccumulationSchedule(schedule, by="update", lr_scaling=LR_SCALING.value))
    recorder = _recorder(task, evaluate)
    callbacks.append(recorder)
    started = time.perf_counter()
    model.fit(task.dataset(seed), steps_per_epoch=task.budget // micro + s["max"] // micro, epochs=1,
              verbose=0, callbacks=callbacks)
    seconds = time.perf_counter() - started
    done = rule.schedule if rule is not None else (schedule or {0: first // micro})
    return {"curve": recorder.points, "schedule": {str(k): int(v) for k, v in done.items()},
            "seconds": round(seconds, 1)}


def batch_grid(task):
    """The effective batches from the smallest to the largest, doubling."""
    batches, e = [], task.settings["start"]
    while e <= task.settings["max"]:
        batches.append(e)
        e *= 2
    return batches


def ramp_schedule(task):
    """{update: accum_steps}: the effective batch doubles from the smallest to the largest in equal shares of samples."""
    s = task.settings
    batches = batch_grid(task)
    share = task.budget / len(batches)
    schedule, update = {}, 0
    for e in batches:
        schedule[int(round(update))] = e // s["micro"]
        update += share / e
    return schedule


def _log_run(task, label, seed, run):
    curve = run["curve"]
    logging.info("%s %-12s seed %d: val loss %.4f after %d samples, %d updates, final batch %d (%.0f s)",
                 task.name, label, seed, curve[-1]["val_loss"], curve[-1]["samples"], curve[-1]["updates"],
                 curve[-1]["effective_batch"], run["seconds"])


def run_task(name):
    """Every configuration of one task, every seed; {"runs": {label: {...}}, ...}."""
    task = Task(name)
    s = task.settings
    logging.info("%s: %s; %d samples per run (%.1f passes), micro-batch %d", name, task.description, task.budget,
                 task.budget / task.train_size, s["micro"])
    seeds = list(range(1 if QUICK.value else SEEDS.value))
    runs = {}

    def record(label, kind, run_list, effective=None, schedule=None):
        runs[label] = {"kind": kind, "effective_batch": effective, "runs": run_list}

    auto = []
    for seed in seeds:
        auto.append(train(task, seed, "auto"))
        _log_run(task, "auto", seed, auto[-1])
    record("auto", "auto", auto)
    finals = [r["curve"][-1]["effective_batch"] for r in auto]
    auto_final = max(set(finals), key=lambda e: (finals.count(e), e))
    for variant in AUTO_VARIANTS.value:
        margin, patience, growth = _variant(variant)
        label = f"auto m{margin:g} p{patience} g{growth}"
        runs_of_variant = []
        for seed in seeds:
            runs_of_variant.append(train(task, seed, "auto", rule_settings=(margin, patience, growth)))
            _log_run(task, label, seed, runs_of_variant[-1])
        runs[label] = {"kind": "auto variant", "effective_batch": None, "runs": runs_of_variant,
                       "settings": {"margin": margin, "patience": patience, "growth": growth}}
    for effective in batch_grid(task):
        label = f"fixed {effective}"
        fixed = []
        for seed in seeds:
            fixed.append(train(task, seed, "fixed", effective=effective))
            _log_run(task, label, seed, fixed[-1])
        record(label, "fixed", fixed, effective=effective)
    schedule = ramp_schedule(task)
    ramp = []
    for seed in seeds:
        ramp.append(train(task, seed, "ramp", schedule=schedule))
        _log_run(task, "ramp", seed, ramp[-1])
    record("ramp", "ramp", ramp, schedule=schedule)
    return {"description": task.description, "settings": s, "budget": task.budget, "train_size": task.train_size,
            "entropy": task.entropy, "auto_final_batches": finals, "auto_final_batch": auto_final,
            "ramp_schedule": {str(k): v for k, v in schedule.items()},
            "lr": {str(e): task.lr(e) for e in batch_grid(task)}, "runs": runs}


# ------------------------------------------------------------------ KerasTuner
def run_tuner(task_name="digits", seed=0):
    """A KerasTuner grid over fixed effective batches, each trial the full budget; against one auto run."""
    import keras_tuner

    task = Task(task_name)
    grid = batch_grid(task)
    trials = []

    class BatchSearch(keras_tuner.HyperModel):
        def build(self, hp):
            hp.Choice("effective_batch_size", grid)
            import keras
            keras.utils.set_random_seed(seed)
            return task.build()

        def fit(self, hp, model, *args, **kwargs):
            effective = hp.get("effective_batch_size")
            run = train(task, seed, "fixed", effective=effective, model=model)
            _log_run(task, f"tuner {effective}", seed, run)
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
    auto = train(task, seed, "auto")
    _log_run(task, "auto (tuner)", seed, auto)
    return {"task": task_name, "seed": seed, "grid": grid, "trials": trials, "best_effective_batch": best,
            "search_samples": sum(t["samples"] for t in trials),
            "auto": {"samples": auto["curve"][-1]["samples"], "final_val_loss": final_loss(smooth(auto["curve"])),
                     "schedule": auto["schedule"], "seconds": auto["seconds"]}}


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
def main(argv):
    del argv
    logging.set_verbosity(logging.INFO)
    if WORKER.value:
        goodput_worker()
        return
    _check_flags()
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
            with open(path + ".partial", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(path + ".partial", path)
    else:
        os.environ.setdefault("KERAS_BACKEND", "tensorflow")
        import keras
        import tensorflow as tf
        started = time.perf_counter()
        results = {"date": datetime.date.today().isoformat(),
                   "versions": {"tensorflow": tf.__version__, "keras": keras.__version__,
                                "python": platform.python_version()},
                   "cpus": os.cpu_count(), "load_at_start": [round(v, 2) for v in os.getloadavg()],
                   "settings": {"seeds": 1 if QUICK.value else SEEDS.value,
                                "auto_variants": AUTO_VARIANTS.value, "evals": EVALS.value, "margin": MARGIN.value,
                                "patience": PATIENCE.value, "growth": GROWTH.value,
                                "lr_scaling": LR_SCALING.value, "quick": QUICK.value,
                                "epochs": EPOCHS.value},
                   "tasks": {}}
        for name in TASKS_FLAG.value:
            results["tasks"][name] = run_task(name)
        if TUNER.value and "digits" in TASKS_FLAG.value:
            results["tuner"] = run_tuner()
        if GOODPUT.value:
            results["goodput"] = run_goodput()
        results["load_at_end"] = [round(v, 2) for v in os.getloadavg()]
        results["wall_seconds"] = round(time.perf_counter() - started, 1)
        with open(path + ".partial", "w") as f:
            json.dump(results, f, indent=1)
        os.replace(path + ".partial", path)
    summary = auto_batch_report.write(results, folder)
    print(json.dumps(summary))
    logging.info("wrote %s", os.path.join(folder, "auto_batch.md"))


if __name__ == "__main__":
    app.run(main)
