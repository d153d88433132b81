"""Prints max |Δw| against Keras' own large batch for an embedding model (issue 20's setup).

`Embedding(50, 8)` -> `GlobalAveragePooling1D` -> `Dense(1)`, mse, 256 samples of 10
random token ids, 2 epochs, no shuffle; micro-batch 8 x 4 against batch 32. Columns:
the default (the window's rows, as the large batch has them), `merge_duplicate_rows=True`
(each index's rows summed: the densified gradient, what the library did before), and
how far training moved the weights. Run: `.venv/bin/python -m benchmarks.sparse_exactness`.
"""

import keras
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref

OPTIMIZERS = {
    "SGD": lambda: keras.optimizers.SGD(0.5),
    "Adam": lambda: keras.optimizers.Adam(1e-2),
    "AdamW": lambda: keras.optimizers.AdamW(1e-2, weight_decay=0.1),
    "RMSprop": lambda: keras.optimizers.RMSprop(1e-2),
    "Adafactor": lambda: keras.optimizers.Adafactor(0.05),
    "Adagrad": lambda: keras.optimizers.Adagrad(0.1),
}


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((10,), dtype="int32"), keras.layers.Embedding(50, 8),
                             keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(1)])


def _fit(optimizer, x, y, batch_size):
    model = _model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0)
    return model.get_weights()


def main():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 50, size=(256, 10)).astype("int32")
    y = rng.randn(256, 1).astype("float32")
    print(f"TensorFlow {tf.__version__}, Keras {keras.__version__}")
    print("| optimizer | default (rows) | `merge_duplicate_rows=True` | weights moved by training |")
    print("|---|---|---|---|")
    initial = _model().get_weights()
    for name, make in OPTIMIZERS.items():
        big = _fit(make(), x, y, 32)
        rows = _fit(GradientAccumulator(make(), 4), x, y, 8)
        merged = _fit(GradientAccumulator(make(), 4, merge_duplicate_rows=True), x, y, 8)
        print(f"| {name} | {ref.max_abs_diff(rows, big):.1e} | {ref.max_abs_diff(merged, big):.1e} "
              f"| {ref.max_abs_diff(big, initial):.1e} |")


if __name__ == "__main__":
    main()
