"""Issue 46 on a lent GPU: the micro-batch `find_micro_batch` picks for the GPU-size
Transformer at E = 1024 under Keras' defaults, the probe's time, and the throughput of
`fit` at that micro-batch against micro-batches set by hand (one JSON line per result
into --out, written as each ends, so a cut run keeps what it measured).

    OUT=... python -m tools.gpu_fit_probe --out=$OUT/fit_probe.jsonl
"""
import argparse
import json
import time

import keras
import numpy as np

from benchmarks import models
from tfx_gradient_accumulator import GradientAccumulator, find_micro_batch

E = 1024
SIZE = "gpu"


def _compiled(accum_steps):
    model = models.build("transformer", SIZE)
    model.compile(optimizer=GradientAccumulator(keras.optimizers.Adam(1e-4), accum_steps=accum_steps),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _throughput(model, x, y, micro, updates):
    """Samples per second of `fit` over `updates` updates after one warm update."""
    accum = E // micro
    model.fit(x[:E], y[:E], batch_size=micro, epochs=1, verbose=0)       # trace and warm
    start = time.perf_counter()
    model.fit(x[:E * updates], y[:E * updates], batch_size=micro, epochs=1, verbose=0)
    float(model.optimizer.iterations.numpy())
    return E * updates / (time.perf_counter() - start), accum


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--updates", type=int, default=3)
    parser.add_argument("--by_hand", default="32,64,128")
    parser.add_argument("--size", default="gpu")
    parser.add_argument("--max_micro_batch", type=int, default=None,
                        help="the largest micro-batch the probe tries (fewer sizes: fewer XLA compiles)")
    args = parser.parse_args()
    global SIZE
    SIZE = args.size

    def write(record):
        print(json.dumps(record), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(record) + "\n")

    x, y = models.data("transformer", SIZE, E * (args.updates + 1))
    model = _compiled(accum_steps=2)
    start = time.perf_counter()
    found = find_micro_batch(model, x[:64], y[:64], effective_batch_size=E, uniform=True,
                             max_micro_batch=args.max_micro_batch)
    probe_seconds = time.perf_counter() - start
    write(dict(what="probe", effective_batch=E, micro_batch=found.micro_batch, accum_steps=found.accum_steps,
               largest_fitting=found.largest_fitting, probe_seconds=probe_seconds,
               probes=[str(p) for p in found.probes], jit_compile=str(model.jit_compile)))
    samples_per_s, accum = _throughput(model, x, y, found.micro_batch, args.updates)
    write(dict(what="fit", micro_batch=found.micro_batch, accum_steps=accum, samples_per_s=samples_per_s,
               chosen_by="probe"))
    for micro in [int(b) for b in args.by_hand.split(",")]:
        if micro == found.micro_batch or E % micro:
            continue
        try:
            samples_per_s, accum = _throughput(_compiled(E // micro), x, y, micro, args.updates)
        except Exception as error:      # noqa: BLE001 - an out-of-memory at a hand-set size is a result
            write(dict(what="fit", micro_batch=micro, error=type(error).__name__))
            continue
        write(dict(what="fit", micro_batch=micro, accum_steps=accum, samples_per_s=samples_per_s,
                   chosen_by="hand"))


if __name__ == "__main__":
    main()
