"""MirroredStrategy over 2 logical CPUs: exact windows, one reduction per update."""

import functools

import numpy as np
import keras
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests import fork_server
from tests.accumulator import reference as ref

DEVICES = ["/cpu:0", "/cpu:1"]
MICRO = 16          # global micro-batch: 8 per replica
ACCUM = 4
UPDATES = 8


def _strategy():
    counter = ref.CountingReduction()
    return tf.distribute.MirroredStrategy(DEVICES, cross_device_ops=counter), counter


def _adam():
    return keras.optimizers.Adam(keras.optimizers.schedules.ExponentialDecay(1e-2, 4, 0.5))


def _adamw_clipped():
    return keras.optimizers.AdamW(
        keras.optimizers.schedules.CosineDecay(1e-2, UPDATES), weight_decay=0.05, global_clipnorm=0.05
    )


def _sgd_clipped():
    return keras.optimizers.SGD(0.1, momentum=0.9, nesterov=True, clipnorm=0.02)


@pytest.fixture(scope="module")
def data():
    return ref.regression_data(MICRO * ACCUM * UPDATES)


def _fit_under(strategy, make_optimizer, x, y, batch_size, accum_steps=None, epochs=1):
    with strategy.scope():
        model = ref.mlp()
        optimizer = make_optimizer()
        if accum_steps:
            optimizer = GradientAccumulator(optimizer, accum_steps)
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model


@functools.lru_cache(maxsize=None)
def _accumulated():
    """Adam accumulated over 8 windows of 4 under a counting strategy: (the strategy, the model,
    the reductions counted); the same run for the two tests below (read only)."""
    x, y = ref.regression_data(MICRO * ACCUM * UPDATES)
    strategy, counter = _strategy()
    model = _fit_under(strategy, _adam, x, y, MICRO, ACCUM)
    return strategy, model, int(counter.count.numpy())


def test_fit_matches_large_batch_under_the_same_strategy(data):
    x, y = data
    strategy, model, _ = _accumulated()
    expected = _fit_under(strategy, _adam, x, y, MICRO * ACCUM)
    assert int(model.optimizer.iterations.numpy()) == UPDATES
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-5


def test_each_epochs_last_window_is_applied_across_replicas():
    # 10 micro-batches an epoch in windows of 4: 4, 4 and 2 per epoch, as the
    # large batch's 64, 64 and 32 samples.
    x, y = ref.regression_data(MICRO * 10)
    strategy, _ = _strategy()
    expected = _fit_under(strategy, _adam, x, y, MICRO * ACCUM, epochs=2)
    model = _fit_under(strategy, _adam, x, y, MICRO, ACCUM, epochs=2)
    assert int(model.optimizer.iterations.numpy()) == 6
    assert int(model.optimizer.micro_step.numpy()) == 0
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-5


@pytest.mark.parametrize("make", [_adamw_clipped, _sgd_clipped], ids=["adamw_global_clipnorm", "sgd_clipnorm"])
def test_clipping_acts_on_the_global_gradient(make, data):
    """Clipping sees the all-reduced window gradient: the single-device result.

    Stock Keras clips each replica's share before reducing, so its mirrored
    large-batch run drifts from the single-device one; ours does not.
    """
    x, y = data
    strategy, _ = _strategy()
    single_device = ref.fit_large_batch(ref.mlp(), make(), x, y, MICRO * ACCUM)
    model = _fit_under(strategy, make, x, y, MICRO, ACCUM)
    assert ref.max_abs_diff(model.get_weights(), single_device.get_weights()) <= 1e-5


def test_custom_strategy_run_loop_matches_single_device_tape_loop(data):
    x, y = data
    loss_fn = keras.losses.MeanSquaredError(reduction="none")
    expected = ref.tape_accumulation_loop(
        ref.mlp(), _sgd_clipped(), x, y, MICRO, ACCUM, keras.losses.MeanSquaredError()
    )
    strategy, _ = _strategy()
    with strategy.scope():
        model = ref.mlp()
        optimizer = GradientAccumulator(_sgd_clipped(), ACCUM)
        optimizer.build(model.trainable_variables)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(MICRO)
    )

    @tf.function
    def step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                per_example = loss_fn(yb, model(xb, training=True))
                loss = tf.nn.compute_average_loss(per_example, global_batch_size=MICRO)
            grads = tape.gradient(loss, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
        strategy.run(replica_step, args=batch)

    for batch in dataset:
        step(batch)
    assert int(optimizer.iterations.numpy()) == UPDATES
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-5


def test_one_cross_replica_reduction_per_update(data):
    x, y = data
    accumulated = _accumulated()[2]

    strategy, counter = _strategy()
    _fit_under(strategy, _adam, x, y, MICRO)  # a plain optimizer reduces every step
    per_step = int(counter.count.numpy())

    assert per_step == UPDATES * ACCUM
    assert accumulated == UPDATES


def test_uneven_micro_batches_are_weighted_across_replicas():
    """100 samples in global micro-batches of 32, 32, 32, 4 on 2 replicas: one exact step."""
    x, y = ref.regression_data(100)
    single_device = ref.fit_large_batch(ref.mlp(), _adamw_clipped(), x, y, 100)
    strategy, counter = _strategy()
    model = _fit_under(strategy, _adamw_clipped, x, y, 32, ACCUM)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert int(counter.count.numpy()) == 1
    assert ref.max_abs_diff(model.get_weights(), single_device.get_weights()) <= 1e-5


_WITHOUT_MERGE_CALL = """
import os
os.environ["KERAS_BACKEND"] = "tensorflow"
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
import keras
from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tests.accumulator import reference as ref
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
strategy.extended._use_merge_call = lambda: False   # as XLA-compiled GPU steps do
x, y = ref.regression_data(64)
with strategy.scope():
    model = ref.mlp()
    model.compile(GradientAccumulator(keras.optimizers.SGD(0.1), 4), "mse")
try:
    model.fit(x, y, batch_size=16, verbose=0)
except NotImplementedError as err:
    print("REFUSED:", err)
"""


def test_without_merge_call_the_accumulator_says_what_to_do():
    """A CPU strategy put in the state XLA-compiled GPU steps run in: no merge_call.

    On GPUs Keras' own optimizers fail there (keras#17187); on CPU threads the
    emulation cannot show that, only that the refusal comes with its remedy.
    In its own process: TensorFlow gives every MirroredStrategy the same
    collective keys, so the collectives it starts would clash with later tests'.
    """
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = fork_server.run([sys.executable, "-c", _WITHOUT_MERGE_CALL], capture_output=True, timeout=300, cwd=root,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REFUSED:" in out.stdout and "jit_compile=False" in out.stdout, out.stdout[-2000:]
