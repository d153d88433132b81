"""Plots the gradient noise scale over the training of the demo's digits model.

    python -m benchmarks.noise_scale_plot            # ~2 minutes on 2 CPU cores

Trains `pipelines.digits.model.build_model` (the demo's CNN, learning rate
1e-2 as its run_fn defaults to) on the shipped digits, the demo's training
two thirds of them, in the demo Trainer's default accumulation (4
micro-batches of 16, an effective batch of 64) with
`GradientAccumulator(measure_noise_scale=True, noise_scale_smoothing=0.99)`
(through `accumulator.tuning.probe_noise_scale`), for several seeds, and plots
B_simple after every update. Writes docs/noise_scale_digits.png and the
numbers as docs/noise_scale_digits.csv. No TFX needed.
"""

import csv
import os

import numpy as np
from absl import app, flags

OUT = flags.DEFINE_string("out", "docs", "Folder for the PNG and the CSV.")
UPDATES = flags.DEFINE_integer("updates", 1200, "Optimizer updates per run (the demo trains 400).")
SEEDS = flags.DEFINE_list("seeds", ["0", "1", "2"], "One run per seed (weights and shuffling).")
MICRO = flags.DEFINE_integer("micro_batch_size", 16, "Samples per micro-batch.")
ACCUM = flags.DEFINE_integer("accum_steps", 4, "Micro-batches per update.")
SMOOTHING = flags.DEFINE_float("smoothing", 0.99, "noise_scale_smoothing (the Trainer's default).")
LEARNING_RATE = flags.DEFINE_float("learning_rate", 1e-2, "Adam's learning rate (the run_fn's default).")
DEMO_UPDATES = 400


def digits_training_split(seed=0):
    """Features as the demo's model takes them ({pixel_xx: (n, 1)}), labels (n, 1): two thirds."""
    from sklearn.datasets import load_digits

    from tfx_gradient_accumulator.pipelines.digits.data import FEATURE_KEYS

    digits = load_digits()
    order = np.random.RandomState(seed).permutation(len(digits.target))
    train = order[: 2 * len(order) // 3]
    images = digits.data[train].astype("float32")
    features = {key: images[:, i:i + 1] for i, key in enumerate(FEATURE_KEYS)}
    return features, digits.target[train].astype("int64")[:, None]


def main(argv):
    del argv
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras_tuner
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from tfx_gradient_accumulator.accumulator.tuning import probe_noise_scale
    from tfx_gradient_accumulator.pipelines.digits.model import build_model

    features, labels = digits_training_split()
    hp = keras_tuner.HyperParameters()
    hp.Fixed("learning_rate", LEARNING_RATE.value)
    effective = MICRO.value * ACCUM.value
    runs = {}
    for seed in SEEDS.value:
        probe = probe_noise_scale(
            build_model, features, labels, micro_batch_size=MICRO.value, accum_steps=ACCUM.value,
            updates=UPDATES.value, hyperparameters=hp, noise_scale_smoothing=SMOOTHING.value, seed=int(seed),
        )
        runs[seed] = probe.history
        at_demo = dict(probe.history).get(DEMO_UPDATES)
        print(f"seed {seed}: B_simple {at_demo:.1f} after {DEMO_UPDATES} updates, "
              f"{probe.noise_scale:.1f} after {probe.updates} ({probe.windows} windows)")

    os.makedirs(OUT.value, exist_ok=True)
    with open(os.path.join(OUT.value, "noise_scale_digits.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["update"] + [f"seed_{s}" for s in runs])
        for row in zip(*runs.values()):
            writer.writerow([row[0][0]] + [f"{value:.4g}" for _, value in row])

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for seed, history in runs.items():
        updates, values = zip(*history)
        values = np.array(values)
        ax.plot(updates, np.where(values > 0, values, np.nan), lw=1.3, label=f"seed {seed}")
    ax.axhline(effective, color="k", ls="--", lw=1, label=f"effective batch ({MICRO.value} x {ACCUM.value})")
    ax.axvline(DEMO_UPDATES, color="grey", ls=":", lw=1, label=f"the demo's {DEMO_UPDATES} updates")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer updates (windows)")
    ax.set_ylabel("B_simple (samples)")
    ax.set_title("Gradient noise scale while training the demo's digits CNN\n"
                 f"(Adam {LEARNING_RATE.value:g}, smoothing {SMOOTHING.value}; McCandlish et al. 2018)",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    path = os.path.join(OUT.value, "noise_scale_digits.png")
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
