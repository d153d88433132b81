"""GradientCache: what the exact large batch costs (memory, time) and what it buys (recall).

`GradientCache(model, N)` trains a loss that couples the batch (in-batch
negatives) at the batch `fit` gives it while holding one micro-batch's
activations at a time, for one extra forward pass. Three parts, each judged
against a peer measured in the same run:

* ``memory``: a two-tower model whose activations dominate (64 frozen token
  embeddings per side, two per-token Dense layers of width 256, mean-pool,
  projection to 64; in-batch softmax). Peak over the baseline (TensorFlow's
  allocator statistics, one inter-op thread, a fresh process per contender and
  repeat) for the large batch of 512 (`large_batch`), GradientCache at the same
  512 in 4 x 128 and 8 x 64 (`cached_N4`, `cached_N8`), and plain `fit` at 128 and
  64 (`plain_b128`, `plain_b64`: the micro-batch's own peak). Target:
  the cached peak stays close to the micro-batch's plus the cached representations.
* ``time``: seconds per effective batch of 512, cached over the large batch, round
  by round. Target: <= 1.35 (one extra forward pass: GradCache reports ~20 %).
* ``quality``: synthetic user-item interactions with latent clusters; a two-tower
  model with ID embeddings and in-batch softmax; held-out recall@10 (every item
  ranked) against the effective batch for plain accumulation (micro-batches of 32
  with their own 31 negatives), GradientCache (micro-batches of 32) and the true
  large batch, with the same samples, epochs and learning-rate schedule per point.

    python -m benchmarks.gradient_cache [--parts=memory,time,quality] [--repeats 3] [--seeds 2]

writes docs/benchmarks/cpu/gradient_cache.{json,md,png} and gradient_cache_recall.png
(or gpu-<device>/ on a GPU); a part run alone replaces its own results in the json.
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

from benchmarks import allocator_statistics_on, stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("memory", "time", "quality")

# Memory and time: activations dominate (per sample and tower: 64 tokens x 256 x 4 bytes per layer).
TOKENS, VOCAB, EMBED, WIDTH, DIM, TOWERS = 64, 1024, 32, 256, 64, 2
EFFECTIVE = 512
CONTENDERS = {  # name: (kind, accum_steps, fit's batch size, run eagerly)
    "large_batch": ("plain", 1, EFFECTIVE, False),
    "cached_N4": ("cached", 4, EFFECTIVE, False),
    "cached_N8": ("cached", 8, EFFECTIVE, False),
    "plain_b128": ("plain", 1, EFFECTIVE // 4, False),
    "plain_b64": ("plain", 1, EFFECTIVE // 8, False),
    # A diagnosis, not a target: eagerly, each op runs when the Python line does, so the
    # passes run in the order written; under `fit`'s tf.function the executor orders them.
    "cached_N4_eager": ("cached", 4, EFFECTIVE, True),
    "plain_b128_eager": ("plain", 1, EFFECTIVE // 4, True),
}
MICRO_PEER = {"cached_N4": "plain_b128", "cached_N8": "plain_b64", "cached_N4_eager": "plain_b128_eager"}
TIMED = ("large_batch", "cached_N4", "cached_N8", "plain_b128", "plain_b64")
MEMORY_STEPS, WARMUP_STEPS, TIMED_STEPS = 2, 2, 8
CLOSE_TARGET = 1.2      # cached peak / (micro-batch peak + representations)
TIME_TARGET = 1.35      # cached seconds / large batch seconds, per effective batch

# Quality: users prefer two of the clusters; within a cluster, their taste picks the item.
USERS, ITEMS, CLUSTERS, LATENT, PER_USER, HELD_OUT = 2000, 1000, 20, 8, 16, 1
QUALITY_MICRO, QUALITY_BATCHES = 32, (32, 64, 128, 256, 512)
QUALITY_DIM, EPOCHS, LEARNING_RATE, K = 32, 5, 2e-2, 10
QUALITY_CONTENDERS = ("plain_accumulation", "cached", "large_batch")
EXACT_RECALL = 0.01     # |cached - large batch| recall@10 at every point and seed


# ------------------------------------------------------------------ models and data
def _activation_two_tower(keras, contrastive):
    """Two towers over 64 frozen token embeddings each: the per-token Dense layers' activations
    (and not the parameters, under 1 MiB) are what the batch size multiplies."""

    def tower(name):
        return keras.Sequential([
            keras.layers.Embedding(VOCAB, EMBED, trainable=False),
            keras.layers.Dense(WIDTH, activation="relu"), keras.layers.Dense(WIDTH, activation="relu"),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(DIM)], name=name)

    class TwoTower(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.query, self.candidate = tower("query"), tower("candidate")

        def call(self, inputs):
            return {"query": self.query(inputs["query"]), "candidate": self.candidate(inputs["candidate"])}

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])

    return TwoTower()


def _id_two_tower(keras, contrastive):
    """User id -> query, item id -> candidate: TensorFlow Recommenders' retrieval model."""

    class TwoTower(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.query = keras.layers.Embedding(USERS, QUALITY_DIM)
            self.candidate = keras.layers.Embedding(ITEMS, QUALITY_DIM)

        def call(self, inputs):
            return {"query": self.query(inputs["user"]), "candidate": self.candidate(inputs["item"])}

        def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
            return contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])

    return TwoTower()


