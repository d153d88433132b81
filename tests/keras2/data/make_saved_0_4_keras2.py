"""Writes tests/keras2/data/saved_0_4_keras2/: a Keras 2 (`tf_keras`) model saved as a `.keras` file
by version 0.4.0 (the library before its rooms became sub-packages and the window's state was
split), with its optimizer's open window and the noise scale measured; what that version's
optimizer holds when it loads the file, and after two more micro-batches. Run with that
version's code, once per Keras 2 (a file written by tf_keras names modules TF 2.15's Keras cannot
import): `TF_USE_LEGACY_KERAS=1 python make_saved_0_4_keras2.py DIR/tf_keras` with tf_keras 2.21,
and `python make_saved_0_4_keras2.py DIR/keras_2_15` with TF 2.15's own Keras."""
import os
import sys

import numpy as np
from tfx_gradient_accumulator.accumulator import flavours
keras = flavours.keras2_module()

import tfx_gradient_accumulator
from tfx_gradient_accumulator import GradientAccumulator

out = sys.argv[1]
x = np.random.default_rng(0).normal(size=(32, 5)).astype("float32")
y = x.sum(1, keepdims=True)
ids = np.random.default_rng(1).integers(0, 20, size=(32, 2))
keras.utils.set_random_seed(0)
inp = keras.Input((5,))
tok = keras.Input((2,), dtype="int32")
e = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 3)(tok))
h = keras.layers.Dense(4)(keras.layers.Concatenate()([inp, e]))
model = keras.Model([inp, tok], keras.layers.Dense(1)(h))
opt = GradientAccumulator(keras.optimizers.Adam(1e-2), accum_steps=4, partial_window="carry",
                          measure_noise_scale=True)
model.compile(opt, "mse")
model.fit([x[:24], ids[:24]], y[:24], batch_size=4, shuffle=False, verbose=0)   # 6 micro-batches: 1 update, 2 held
assert opt.held_micro_batches == 2
model.save(os.path.join(out, "model.keras"))
model = keras.models.load_model(os.path.join(out, "model.keras"))
opt = model.optimizer
np.savez(os.path.join(out, "loaded.npz"), *[np.asarray(v) for v in opt.variables])
model.fit([x[24:], ids[24:]], y[24:], batch_size=4, shuffle=False, verbose=0)   # closes the held window
np.savez(os.path.join(out, "continued.npz"), *[np.asarray(v) for v in opt.variables])
np.savez(os.path.join(out, "continued_weights.npz"), *model.get_weights())
print(tfx_gradient_accumulator.__file__, keras.__version__, len(opt.variables), [v.name for v in opt.variables])
