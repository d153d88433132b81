"""One measurement in its own process; prints one JSON line. Run by benchmarks/run.py.

    python -m benchmarks.measure throughput --model cnn --accum 4
    python -m benchmarks.measure memory --model cnn --accum 4 --contender accumulator
    python -m benchmarks.measure leak
    python -m benchmarks.measure mirrored --accum 4
"""

import json
import os
import random
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"

from absl import app, flags  # noqa: E402

MODE = flags.DEFINE_enum("mode", "throughput", ["throughput", "memory", "leak", "mirrored", "multiworker"],
                         "What to measure.")
MODEL = flags.DEFINE_string("model", "cnn", "cnn or attention_mlp.")
ACCUM = flags.DEFINE_integer("accum", 4, "N: micro-batches per update.")
MICRO = flags.DEFINE_integer("micro", 32, "b: the micro-batch.")
SAMPLES = flags.DEFINE_integer("samples", 4096, "Samples per timed segment (whole updates).")
ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds (median taken).")
CONTENDER = flags.DEFINE_string("contender", "accumulator", "For --mode=memory.")


def _rss_mb(field="VmRSS"):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _peak_reset():
    # Linux: writing 5 to clear_refs resets VmHWM to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def throughput():
    from benchmarks import contenders as c
    micro, accum = MICRO.value, ACCUM.value
    x, y = c.data(MODEL.value, micro * accum * 8)
    built = {name: c.build(name, MODEL.value, micro, accum, x, y) for name in c.CONTENDERS}
    for _, train in built.values():
        train(2)                                   # trace and warm up
    updates = max(1, SAMPLES.value // (micro * accum))
    samples = updates * micro * accum
    times = {name: [] for name in built}
    order = list(built)
    for _ in range(ROUNDS.value):
        random.shuffle(order)                      # interleave: no contender always first
        for name in order:
            start = time.perf_counter()
            built[name][1](updates)
            times[name].append(time.perf_counter() - start)
    return {"rates": {name: samples / statistics.median(t) for name, t in times.items()},
            "spread": {name: max(t) / min(t) - 1.0 for name, t in times.items()}}


def memory():
    import numpy as np
    from benchmarks import contenders as c
    micro, accum = MICRO.value, ACCUM.value
    x, y = c.data(MODEL.value, micro * accum * 4)
    model, train = c.build(CONTENDER.value, MODEL.value, micro, accum, x, y)
    params = int(sum(np.prod(v.shape) for v in model.trainable_variables)) * 4
    train(1)
    before = _rss_mb()
    reset = _peak_reset()
    train(3)
    gpu = None
    import tensorflow as tf
    if tf.config.list_physical_devices("GPU"):
        gpu = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    # Persistent optimizer state (Adam moments, accumulators) is allocated
    # before the measured steps; count its bytes exactly instead.
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.optimizer.variables)
    return {"peak_mb": _rss_mb("VmHWM"), "before_mb": before, "peak_reset": reset,
            "param_mb": params / 2**20, "state_mb": state / 2**20, "gpu_peak_mb": gpu}


def leak():
    import keras
    import numpy as np
    import tensorflow as tf
    from accumulator import GradientAccumulator
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(1)])
    model.compile(GradientAccumulator(keras.optimizers.Adam(1e-3), 4), "mse")
    x = np.random.RandomState(0).randn(1024, 16).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(8).repeat()
    model.fit(dataset, steps_per_epoch=1000, verbose=0)
    after_1k = _rss_mb()
    model.fit(dataset, steps_per_epoch=9000, verbose=0)
    after_10k = _rss_mb()
    return {"rss_after_1000_mb": after_1k, "rss_after_10000_mb": after_10k,
            "updates": int(model.optimizer.iterations.numpy())}


def mirrored():
    import tensorflow as tf
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    from benchmarks import distributed
    updates = max(1, SAMPLES.value // (4 * MICRO.value * ACCUM.value))
    return distributed.mirrored(MODEL.value, MICRO.value, ACCUM.value, updates, ROUNDS.value)


def multiworker():
    from benchmarks import distributed
    updates = max(1, SAMPLES.value // (4 * MICRO.value * ACCUM.value))
    return distributed.multiworker(MODEL.value, MICRO.value, ACCUM.value, updates, ROUNDS.value)


def main(argv):
    del argv
    result = {"throughput": throughput, "memory": memory, "leak": leak, "mirrored": mirrored,
              "multiworker": multiworker}[MODE.value]()
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
