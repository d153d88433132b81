"""One worker of a 2-worker MultiWorkerMirroredStrategy run of `micro_batch_size` on 127.0.0.1.

Run by tests/accumulator/test_fit_effective_batch_distributed.py through
`tests.accumulator.multiworker.run_cluster` (TF_CONFIG set): `fit` over a dataset batched
at the effective batch, each batch one update from micro-batches of `--micro` (global);
every worker writes its weights, its update count and the logged losses to `--out`.
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def optimizer(keras):
    """AdamW with a schedule and a global clipnorm: clipping acts on the global gradient."""
    return keras.optimizers.AdamW(keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5),
                                  weight_decay=0.05, global_clipnorm=0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True, help="the effective batch E (global)")
    parser.add_argument("--micro", type=int, required=True, help="micro_batch_size (global)")
    args = parser.parse_args()

    import keras
    from tfx_gradient_accumulator.accumulator import GradientAccumulator
    from tfx_gradient_accumulator.accumulator.core.distribute import strategy_from_environment
    from tests.accumulator import reference as ref

    strategy = strategy_from_environment()
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), strategy
    x, y = ref.regression_data(args.samples)
    with strategy.scope():
        model = ref.mlp()
        model.compile(optimizer=GradientAccumulator(optimizer(keras), micro_batch_size=args.micro), loss="mse")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).with_options(options)
    history = model.fit(data, epochs=1, verbose=0).history
    result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    result["iterations"] = np.array(int(model.optimizer.iterations.numpy()))
    result["loss"] = np.array(json.dumps(history["loss"]))
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    np.savez(f"{args.out}.{index}.npz", **result)


if __name__ == "__main__":
    sys.exit(main())
