"""One worker of a 2-worker MultiWorkerMirroredStrategy run of Keras 2's `micro_batch_size` on 127.0.0.1.

Run by tests/keras2/test_fit_effective_batch_keras2_distributed.py through
`tests.accumulator.multiworker.run_cluster` (TF_CONFIG set): `fit` over a dataset batched at
the effective batch, each batch one update from micro-batches of `--micro` (global); every
worker writes its weights, its update count and the logged losses to `--out` (with `--mixed`,
a mixed_float16 model and its loss scale too).
"""

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402


def optimizer(keras2):
    """AdamW with a schedule and a global clipnorm: clipping acts on the global gradient."""
    return keras2.optimizers.AdamW(keras2.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.5),
                                   weight_decay=0.05, global_clipnorm=0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--samples", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True, help="the effective batch E (global)")
    parser.add_argument("--micro", type=int, required=True, help="micro_batch_size (global)")
    parser.add_argument("--mixed", action="store_true", help="mixed_float16 under compile's defaults")
    args = parser.parse_args()

    from tfx_gradient_accumulator.accumulator import GradientAccumulator
    from tfx_gradient_accumulator.accumulator.core import flavours
    from tfx_gradient_accumulator.accumulator.core.distribute import strategy_from_environment
    from tests.keras2.test_fit_effective_batch_keras2_distributed import _data, _mlp
    from tests.keras2.test_fit_effective_batch_keras2_mixed import _mlp as _mixed_mlp

    keras2 = flavours.keras2_module()
    if args.mixed:
        keras2.mixed_precision.set_global_policy("mixed_float16")
    strategy = strategy_from_environment()
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), strategy
    x, y = _data(args.samples)
    with strategy.scope():
        model = _mixed_mlp() if args.mixed else _mlp()
        model.compile(optimizer=GradientAccumulator(optimizer(keras2), micro_batch_size=args.micro), loss="mse")
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).with_options(options)
    history = model.fit(data, epochs=1, verbose=0).history
    result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    result["iterations"] = np.array(int(model.optimizer.iterations.numpy()))
    if args.mixed:
        result["scale"] = np.array(float(model.optimizer.loss_scale_optimizer.loss_scale.numpy()))
    result["loss"] = np.array(json.dumps(history["loss"]))
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    np.savez(f"{args.out}.{index}.npz", **result)


if __name__ == "__main__":
    sys.exit(main())
