"""One worker of a 2-worker MultiWorkerMirroredStrategy run on 127.0.0.1.

Run by tests/accumulator/test_multiworker.py as a separate process with TF_CONFIG
set; trains and writes the final weights (chief only) to `--out`.
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
    parser.add_argument("--micro", type=int, default=16, help="global micro-batch")
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--steps-per-epoch", type=int, default=32, help="micro-batches per epoch")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--hooks", default="all",
                        help="accumulator.core.seam hooks to install: 'all' (what `import accumulator` does), "
                             "or comma-separated names, or none")
    parser.add_argument("--partial-window", default="apply")
    parser.add_argument("--backup", default="")
    parser.add_argument("--save-freq", type=int, default=0)
    parser.add_argument("--keras2", action="store_true", help="a Keras 2 (tf_keras) model and optimizer")
    parser.add_argument("--embedding", action="store_true",
                        help="the embedding model (sparse gradients) and plain Adam")
    parser.add_argument("--positions", action="store_true",
                        help="keras.io's token and position embedding (a lookup made once per batch) and plain Adam")
    parser.add_argument("--die-at", type=int, default=-1, help="SIGKILL self after this global micro-step")
    parser.add_argument("--auto-overhead", type=float, default=0.0,
                        help="> 0: AutoAccumulation with this max_sample_overhead grows the window from --accum "
                             "(up to 8 micro-batches); each worker writes the schedule it took")
    parser.add_argument("--find-micro-batch", type=int, default=0,
                        help="> 0: the effective batch E; find_micro_batch on a memory_cliff MLP whose cliff "
                             "is --cliffs' entry for this worker, then fit at the split it found; each "
                             "worker writes what it found")
    parser.add_argument("--cliffs", default="", help="per worker, comma-separated (with --find-micro-batch)")
    parser.add_argument("--then-embedding", type=int, default=0,
                        help="> 0: after the run, the same cluster trains the embedding model (plain Adam, "
                             "--accum) on this many micro-batches and writes it to `<out>.embedding`")
    args = parser.parse_args()

    if args.hooks != "all":
        os.environ["ACCUMULATOR_KERAS_HOOKS"] = "0"
    import keras
    from tfx_gradient_accumulator.accumulator import GradientAccumulator, hooks
    from tfx_gradient_accumulator.accumulator.core import flavours
    if args.hooks != "all":
        hooks.install([h for h in args.hooks.split(",") if h and h != "none"])
    # The tests that show a fix is needed use a plain optimizer (accum 1, no wrapper).
    from tests.accumulator import reference as ref

    from tfx_gradient_accumulator.accumulator.core.distribute import strategy_from_environment
    strategy = strategy_from_environment()
    assert isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy), strategy
    samples = args.micro * args.steps_per_epoch
    x, y = ref.token_data(samples) if args.embedding else ref.regression_data(samples)
    if args.positions:
        from tests.accumulator.test_lookups import text_data, text_model
        x, y = text_data(samples)
    if args.keras2:
        keras = flavours.keras2_module()
    if args.find_micro_batch:
        return _fit_at_the_micro_batch_found(args, strategy, x, y)
    with strategy.scope():
        if args.embedding:
            model, optimizer = ref.embedding_model(), keras.optimizers.Adam(1e-2)
        elif args.positions:
            model, optimizer = text_model(), keras.optimizers.Adam(1e-2)
        else:
            model = keras2_mlp(keras, x.shape[1]) if args.keras2 else ref.mlp()
            optimizer = keras.optimizers.AdamW(
                keras.optimizers.schedules.ExponentialDecay(1e-2, 4, 0.5), weight_decay=0.05,
                global_clipnorm=0.05)
        if args.accum > 1:
            optimizer = GradientAccumulator(optimizer, args.accum, partial_window=args.partial_window,
                                            schedulable=args.auto_overhead > 0,
                                            measure_noise_scale=args.auto_overhead > 0)
        model.compile(optimizer=optimizer, loss="mse")

    dataset = _sharded(x, y, args.micro)

    callbacks = []
    if args.backup:
        # One folder per worker: Keras' callback does not separate them itself.
        callbacks.append(keras.callbacks.BackupAndRestore(
            os.path.join(args.backup, f"worker{_task_index()}"), save_freq=args.save_freq or "epoch"))
    if args.die_at >= 0:
        class Die(keras.callbacks.Callback):
            def __init__(self):
                super().__init__()
                self.seen = 0
            def on_train_batch_end(self, batch, logs=None):
                self.seen += 1
                if self.seen == args.die_at:
                    os.kill(os.getpid(), 9)
        callbacks.append(Die())
    auto = None
    if args.auto_overhead > 0:
        from tfx_gradient_accumulator.accumulator import AutoAccumulation
        auto = AutoAccumulation(micro_batch_size=args.micro, max_effective_batch_size=8 * args.micro,
                                start_accum_steps=args.accum, max_sample_overhead=args.auto_overhead,
                                confidence=0.6, min_windows=2, lr_ramp_updates=0, lr_scaling="sqrt", geometry="raw")
        callbacks.append(auto)
    model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=callbacks)
    if args.accum > 1:
        # A carried window is applied on demand: a collective, on every worker.
        optimizer.close_partial_window("apply")
    result = _result(model)
    if auto is not None:
        result["schedule"] = np.array(json.dumps(auto.schedule))
        print("auto readings", auto.readings, flush=True)
    np.savez(f"{args.out}.{_task_index()}.npz", **result)
    if args.then_embedding:
        _then_the_embedding(args, strategy)


def _then_the_embedding(args, strategy):
    """--then-embedding: `--embedding`'s run, next in the same processes (a cluster's start saved)."""
    import keras
    from tfx_gradient_accumulator.accumulator import GradientAccumulator
    from tests.accumulator import reference as ref

    x, y = ref.token_data(args.micro * args.then_embedding)
    with strategy.scope():
        model = ref.embedding_model()
        optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), args.accum, partial_window=args.partial_window)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(_sharded(x, y, args.micro), epochs=args.epochs, verbose=0)
    optimizer.close_partial_window("apply")
    np.savez(f"{args.out}.embedding.{_task_index()}.npz", **_result(model))


def _fit_at_the_micro_batch_found(args, strategy, x, y):
    """find_micro_batch on a cluster whose workers' cliffs differ, then `fit` at its split."""
    import keras
    from tfx_gradient_accumulator.accumulator import GradientAccumulator, find_micro_batch
    from tests.accumulator import memory_cliff

    cliff = int(args.cliffs.split(",")[_task_index()])
    with strategy.scope():
        model = memory_cliff.mlp(cliff=cliff)
        model.compile(optimizer=GradientAccumulator(keras.optimizers.Adam(1e-2), schedulable=True), loss="mse")
    found = find_micro_batch(model, x[:8], y[:8], effective_batch_size=args.find_micro_batch, uniform=True)
    model.fit(_sharded(x, y, found.micro_batch), epochs=args.epochs, verbose=0)
    result = _result(model)
    result.update(micro_batch=np.array(found.micro_batch), accum_steps=np.array(found.accum_steps),
                  largest_fitting=np.array(found.largest_fitting), probes=np.array(json.dumps(found.probes)))
    np.savez(f"{args.out}.{_task_index()}.npz", **result)


def _task_index():
    """This worker's index in TF_CONFIG."""
    return json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def _sharded(x, y, micro):
    """The arrays as global micro-batches of `micro`, sharded across the workers by data."""
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.DATA
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(micro).with_options(options)


def _result(model):
    """What every run writes: the weights (w0, w1, ...) and the optimizer's update count."""
    result = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    result["iterations"] = np.array(int(model.optimizer.iterations.numpy()))
    return result


def keras2_mlp(keras2, features):
    """The Keras 2 model of the Keras 2 multi-worker test (tests/keras2)."""
    keras2.utils.set_random_seed(0)
    return keras2.Sequential([
        keras2.layers.Dense(8, activation="tanh", input_shape=(features,)), keras2.layers.Dense(1)])


if __name__ == "__main__":
    sys.exit(main())
