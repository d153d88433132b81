"""Writes tests/accumulator/data/window_variables_v2_keras3.npz: an optimizer's variables
(names, values, in `optimizer.variables` order) as this library saves them, and its model's
weights, for a window
with every part: rows of an embedding's sparse gradients, dense sums, a scalar variable,
the noise scale with Adam's preconditioner, and an open window (1 update, 2 held).
Written with the code of 4544970 (`python make_window_variables_v2.py OUT.npz`), before the
window's state was split into saved variables and notes; `test_window_state.py` loads it.
"""
import sys

import numpy as np

import keras
from tfx_gradient_accumulator import GradientAccumulator


class Scale(keras.layers.Layer):
    """y = s * x with one scalar weight s (a variable of rank 0)."""

    def build(self, input_shape):
        self.s = self.add_weight(shape=(), initializer="ones", name="s")

    def call(self, x):
        return self.s * x


def data():
    """24 samples: 5 features and 2 token ids each."""
    x = np.random.default_rng(0).normal(size=(24, 5)).astype("float32")
    ids = np.random.default_rng(1).integers(0, 20, size=(24, 2))
    return x, ids, x.sum(1, keepdims=True)


def model_and_optimizer():
    """The model (embedding, dense, a scalar) and its accumulator (Adam, noise scale measured)."""
    keras.utils.set_random_seed(0)
    inp, tok = keras.Input((5,)), keras.Input((2,), dtype="int32")
    e = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 3)(tok))
    h = keras.layers.Dense(4)(keras.layers.Concatenate()([inp, e]))
    model = keras.Model([inp, tok], Scale()(keras.layers.Dense(1)(h)))
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), accum_steps=4, partial_window="carry",
                                    measure_noise_scale=True)
    model.compile(optimizer, "mse")
    return model, optimizer


if __name__ == "__main__":
    x, ids, y = data()
    model, optimizer = model_and_optimizer()
    model.fit([x, ids], y, batch_size=4, shuffle=False, verbose=0)     # 6 micro-batches: 1 update, 2 held
    assert optimizer.held_micro_batches == 2
    store = {}
    optimizer.save_own_variables(store)
    names = np.array([v.name for v in optimizer.variables])
    np.savez(sys.argv[1], names=names, **{f"value_{k}": store[k] for k in store},
             **{f"weight_{i}": w for i, w in enumerate(model.get_weights())})
    print(list(names))
