"""One measurement in its own process; prints one JSON line. Run by benchmarks/run.py.

    python -m benchmarks.measure --mode=throughput --workload=transformer --accums=2,4,8
    python -m benchmarks.measure --mode=memory --workload=wide_mlp --accums=4 --contender=accumulator
    python -m benchmarks.measure --mode=leak
    python -m benchmarks.measure --mode=mirrored --workload=tiny_cnn --accums=4
"""

import json
import math
import os
import random
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["KERAS_BACKEND"] = "tensorflow"

from benchmarks import allocator_statistics_on  # noqa: E402

allocator_statistics_on()

from absl import app, flags  # noqa: E402

MODE = flags.DEFINE_enum("mode", "throughput", ["throughput", "memory", "leak", "mirrored", "multiworker"],
                         "What to measure.")
WORKLOAD = flags.DEFINE_string("workload", "transformer", "A model of benchmarks/models.py.")
SIZE = flags.DEFINE_enum("size", None, ["cpu", "gpu"], "Model size; default: gpu when TensorFlow sees a GPU.")
ACCUMS = flags.DEFINE_list("accums", ["2", "8"], "N values (throughput: all in one process, interleaved).")
CONTENDERS = flags.DEFINE_list("contenders", None, "Throughput contenders (default: all).")
CONTENDER = flags.DEFINE_string("contender", "accumulator", "For --mode=memory.")
ROUNDS = flags.DEFINE_integer("rounds", 5, "Interleaved rounds.")
SEGMENT_SECONDS = flags.DEFINE_float("segment_seconds", 0.8, "Aimed length of one timed segment.")
SEED = flags.DEFINE_integer("seed", 0, "Seed of the round orders.")
INTER_OP = flags.DEFINE_integer("inter_op_threads", 0, "TensorFlow inter-op threads (0: its default).")


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


def load():
    return [round(v, 2) for v in os.getloadavg()]


def _size():
    import tensorflow as tf
    return SIZE.value or ("gpu" if tf.config.list_physical_devices("GPU") else "cpu")


def throughput():
    """All contenders at all N of one workload, interleaved in rounds.

    Every cell (contender, N) trains the same number of micro-steps S per
    round (a multiple of every N, so whole windows); a round visits the N
    values in a random order and, at each, the contenders in a random order. plain b and plain b (loop) are built once and
    measured at every N: their work does not depend on N, which is what the
    sanity check tests.
    """
    import tensorflow as tf
    from benchmarks import contenders as c
    from benchmarks import models

    load_start = load()
    size, workload = _size(), WORKLOAD.value
    accums = [int(a) for a in ACCUMS.value]
    names = CONTENDERS.value or c.CONTENDERS
    micro = models.config(workload, size)["micro"]
    lcm = math.lcm(*accums)
    x, y = models.data(workload, size, micro * max(accums) * 4)

    built, shared, did_not_fit, build_seconds = {}, {}, [], {}
    for n in accums:
        for name in names:
            start = time.perf_counter()
            if name in c.N_INDEPENDENT:
                if name not in shared:
                    shared[name] = c.build(name, workload, size, 1, x, y)
                    shared[name].run(1)         # trace, warm up
                    print(f"built and warmed {name} in {time.perf_counter() - start:.2f} s", file=sys.stderr, flush=True)
                built[(name, n)] = shared[name]
                continue
            try:
                contender = c.build(name, workload, size, n, x, y)
                contender.run(n)                # trace, warm up
            except tf.errors.ResourceExhaustedError:
                did_not_fit.append([name, n])
                continue
            built[(name, n)] = contender
            build_seconds[f"{name}@{n}"] = round(time.perf_counter() - start, 2)
            # Progress on stderr: a measurement cut before its first round says where its time went.
            print(f"built and warmed {name}@{n} in {build_seconds[f'{name}@{n}']} s", file=sys.stderr, flush=True)

    # The step time of plain b sizes the segments.
    reference = built.get(("plain_b", accums[0])) or next(iter(built.values()))
    step = min(reference.run(lcm) for _ in range(2)) / lcm
    segment = lcm * max(1, round(SEGMENT_SECONDS.value / step / lcm))

    seconds = {f"{name}@{n}": [] for name, n in built}
    loads = []
    rng = random.Random(SEED.value)
    first = next(iter(built.values())).model
    result = {"workload": workload, "size": size, "micro": micro, "accums": accums,
              "contenders": names, "segment_micro_steps": segment, "warm_step_seconds": step,
              "param_bytes": models.parameter_bytes(first), "description": models.describe(workload, size),
              "seconds": seconds, "did_not_fit": did_not_fit, "build_seconds": build_seconds,
              "load_start": load_start, "segment_load_1min": loads}
    for _ in range(ROUNDS.value):
        # A round: the N values in a random order; at each, its contenders in
        # a random order (so the two sides of a ratio are measured seconds apart).
        blocks = list(accums)
        rng.shuffle(blocks)
        round_loads = {}
        for n in blocks:
            cells = sorted(key for key in built if key[1] == n)
            rng.shuffle(cells)
            for name, _ in cells:
                before = os.getloadavg()[0]
                seconds[f"{name}@{n}"].append(built[(name, n)].run(segment))
                round_loads[f"{name}@{n}"] = [round(before, 2), round(os.getloadavg()[0], 2)]
        loads.append(round_loads)
        _write_partial({**result, "load_end": load(), "rounds_completed": len(loads)})
    return {**result, "load_end": load()}


