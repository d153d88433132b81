"""Writes the checkpoints under tests/accumulator/data/window_checkpoint_v1_keras3 and tests/keras2/data/window_checkpoint_v1_keras2 (run with the code of f49b76b: `python make_window_checkpoint_v1.py keras3 DIR`)."""
import os, sys
k2 = sys.argv[1] == "keras2"
if k2:
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
import numpy as np, tensorflow as tf
if k2:
    import tf_keras as keras
else:
    import keras
from tfx_gradient_accumulator import GradientAccumulator
out = sys.argv[2]
x = np.random.default_rng(0).normal(size=(24, 5)).astype("float32"); y = x.sum(1, keepdims=True)
ids = np.random.default_rng(1).integers(0, 20, size=(24, 2))
keras.utils.set_random_seed(0)
inp = keras.Input((5,)); tok = keras.Input((2,), dtype="int32")
e = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 3)(tok))
h = keras.layers.Dense(4)(keras.layers.Concatenate()([inp, e]))
model = keras.Model([inp, tok], keras.layers.Dense(1)(h))
opt = GradientAccumulator(keras.optimizers.Adam(1e-2), accum_steps=4, partial_window="carry")
model.compile(opt, "mse")
model.fit([x, ids], y, batch_size=4, verbose=0)          # 6 micro-batches: 1 update, 2 held
assert opt.held_micro_batches == 2
tf.train.Checkpoint(optimizer=opt, model=model).write(os.path.join(out, "ckpt"))
np.savez(os.path.join(out, "expected.npz"), *[v.numpy() for v in opt.variables])   # as held
print([tuple(tf.shape(v).numpy()) for v in opt.variables])