def interactions(np, seed=1234):
    """(train dict, held-out (users, items), the generator's p(item | user)): each user prefers
    two of the clusters (one more than the other) and, inside a cluster, the items nearest its
    taste. Fixed by `seed`."""
    rng = np.random.RandomState(seed)
    cluster_of = np.arange(ITEMS) % CLUSTERS
    offsets = rng.randn(ITEMS, LATENT)
    preferred = np.stack([rng.choice(CLUSTERS, 2, replace=False) for _ in range(USERS)])
    first_weight = rng.uniform(0.5, 1.0, USERS)
    taste = rng.randn(USERS, LATENT)
    probability = np.zeros((USERS, ITEMS))
    for k in range(CLUSTERS):
        members = np.flatnonzero(cluster_of == k)
        logits = 1.5 * taste @ offsets[members].T
        within = np.exp(logits - logits.max(1, keepdims=True))
        weight = np.where(preferred[:, 0] == k, first_weight, np.where(preferred[:, 1] == k, 1 - first_weight, 0))
        probability[:, members] = weight[:, None] * within / within.sum(1, keepdims=True)
    users = np.repeat(np.arange(USERS), PER_USER)
    cumulative = np.cumsum(probability, axis=1)
    draws = (cumulative[users] < rng.uniform(size=(users.size, 1)) * cumulative[users, -1:]).sum(1)
    items = np.minimum(draws, ITEMS - 1)
    held = np.tile(np.arange(PER_USER) < HELD_OUT, USERS)
    order = rng.permutation(int((~held).sum()))
    train = {"user": users[~held][order].astype("int32"), "item": items[~held][order].astype("int32")}
    return train, (users[held], items[held]), probability


def recall_at_k(np, scores, items):
    """Share of held-out pairs whose item ranks in the top K of its row of `scores` (one row per
    pair, every item scored; ties count against it)."""
    positive = scores[np.arange(len(items)), items]
    return float(np.mean((scores >= positive[:, None]).sum(1) <= K))


def _fresh_tf():
    """TensorFlow and Keras in this (fresh) process, one inter-op thread: with more, which ops
    overlap, and so the peak, changes from process to process."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    os.environ["KERAS_BACKEND"] = "tensorflow"
    allocator_statistics_on()
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(1)
    import keras
    return tf, keras


def _versions(tf, keras):
    return {"tensorflow": tf.__version__, "keras": keras.__version__, "python": platform.python_version()}


def _device_folder(tf):
    """'cpu', or 'gpu-<name>' as `benchmarks.run` names a GPU's results folder."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return "cpu", f"CPU ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"
    name = tf.config.experimental.get_device_details(gpus[0]).get("device_name", "gpu")
    return "gpu-" + name.lower().replace(" ", "-"), name