def _write_partial(result):
    """The rounds measured so far, to $BENCH_PARTIAL (set by run.py): a measurement cut
    by its time limit (a GPU lease's minutes) keeps its completed rounds."""
    path = os.environ.get("BENCH_PARTIAL")
    if path:
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)


def memory():
    """Peak training memory of one contender, in this (fresh) process.

    The baseline is the process's resident memory once the model (weights), its
    data and the compiled model exist, before the first step; the high-water
    mark (VmHWM) is reset there and read after one `fit` call (warm steps, then
    2 windows), and also batch by batch (`per_batch_growth_mb`: where the peak
    happens). The growth is everything training adds: the optimizer's state,
    gradients, window buffers and other temporaries, and the traced graphs. On
    a GPU, the accelerator's peak over its baseline too.
    """
    import keras
    import numpy as np
    import tensorflow as tf
    from benchmarks import contenders as c
    from benchmarks import models

    load_start = load()
    size, workload = _size(), WORKLOAD.value
    accum = int(ACCUMS.value[0])
    micro = models.config(workload, size)["micro"]
    x, y = models.data(workload, size, micro * accum * 4)
    gpu = bool(tf.config.list_physical_devices("GPU"))
    contender = c.build(CONTENDER.value, workload, size, accum, x, y)
    model = contender.model
    device = "GPU:0" if gpu else "CPU:0"

    def allocated(key):         # bytes held by TensorFlow's allocator on `device`
        return tf.config.experimental.get_memory_info(device)[key] / 2**20

    tf.config.experimental.reset_memory_stats(device)
    tensors_before = allocated("current")
    before = _rss_mb()
    reset = _peak_reset()
    # Where the peak happens: the peaks of each batch (reset at its start),
    # over the baseline; a window closes at every accum-th micro-step.
    per_batch, per_batch_held, per_batch_rss = [], [], []
    outside = {"tensors": tensors_before, "rss": before}

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            outside["tensors"] = max(outside["tensors"], allocated("peak"))
            outside["rss"] = max(outside["rss"], _rss_mb("VmHWM"))
            tf.config.experimental.reset_memory_stats(device)
            _peak_reset()

        def on_train_batch_end(self, batch, logs=None):
            per_batch.append(round(allocated("peak") - tensors_before, 1))
            # What stays allocated between steps: the state, and nothing else should.
            per_batch_held.append(round(allocated("current") - tensors_before, 1))
            per_batch_rss.append(round(_rss_mb("VmHWM") - before, 1))
            tf.config.experimental.reset_memory_stats(device)
            _peak_reset()

    contender.callbacks.append(Probe())
    contender.run(2 * accum)
    tensors_peak = max(outside["tensors"], allocated("peak"), tensors_before + max(per_batch))
    peak = max(outside["rss"], _rss_mb("VmHWM"), before + max(per_batch_rss))
    after = _rss_mb()
    state = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.optimizer.variables)
    return {"contender": CONTENDER.value, "workload": workload, "size": size, "accum": accum, "micro": micro,
            "device": device, "tensors_before_mb": tensors_before, "tensors_peak_mb": tensors_peak,
            "tensor_growth_mb": tensors_peak - tensors_before, "per_batch_tensor_growth_mb": per_batch,
            "per_batch_tensor_held_mb": per_batch_held,
            "rss_before_mb": before, "rss_peak_mb": peak, "rss_after_mb": after, "rss_growth_mb": peak - before,
            "per_batch_rss_growth_mb": per_batch_rss, "peak_reset": reset,
            "param_mb": models.parameter_bytes(model) / 2**20, "optimizer_state_mb": state / 2**20,
            "inter_op_threads": INTER_OP.value, "load_start": load_start, "load_end": load()}


def leak():
    import keras
    import numpy as np
    import tensorflow as tf
    from tfx_gradient_accumulator.accumulator import GradientAccumulator
    load_start = load()
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
            "updates": int(model.optimizer.iterations.numpy()), "load_start": load_start, "load_end": load()}


def _distributed(run):
    from benchmarks import models
    accum = int(ACCUMS.value[0])
    micro = models.config(WORKLOAD.value, "cpu")["micro"]
    updates = max(1, 128 // accum)
    load_start = load()
    result = run(WORKLOAD.value, micro, accum, updates, ROUNDS.value)
    return {**result, "load_start": load_start, "load_end": load()}


def mirrored():
    import tensorflow as tf
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2)
    from benchmarks import distributed
    return _distributed(distributed.mirrored)


def multiworker():
    from benchmarks import distributed
    return _distributed(distributed.multiworker)


def main(argv):
    del argv
    if INTER_OP.value:
        import tensorflow as tf
        tf.config.threading.set_inter_op_parallelism_threads(INTER_OP.value)
    result = {"throughput": throughput, "memory": memory, "leak": leak, "mirrored": mirrored,
              "multiworker": multiworker}[MODE.value]()
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    app.run(main)
