"""One worker of a 2-worker Keras 2 `GradientCache(gather_across_replicas=...)` run on 127.0.0.1.

Run by tests/keras2/test_keras2_gradient_cache_multiworker.py as a separate process with
TF_CONFIG set (and TF_USE_LEGACY_KERAS=1 where tf_keras is installed): the tf_keras
two-tower of test_keras2_gradient_cache.py, or with `--tfrs` the TFRS tutorial model of
test_tfrs_gradient_cache.py; global batches of `--batch`; writes its final weights to
`--out` (read by `tests.accumulator.multiworker.load_result`).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--gather", type=int, default=1)
    parser.add_argument("--tfrs", type=int, default=0)
    args = parser.parse_args()

    from tfx_gradient_accumulator.accumulator import GradientCache
    from tfx_gradient_accumulator.accumulator.core.distribute import strategy_from_environment

    strategy = strategy_from_environment()
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), strategy
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    if args.tfrs:
        from tests.keras2 import test_tfrs_gradient_cache as case
        data, make = case.interactions(), lambda: case.tutorial_model(**case.WORKER_KWARGS)
        optimizer = lambda: case.k2.optimizers.Adagrad(0.1)
    else:
        from tests.keras2 import test_keras2_gradient_cache as case
        data, make = case.interactions(), case.built
        optimizer = lambda: case.k2.optimizers.SGD(2.0)
    with strategy.scope():
        inner = make()
        model = GradientCache(inner, 4, gather_across_replicas=bool(args.gather))
        model.compile(optimizer=optimizer())
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(args.batch).with_options(options)
    model.fit(dataset, epochs=2, verbose=0)
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    result = {f"w{i}": w for i, w in enumerate(inner.get_weights())}
    result["iterations"] = np.array(int(model.optimizer.iterations.numpy()))
    np.savez(f"{args.out}.{task['index']}.npz", **result)


if __name__ == "__main__":
    sys.exit(main())