# ------------------------------------------------------------------ measuring (one process each)
def measure(contender, parts):
    """One contender in this process: its per-step peaks over the baseline (MiB) and, for the
    time part, its seconds per step of `fit` (one effective batch, or one micro-batch for plain b)."""
    tf, keras = _fresh_tf()
    import numpy as np
    from tfx_gradient_accumulator.accumulator import GradientCache
    from tfx_gradient_accumulator.accumulator.cache import contrastive

    kind, accum, batch, eager = CONTENDERS[contender]
    rng = np.random.RandomState(0)
    samples = EFFECTIVE * (WARMUP_STEPS + MEMORY_STEPS + TIMED_STEPS)
    x = {"query": rng.randint(0, VOCAB, (samples, TOKENS)).astype("int32"),
         "candidate": rng.randint(0, VOCAB, (samples, TOKENS)).astype("int32")}
    keras.utils.set_random_seed(0)
    inner = _activation_two_tower(keras, contrastive)
    inner({k: v[:2] for k, v in x.items()})
    model = GradientCache(inner, accum) if kind == "cached" else inner
    model.compile(optimizer=keras.optimizers.Adam(1e-3), jit_compile=False, run_eagerly=eager)
    folder, device_name = _device_folder(tf)
    device = "GPU:0" if folder != "cpu" else "CPU:0"
    cut = lambda start, steps: {k: v[start * batch:(start + steps) * batch] for k, v in x.items()}
    # Warm-up: builds the optimizer and traces the step.
    model.fit(cut(0, WARMUP_STEPS), batch_size=batch, shuffle=False, verbose=0)
    mib = lambda key: tf.config.experimental.get_memory_info(device)[key] / 2**20
    tf.config.experimental.reset_memory_stats(device)
    baseline, peaks, seconds = mib("current"), [], []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, step, logs=None):
            tf.config.experimental.reset_memory_stats(device)
            self.start = time.perf_counter()

        def on_train_batch_end(self, step, logs=None):
            seconds.append(time.perf_counter() - self.start)
            peaks.append(round(mib("peak") - baseline, 2))

    if "memory" in parts:
        model.fit(cut(WARMUP_STEPS, MEMORY_STEPS), batch_size=batch, shuffle=False, verbose=0, callbacks=[Probe()])
    memory_peaks, seconds[:] = list(peaks), []
    if "time" in parts:
        model.fit(cut(WARMUP_STEPS + MEMORY_STEPS, TIMED_STEPS), batch_size=batch, shuffle=False, verbose=0,
                  callbacks=[Probe()])
    params = sum(int(np.prod(w.shape)) * 4 for w in inner.weights) / 2**20
    return {"contender": contender, "device": device, "device_folder": folder, "device_name": device_name,
            "peaks_mb": memory_peaks, "step_seconds": seconds, "param_mb": params,
            "versions": _versions(tf, keras)}


