"""One worker of a 2-worker MultiWorkerMirroredStrategy run of `micro_batch_size="auto"`.

Run by tests/accumulator/test_fit_auto_micro_batch_distributed.py through
`tests.accumulator.multiworker.run_cluster` (TF_CONFIG set): the text model of
test_fit_auto_micro_batch (an `Embedding`, sequences padded per batch of E = 12), with a
token cliff of `--budget` on worker `--cliff-on` only (the other has no cliff at all).
Every worker writes its weights, its update count, its b and its changes, the logged
loss and mae, and the collective ops its step's two halves hold to `--out`.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--budget", type=int, required=True, help="tokens a replica's micro-step fits")
    parser.add_argument("--cliff-on", type=int, required=True, help="the worker with the cliff")
    args = parser.parse_args()

    import keras
    from tfx_gradient_accumulator.accumulator import GradientAccumulator
    from tfx_gradient_accumulator.accumulator.core.distribute import strategy_from_environment
    from tests.accumulator import memory_cliff
    from tests.accumulator.test_fit_auto_micro_batch import VOCABULARY, _adam, _dataset, _rows

    strategy = strategy_from_environment()
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), strategy
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        # Metrics only where Keras keeps them per replica (3.15; 3.8 mirrors them, refused under a strategy).
        kept = keras.metrics.Mean().variables[0].value.synchronization == tf.VariableSynchronization.ON_READ
        model = memory_cliff.embedding_model(args.budget if index == args.cliff_on else None, VOCABULARY)
        model.compile(GradientAccumulator(_adam(), micro_batch_size="auto"), "mse", metrics=["mae"] if kept else [])
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    history = model.fit(_dataset(_rows()).with_options(options), epochs=2, verbose=0).history
    result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    result["iterations"] = np.array(int(model.optimizer.iterations.numpy()))
    records = [{k: v for k, v in c.as_record().items() if k != "seconds_lost"}
               for c in model.optimizer.micro_batch_changes]
    split = model.train_function.split_step
    collectives = {"first": sorted(o for o in split.op_types(first=True) if "Collective" in o or "Nccl" in o),
                   "second": sorted(o for o in split.op_types(first=False) if "Collective" in o or "Nccl" in o)}
    result["auto"] = np.array(json.dumps({"micro_batch_size": model.optimizer.micro_batch_size, "changes": records,
                                          "history": history, "collectives": collectives}))
    np.savez(f"{args.out}.{index}.npz", **result)


if __name__ == "__main__":
    sys.exit(main())
