"""Prints max |Δw| against the large-batch run: GradientAccumulator vs Keras' built-in.

Same models, data and optimizers as tests/accumulator/test_exactness.py
(32 updates, micro-batch 8, accum 4). Run: `.venv/bin/python -m benchmarks.exactness_vs_builtin`.
"""

import keras
import tensorflow as tf

from accumulator import GradientAccumulator
from tests.accumulator import reference as ref
from tests.accumulator.test_exactness import ACCUM, MICRO_BATCH, OPTIMIZERS, UPDATES


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