def quality(seed):
    """Recall@10 of the three contenders at every effective batch, for one seed (initial
    weights and shuffling; the interactions stay fixed)."""
    tf, keras = _fresh_tf()
    import numpy as np
    from tfx_gradient_accumulator.accumulator import GradientAccumulator, GradientCache
    from tfx_gradient_accumulator.accumulator.cache import contrastive

    train, (users, items), probability = interactions(np)
    recall, seconds = {name: {} for name in QUALITY_CONTENDERS}, {name: {} for name in QUALITY_CONTENDERS}
    for effective in QUALITY_BATCHES:
        accum = effective // QUALITY_MICRO
        updates = EPOCHS * -(-len(train["user"]) // effective)
        for name in QUALITY_CONTENDERS:
            keras.utils.set_random_seed(seed)
            model = _id_two_tower(keras, contrastive)
            model({k: v[:2] for k, v in train.items()})
            # The same schedule of the same number of updates for every contender at this point.
            adam = keras.optimizers.Adam(keras.optimizers.schedules.CosineDecay(LEARNING_RATE, updates))
            if name == "plain_accumulation":
                trained, optimizer, batch = model, GradientAccumulator(adam, accum), QUALITY_MICRO
            elif name == "cached":
                trained, optimizer, batch = GradientCache(model, accum), adam, effective
            else:
                trained, optimizer, batch = model, adam, effective
            trained.compile(optimizer=optimizer, jit_compile=False)
            start = time.perf_counter()
            trained.fit(train, batch_size=batch, epochs=EPOCHS, verbose=0, shuffle=True)
            seconds[name][str(effective)] = round(time.perf_counter() - start, 2)
            query, candidate = model.query(np.arange(USERS)).numpy(), model.candidate(np.arange(ITEMS)).numpy()
            recall[name][str(effective)] = recall_at_k(np, query[users] @ candidate.T, items)
            keras.backend.clear_session()
    folder, device_name = _device_folder(tf)
    return {"seed": seed, "recall": recall, "seconds": seconds, "oracle": recall_at_k(np, probability[users], items),
            "device_folder": folder, "device_name": device_name,
            "versions": _versions(tf, keras)}


def _spawn(*args):
    """A fresh interpreter on this module (cwd = the repository root, the environment inherited)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.gradient_cache", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    if out.returncode:
        raise RuntimeError(f"{' '.join(args)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ analysis (pure: results -> figures)
def representation_mb(effective=EFFECTIVE):
    """What pass 1 caches for a batch: every sample's representations, float32, both towers."""
    return effective * DIM * 4 * TOWERS / 2**20


def memory_figures(memory):
    """Per contender: its peak, its peak / the large batch's (round by round); per cached contender:
    the expected peak (its micro-batch's peak + the representations) and its peak / that."""
    runs = memory["runs"]
    peak = {name: [max(r["peaks_mb"]) for r in rs] for name, rs in runs.items()}
    figures = {name: {"peak": stats.summary(values)} for name, values in peak.items()}
    for name, values in peak.items():
        if "large_batch" in peak and name != "large_batch" and not CONTENDERS[name][3]:
            figures[name]["over_large"] = stats.ratio_summary(values, peak["large_batch"])
    for name, peer in MICRO_PEER.items():
        if name in peak and peer in peak:
            expected = [p + representation_mb() for p in peak[peer]]
            figures[name]["expected"] = stats.summary(expected)
            figures[name]["over_expected"] = stats.ratio_summary(peak[name], expected)
            figures[name]["verdict"] = stats.verdict(figures[name]["over_expected"], CLOSE_TARGET,
                                                     higher_is_better=False)
    return figures


def time_figures(timing):
    """Per contender: the median seconds per effective batch in each repeat, and the cached
    contenders' ratio to the large batch (round by round) with its verdict."""
    runs = timing["runs"]
    # A plain micro-batch step is 1/N of an effective batch: N of them are its time.
    step = {name: [stats.summary(r["step_seconds"])["median"] * EFFECTIVE / CONTENDERS[name][2] for r in rs]
            for name, rs in runs.items()}
    figures = {name: {"step": stats.summary(values)} for name, values in step.items()}
    for name, values in step.items():
        if name != "large_batch" and "large_batch" in step:
            figures[name]["over_large"] = stats.ratio_summary(values, step["large_batch"])
            if CONTENDERS[name][0] == "cached":
                figures[name]["verdict"] = stats.verdict(figures[name]["over_large"], TIME_TARGET,
                                                         higher_is_better=False)
            if MICRO_PEER.get(name) in step:     # what the extra forward costs on the micro-batches themselves
                figures[name]["over_micro"] = stats.ratio_summary(values, step[MICRO_PEER[name]])
    return figures


def quality_figures(quality):
    """Recall@10 per contender and effective batch over the seeds; the largest |cached - large
    batch| (exactness); cached - plain accumulation at every effective batch, seed by seed."""
    seeds = quality["seeds"]
    batches = sorted({int(b) for s in seeds for b in s["recall"]["cached"]})
    recall = {name: {b: stats.summary([s["recall"][name][str(b)] for s in seeds]) for b in batches}
              for name in QUALITY_CONTENDERS}
    gap = max(abs(s["recall"]["cached"][str(b)] - s["recall"]["large_batch"][str(b)])
              for s in seeds for b in batches)
    gain = {b: stats.summary(stats.per_round_differences([s["recall"]["cached"][str(b)] for s in seeds],
                                                         [s["recall"]["plain_accumulation"][str(b)] for s in seeds]))
            for b in batches}
    plain = [recall["plain_accumulation"][b]["median"] for b in batches]
    return {"batches": batches, "recall": recall, "exactness_gap": gap,
            "exactness": "met" if gap <= EXACT_RECALL else "missed", "gain": gain,
            "plain_range": max(plain) - min(plain), "seeds": [s["seed"] for s in seeds],
            "oracle": seeds[0].get("oracle")}


# ------------------------------------------------------------------ the report
def _mib(s):
    return stats.fmt(s, 1)


def _ratio(s):
    return stats.fmt(s, 2)


def _memory_lines(memory):
    figures = memory_figures(memory)
    repeats = len(next(iter(memory["runs"].values())))
    lines = [
        "## Memory", "",
        f"Two towers, each: {TOKENS} frozen token embeddings ({EMBED} wide), two per-token Dense layers of "
        f"{WIDTH} (ReLU), mean-pool, Dense({DIM}); in-batch softmax; Adam, `fit`, no XLA. Parameters "
        f"{memory.get('param_mb', 0):.2f} MiB: the activations dominate. Peak: TensorFlow's allocator peak over the "
        "baseline (model, data, optimizer state and traced step in place), the highest of the measured steps, "
        f"{repeats} fresh processes per contender, 1 inter-op thread; MiB, median [min–max]. The cached "
        f"representations: {EFFECTIVE} samples × {DIM} × 4 bytes × {TOWERS} towers = {representation_mb():.2f} MiB "
        f"(the whole batch's logits, {EFFECTIVE}² × 4 bytes = {EFFECTIVE**2 * 4 / 2**20:.0f} MiB, come with the loss).", "",
        "| contender | effective batch | micro-batch | peak | peak / large batch | expected: micro-batch peak "
        "+ representations | peak / expected | target ≤ " f"{CLOSE_TARGET} |",
        "|---|---|---|---|---|---|---|---|"]
    for name, figure in figures.items():
        kind, accum, batch, eager = CONTENDERS[name]
        effective = batch if kind == "plain" else EFFECTIVE
        micro = batch // accum
        lines.append(f"| {name} | {effective} | {micro} | {_mib(figure['peak'])} | "
                     f"{_ratio(figure['over_large']) if 'over_large' in figure else '—'} | "
                     f"{_mib(figure['expected']) if 'expected' in figure else '—'} | "
                     f"{_ratio(figure['over_expected']) if 'over_expected' in figure else '—'} | "
                     f"{'**' + figure['verdict'] + '**' if 'verdict' in figure else '—'} |")
    judged = {name: f for name, f in figures.items() if "verdict" in f and not CONTENDERS[name][3]}
    lines += ["", "Target: the cached peak stays close to the micro-batch's activations plus the cached "
              f"representations (here: within {CLOSE_TARGET}× the plain micro-batch's peak plus "
              f"{representation_mb():.2f} MiB), judged on `fit` as it runs by default (a tf.function). " + " ".join(
                  f"{name}: **{figure['verdict']}** ({_ratio(figure['over_expected'])}× the expected peak; "
                  f"{_ratio(figure['over_large'])}× the large batch's)." for name, figure in judged.items())]
    if "cached_N4_eager" in figures and "over_expected" in figures["cached_N4_eager"]:
        eager = figures["cached_N4_eager"]["over_expected"]
        lines[-1] += (f" Run eagerly (`run_eagerly=True`, both sides), the cached peak is {_ratio(eager)}× its "
                      "micro-batch's plus the representations: the passes run in the order written. Under the "
                      "tf.function the order is the graph's: pass 1's micro-batches are chained by control "
                      "dependencies, pass 3's first waits for the scores, and the others run in a "
                      "`tf.while_loop` with `parallel_iterations=1` (an unrolled pass 3, even chained, kept about "
                      "one more micro-batch's activations alive: 1.55× and 2.80× the expected peak, measured "
                      "before the change).")
    lines.append("")
    return lines


def _time_lines(timing):
    figures = time_figures(timing)
    repeats = len(next(iter(timing["runs"].values())))
    lines = [
        "## Time per effective batch", "",
        f"The same model and batch of {EFFECTIVE}; after {WARMUP_STEPS} warm-up steps, {TIMED_STEPS} timed steps of "
        f"`fit` (one effective batch each; for plain b, {TIMED_STEPS} steps of b, counted N times per effective "
        f"batch), the median step per process, {repeats} fresh processes per contender, "
        "interleaved; the ratio is taken repeat by repeat (both sides measured in the same round). Seconds "
        "per effective batch, median [min–max].", "",
        f"| contender | seconds per batch of {EFFECTIVE} | / large batch | target ≤ {TIME_TARGET} |",
        "|---|---|---|---|"]
    for name, figure in figures.items():
        lines.append(f"| {name} | {stats.fmt(figure['step'], 3)} | "
                     f"{_ratio(figure['over_large']) if 'over_large' in figure else '—'} | "
                     f"{'**' + figure['verdict'] + '**' if 'verdict' in figure else '—'} |")
    judged = {name: figure for name, figure in figures.items() if "verdict" in figure}
    lines += ["", f"Target: ≤ {TIME_TARGET}× the large batch (GradCache, Gao et al. 2021, reports ~20 % for its "
              "one extra forward pass; forward + backward ≈ 3 forwards, so the floor is ≈ 4/3). " + " ".join(
                  f"{name}: **{figure['verdict']}** ({_ratio(figure['over_large'])}×)."
                  for name, figure in judged.items())]
    micro = [name for name in figures if CONTENDERS[name][0] == "plain" and name != "large_batch"]
    own = [name for name in judged if "over_micro" in figures[name]]
    if micro and own:
        lines[-1] += (" Plain `fit` at the micro-batch takes " + ", ".join(
                          f"{_ratio(figures[name]['over_large'])}× the large batch's time at b = {CONTENDERS[name][2]}"
                          for name in micro)
                      + f" for the same {EFFECTIVE} samples; over its own micro-batches run plainly, the cached "
                      "step costs " + ", ".join(f"{_ratio(figures[name]['over_micro'])}× ({name})" for name in own)
                      + ": the extra forward pass and the whole batch's loss. So the ratio to the large batch is "
                      "that cost times how much better the device uses the large batch than its micro-batches "
                      "(more on a GPU at small b).")
    lines.append("")
    return lines


def _quality_lines(quality):
    figures = quality_figures(quality)
    batches, recall, gain = figures["batches"], figures["recall"], figures["gain"]
    lines = [
        "## Retrieval quality", "",
        f"{USERS:,} users, {ITEMS:,} items in {CLUSTERS} clusters; each user prefers two clusters (one more than the "
        f"other) and, inside a cluster, the items nearest its taste ({LATENT}-dimensional). {PER_USER} interactions "
        f"per user, {HELD_OUT} held out. Two towers of ID embeddings ({QUALITY_DIM} wide), in-batch softmax, Adam "
        f"with a cosine decay from {LEARNING_RATE} to 0 over the run's updates, {EPOCHS} epochs at every point (the "
        "same samples seen, the same schedule for the three contenders). Recall@10: the held-out item among the "
        f"user's top 10 of all {ITEMS:,} items. Median [min–max] over seeds {figures['seeds']} (initial weights and "
        "shuffling; the interactions are fixed).", "",
        "* plain accumulation: `GradientAccumulator(Adam, N)` at micro-batches of "
        f"{QUALITY_MICRO}: the effective batch's gradient, but each sample sees only {QUALITY_MICRO - 1} negatives;",
        f"* cached: `GradientCache(model, N)`, micro-batches of {QUALITY_MICRO}, the effective batch's negatives;",
        "* large batch: plain `fit` at the effective batch (on a CPU it always fits; where it does not, "
        "the cached line is the one to have).", "",
        "| effective batch | " + " | ".join(QUALITY_CONTENDERS) + " | cached − plain accumulation |",
        "|---|" + "---|" * (len(QUALITY_CONTENDERS) + 1)]
    for b in batches:
        lines.append(f"| {b} | " + " | ".join(stats.fmt(recall[name][b], 3) for name in QUALITY_CONTENDERS)
                     + f" | {stats.fmt(gain[b], 3)} |")
    largest = batches[-1]
    seconds = {name: stats.summary([s["seconds"][name][str(largest)] for s in quality["seeds"]])
               for name in QUALITY_CONTENDERS} if all("seconds" in s for s in quality["seeds"]) else {}
    direction = ("higher" if gain[largest]["min"] > 0 else "lower" if gain[largest]["max"] < 0
                 else "not consistently different")
    lines += [
        "", f"Exactness: cached and the large batch coincide at every point and seed within {EXACT_RECALL} recall: "
        f"**{figures['exactness']}** (largest difference {figures['exactness_gap']:.4f}). Negatives: at "
        f"{largest}, cached is {direction} than plain accumulation ({stats.fmt(gain[largest], 3)}); plain "
        f"accumulation's medians span {figures['plain_range']:.3f} across the effective batches."
        + f" The largest median difference: {max(gain[b]['median'] for b in batches):+.3f} at "
        f"{max(batches, key=lambda b: gain[b]['median'])}."
        + (f" The generator's own p(item | user) ranks the held-out items to recall@10 = {figures['oracle']:.3f}: "
           "the ceiling." if figures["oracle"] is not None else ""), "",
        "![recall@10 against the effective batch](gradient_cache_recall.png)", ""]
    if seconds:
        lines[-4] += (f" Training seconds at {largest} ({EPOCHS} epochs): " + ", ".join(
            f"{name.replace('_', ' ')} {stats.fmt(seconds[name], 1)}" for name in QUALITY_CONTENDERS)
            + " (tiny towers: per-step overheads, not arithmetic).")
    return lines


def markdown(results):
    """The report's Markdown, from the results alone (no TensorFlow): what the unit test reads."""
    machine = results.get("machine", {})
    lines = ["# GradientCache: memory, time and retrieval quality", "",
             f"{machine.get('date', '?')}; {machine.get('device_name', '?')}; TensorFlow "
             f"{machine.get('versions', {}).get('tensorflow', '?')}, Keras {machine.get('versions', {}).get('keras', '?')}, "
             f"Python {machine.get('versions', {}).get('python', '?')}. "
             f"{machine.get('note', '')}".rstrip(), "",
             "How to read: medians over repeats with their [min–max]; ratios are taken repeat by repeat against a "
             "peer measured in the same run, then summarized. A target is *met* when the median is on the right "
             "side of it, *missed* when every repeat is on the wrong side, *within noise* otherwise.", ""]
    if "memory" in results or "time" in results:
        lines += ["![memory and time](gradient_cache.png)", ""]
    if "memory" in results:
        lines += _memory_lines(results["memory"])
    if "time" in results:
        lines += _time_lines(results["time"])
    if "quality" in results:
        lines += _quality_lines(results["quality"])
    repeats = len(next(iter(results.get("memory", results.get("time", {"runs": {"": [0] * 3}}))["runs"].values())))
    seeds = len(results.get("quality", {"seeds": [0, 0]})["seeds"])
    lines += [f"How to rerun: `python -m benchmarks.gradient_cache --parts=memory,time,quality --repeats {repeats} "
              f"--seeds {seeds}` (a part alone, e.g. `--parts=quality`, replaces only its own results; "
              "`--report_only` rewrites this page and its plots from gradient_cache.json).", ""]
    return "\n".join(lines)


def report(results, folder):
    """Writes gradient_cache.{json,md} and the plots into `folder`; returns the Markdown."""
    results.get("machine", {}).pop("python", None)   # an interpreter's path says nothing to a reader
    text = markdown(results)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "gradient_cache.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(folder, "gradient_cache.md"), "w") as f:
        f.write(text)
    _plot(results, folder)
    return text


# ------------------------------------------------------------------ plots
def _plot(results, folder):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = [part for part in ("memory", "time") if part in results]
    if panels:
        fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.0), squeeze=False)
        for ax, part in zip(axes[0], panels):
            (_memory_axes if part == "memory" else _time_axes)(ax, results[part])
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "gradient_cache.png"), dpi=100)
        plt.close(fig)
    if "quality" in results:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        _recall_axes(ax, results["quality"])
        fig.tight_layout()
        fig.savefig(os.path.join(folder, "gradient_cache_recall.png"), dpi=100)
        plt.close(fig)


