"""What a GPU user's default path is, measured: run first by `tools/gpu_session.sh check`
(`python -m tools.gpu_probe` from the repository's root).

Prints one JSON object (and writes it to --out): the GPU, its driver and what
TensorFlow was built for (`benchmarks.accelerator_facts`), what Keras resolves `jit_compile="auto"` to for a model compiled
with `GradientAccumulator` (on one GPU: XLA; under a strategy: not), and how long
the first `fit` call takes (trace, XLA compile, and on a GPU whose architecture
TensorFlow ships only PTX for, the driver's JIT of its kernels) against the next.
"""

import contextlib
import json
import os
import platform
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

from absl import app, flags  # noqa: E402

OUT = flags.DEFINE_string("out", None, "Also write the JSON here.")


def _first_and_next_fit(make_optimizer, strategy=None):
    """(resolved jit_compile, seconds of the first fit call, of the second) on a small MLP."""
    import keras
    import numpy as np
    import tensorflow as tf

    rng = np.random.RandomState(0)
    x = rng.randn(512, 64).astype("float32")
    y = rng.randn(512, 1).astype("float32")
    with (strategy.scope() if strategy else contextlib.nullcontext()):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256, activation="relu"),
                                  keras.layers.Dense(1)])
        model.compile(optimizer=make_optimizer(), loss="mse")      # Keras' default jit_compile="auto"
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        seconds.append(round(time.perf_counter() - start, 3))
    return {"jit_compile": model.jit_compile, "first_fit_s": seconds[0], "second_fit_s": seconds[1],
            "steps_per_fit": 512 // 32}


def main(argv):
    del argv
    import keras
    import tensorflow as tf
    from tfx_gradient_accumulator.accumulator import GradientAccumulator

    from benchmarks import accelerator_facts

    accelerator = accelerator_facts()
    facts = {"python": platform.python_version(), "tensorflow": tf.__version__, "keras": keras.__version__,
             "accelerator": accelerator,
             "env": {k: os.environ.get(k) for k in ("XLA_FLAGS", "CUDA_CACHE_MAXSIZE")}}
    accumulating = lambda: GradientAccumulator(keras.optimizers.Adam(1e-3), accum_steps=4)  # noqa: E731
    facts["default_fit"] = {"plain Adam": _first_and_next_fit(lambda: keras.optimizers.Adam(1e-3)),
                            "GradientAccumulator(Adam, 4)": _first_and_next_fit(accumulating)}
    if accelerator:
        strategy = tf.distribute.MirroredStrategy(["/gpu:0"])
        facts["default_fit"]["GradientAccumulator(Adam, 4), one-GPU MirroredStrategy"] = _first_and_next_fit(
            accumulating, strategy)
    text = json.dumps(facts, indent=1, default=str)
    print(text)
    if OUT.value:
        with open(OUT.value, "w") as f:
            f.write(text)
    if not accelerator:
        print("no GPU seen by TensorFlow: its log above says which library it could not load", file=sys.stderr)


if __name__ == "__main__":
    app.run(main)
