"""Prints max |Δw| against the large-batch run: GradientAccumulator vs Keras' built-in.

The models, data and optimizers of the exactness tests (32 updates, micro-batch 8,
accum 4; `tests/test_bench_exactness.py` checks that the optimizers here are the
tests' own). Run from the repository's root, after `pip install '.[cpu]'`:
`python -m benchmarks.exactness_vs_builtin` (it needs no test tools).
"""

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref

MICRO_BATCH = 8
ACCUM = 4
UPDATES = 32

OPTIMIZERS = {
    "sgd_nesterov": lambda: keras.optimizers.SGD(
        keras.optimizers.schedules.PiecewiseConstantDecay([8, 16], [0.1, 0.05, 0.02]),
        momentum=0.9, nesterov=True, clipnorm=0.5,
    ),
    "adam": lambda: keras.optimizers.Adam(
        keras.optimizers.schedules.ExponentialDecay(1e-2, 8, 0.5), clipnorm=0.1,
    ),
    "adamw": lambda: keras.optimizers.AdamW(
        keras.optimizers.schedules.CosineDecay(1e-2, UPDATES, warmup_target=2e-2, warmup_steps=4),
        weight_decay=0.05, global_clipnorm=0.2,
    ),
    "rmsprop": lambda: keras.optimizers.RMSprop(
        keras.optimizers.schedules.InverseTimeDecay(5e-3, 8, 0.5),
        momentum=0.5, clipvalue=0.05,
    ),
}


def _fit(optimizer, x, y, batch_size):
    model = ref.mlp()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model.get_weights()


def main():
    x, y = ref.regression_data(MICRO_BATCH * ACCUM * UPDATES)
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}")
    print("| optimizer | GradientAccumulator | Keras gradient_accumulation_steps |")
    print("|---|---|---|")
    for name in sorted(OPTIMIZERS):
        big = _fit(OPTIMIZERS[name](), x, y, MICRO_BATCH * ACCUM)
        ours = _fit(GradientAccumulator(OPTIMIZERS[name](), ACCUM), x, y, MICRO_BATCH)
        builtin_opt = OPTIMIZERS[name]()
        builtin_opt.gradient_accumulation_steps = ACCUM
        builtin = _fit(builtin_opt, x, y, MICRO_BATCH)
        print(f"| {name} | {ref.max_abs_diff(ours, big):.1e} | {ref.max_abs_diff(builtin, big):.1e} |")


if __name__ == "__main__":
    main()