def _bars(ax, names, summaries, colors):
    med = [s["median"] for s in summaries]
    err = [[m - s["min"] for m, s in zip(med, summaries)], [s["max"] - m for m, s in zip(med, summaries)]]
    bars = ax.bar(names, med, yerr=err, capsize=4, color=colors)
    for x, m in enumerate(med):
        ax.text(x + 0.08, m, f"{m:.2f}" if m < 10 else f"{m:.0f}", ha="left", va="bottom", fontsize=8)
    ax.tick_params(axis="x", labelsize=8, labelrotation=25)
    return bars


def _memory_axes(ax, memory):
    figures = memory_figures(memory)
    names = list(figures)
    colors = ["#888" if n == "large_batch" else "#2a7" if n.startswith("cached") else "#69c" for n in names]
    bars = _bars(ax, names, [figures[n]["peak"] for n in names], colors)
    for bar, name in zip(bars, names):
        if CONTENDERS[name][3]:
            bar.set_hatch("//")         # run eagerly: the diagnosis pair
    expected = [(x, figures[n]["expected"]["median"]) for x, n in enumerate(names) if "expected" in figures[n]]
    ax.plot([x for x, _ in expected], [e for _, e in expected], "r_", ms=28, mew=2,
            label="micro-batch peak + representations")
    ax.set(ylabel="peak over baseline (MiB)", title=f"Peak memory, effective batch {EFFECTIVE} (hatched: eager)")
    ax.legend(fontsize=8)


