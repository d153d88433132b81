"""One worker of a 2-worker `GradientCache(gather_across_replicas=...)` run on 127.0.0.1.

Run by tests/accumulator/test_gradient_cache_multiworker.py as a separate process with
TF_CONFIG set: the contrastive two-tower model, global batches of `--batch`, SGD;
writes its final weights to `--out` (read by `multiworker.load_result`).
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
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--gather", type=int, default=1)
    args = parser.parse_args()

    import keras
    from tfx_gradient_accumulator.accumulator import GradientCache
    from tfx_gradient_accumulator.accumulator.core.distribute import strategy_from_environment
    from tests.accumulator import contrastive_models as cm

    strategy = strategy_from_environment()
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), strategy
    data = cm.interactions()
    with strategy.scope():
        inner = cm.built("two_tower")
        model = GradientCache(inner, args.accum, gather_across_replicas=bool(args.gather))
        model.compile(optimizer=keras.optimizers.SGD(2.0))
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(args.batch).with_options(options)
    model.fit(dataset, epochs=2, verbose=0)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    result = {f"w{i}": w for i, w in enumerate(inner.get_weights())}
    result["iterations"] = np.array(int(model.optimizer.iterations.numpy()))
    np.savez(f"{args.out}.{task['index']}.npz", **result)


if __name__ == "__main__":
    sys.exit(main())