def _time_axes(ax, timing):
    figures = time_figures(timing)
    names = [n for n in figures if "over_large" in figures[n]]
    _bars(ax, names, [figures[n]["over_large"] for n in names],
          ["#2a7" if n.startswith("cached") else "#69c" for n in names])
    ax.axhline(TIME_TARGET, color="red", ls="--", lw=1, label=f"target {TIME_TARGET}×")
    ax.axhline(4 / 3, color="grey", ls=":", lw=1, label="one extra forward (4/3)")
    ax.axhline(1.0, color="black", lw=0.5)
    ax.set(ylabel="seconds per effective batch / large batch's", title=f"Time per batch of {EFFECTIVE}")
    ax.legend(fontsize=8)


def _recall_axes(ax, quality):
    figures = quality_figures(quality)
    batches = figures["batches"]
    styles = {"plain_accumulation": dict(color="#c66", marker="s", ls="-"),
              "cached": dict(color="#2a7", marker="o", ls="-", lw=2.5),
              "large_batch": dict(color="black", marker="x", ls="--")}
    for name in QUALITY_CONTENDERS:
        s = [figures["recall"][name][b] for b in batches]
        med = [v["median"] for v in s]
        ax.errorbar(batches, med, yerr=[[m - v["min"] for m, v in zip(med, s)], [v["max"] - m for m, v in zip(med, s)]],
                    capsize=3, label=name.replace("_", " "), **styles[name])
    if figures["oracle"] is not None:
        ax.axhline(figures["oracle"], color="grey", ls=":", lw=1, label="the generator's own ranking")
    ax.set(xscale="log", xticks=batches, xlabel=f"effective batch (micro-batches of {QUALITY_MICRO})",
           ylabel=f"held-out recall@{K}", title="Two-tower retrieval, in-batch softmax")
    ax.set_xticklabels(batches)
    ax.minorticks_off()
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


# ------------------------------------------------------------------ running
def _run_memory_and_time(parts, repeats, results):
    """Every contender the parts need, in a fresh process per contender and repeat, interleaved."""
    names = [n for n in CONTENDERS if "memory" in parts or n in TIMED]
    runs = {name: [] for name in names}
    for repeat in range(repeats):
        for name in names:
            wanted = [p for p in ("memory", "time") if p in parts and (p == "memory" or name in TIMED)]
            run = _spawn("--one", name, "--parts", ",".join(wanted))
            run["load"] = [round(v, 2) for v in os.getloadavg()]
            runs[name].append(run)
            step = stats.summary(run["step_seconds"])["median"] if run["step_seconds"] else float("nan")
            peak = max(run["peaks_mb"]) if run["peaks_mb"] else float("nan")
            print(f"repeat {repeat + 1}/{repeats} {name}: peak +{peak:.1f} MiB, step {step:.3f} s", flush=True)
    first = runs[names[0]][0]
    results["machine"].update(device_name=first["device_name"], versions=first["versions"])
    if "memory" in parts:
        results["memory"] = {"param_mb": first["param_mb"],
                             "runs": {n: [{"peaks_mb": r["peaks_mb"], "load": r["load"]} for r in rs]
                                      for n, rs in runs.items()}}
    if "time" in parts:
        results["time"] = {"runs": {n: [{"step_seconds": r["step_seconds"], "load": r["load"]} for r in runs[n]]
                                    for n in TIMED}}
    return first["device_folder"]


def _run_quality(seeds, results):
    outcomes = []
    for seed in range(seeds):
        start = time.perf_counter()
        outcomes.append(_spawn("--quality_seed", str(seed)))
        print(f"quality seed {seed}: {time.perf_counter() - start:.0f} s, cached recall@10 "
              f"{outcomes[-1]['recall']['cached']}", flush=True)
    results["quality"] = {"seeds": outcomes}
    results["machine"].update(device_name=outcomes[0]["device_name"], versions=outcomes[0]["versions"])
    return outcomes[0]["device_folder"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: memory,time,quality")
    parser.add_argument("--repeats", type=int, default=3, help="processes per contender (memory, time)")
    parser.add_argument("--seeds", type=int, default=2, help="seeds for the quality part")
    parser.add_argument("--folder", default=None, help="default: docs/benchmarks/cpu (or gpu-<device>)")
    parser.add_argument("--report_only", action="store_true", help="rewrite the report from its json")
    parser.add_argument("--note", default="", help="a sentence about the machine, for the report")
    parser.add_argument("--one", choices=list(CONTENDERS), help="measure one contender in this process")
    parser.add_argument("--quality_seed", type=int, help="run the quality part for one seed in this process")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    if set(parts) - set(PARTS):
        parser.error(f"--parts: unknown {sorted(set(parts) - set(PARTS))}; choose from {PARTS}")
    if args.one:
        print(json.dumps(measure(args.one, parts)))
        return
    if args.quality_seed is not None:
        print(json.dumps(quality(args.quality_seed)))
        return
    if args.report_only:
        folder = args.folder or os.path.join(ROOT, "docs", "benchmarks", "cpu")
        print(report(json.load(open(os.path.join(folder, "gradient_cache.json"))), folder))
        return
    results = {"machine": {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                           "note": args.note}, "part_seconds": {}}
    folder = None
    costs = ",".join(p for p in ("memory", "time") if p in parts)
    for key, run in ((costs, lambda: _run_memory_and_time(parts, args.repeats, results)),
                     ("quality" if "quality" in parts else "", lambda: _run_quality(args.seeds, results))):
        if key:
            start = time.perf_counter()
            folder = run()
            results["part_seconds"][key] = round(time.perf_counter() - start, 1)
    folder = args.folder or os.path.join(ROOT, "docs", "benchmarks", folder)
    print(report(_merged(folder, results), folder))


def _merged(folder, results):
    """The parts run now over the results already in `folder` (a part run alone keeps the others)."""
    path = os.path.join(folder, "gradient_cache.json")
    previous = json.load(open(path)) if os.path.exists(path) else {}
    merged = {**previous, **{k: v for k, v in results.items() if k in PARTS}}
    machine = {**previous.get("machine", {}), **results["machine"]}
    merged["machine"] = machine
    merged["part_seconds"] = {**previous.get("part_seconds", {}), **results["part_seconds"]}
    return merged


if __name__ == "__main__":
    main()
