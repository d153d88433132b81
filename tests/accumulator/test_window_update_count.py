"""`optimizer.iterations` counts the updates made, also when `fit` runs a finite
dataset of unknown size to its end.

There Keras (3.15.1 at least) runs the step once more on the exhausted iterator:
the step fails on its data, but the optimizer's count, which does not depend on the
data, has already gone up: a stock optimizer ends one update higher per epoch than
it made (the control below). The accumulator's count waits for the gradients, in
every mode (pass-through, windows, GradientCache), so what the Trainer records
(`optimizer_updates`) is the updates made.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator, GradientCache
from tests.accumulator import contrastive_models as cm
from tests.accumulator import reference as ref

SAMPLES, BATCH, EPOCHS = 64, 8, 2
BATCHES = SAMPLES // BATCH


def _unknown_size(data, batch=BATCH):
    dataset = tf.data.Dataset.from_tensor_slices(data).filter(
        tf.autograph.experimental.do_not_convert(lambda *_: True)).batch(batch)
    assert dataset.cardinality() == tf.data.UNKNOWN_CARDINALITY
    return dataset


def _fit(optimizer):
    model = ref.mlp(0)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(_unknown_size(ref.regression_data(SAMPLES)), epochs=EPOCHS, verbose=0)
    return model


def test_control_a_stock_optimizer_counts_the_extra_step_or_none():
    # Keras versions that run no extra step count right; those that do, one per epoch.
    count = int(_fit(keras.optimizers.SGD(0.01)).optimizer.iterations.numpy())
    assert count in (EPOCHS * BATCHES, EPOCHS * (BATCHES + 1))


@pytest.mark.parametrize("accum_steps, schedulable, updates", [
    (1, False, BATCHES),            # pass-through: the inner optimizer, transparently
    (1, True, BATCHES),             # windows of one
    (2, False, BATCHES // 2),
    (3, False, 3),                  # 8 micro-batches: 2 windows and a partial one applied
])
def test_the_count_is_the_updates_made(accum_steps, schedulable, updates):
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.01), accum_steps=accum_steps,
                                    schedulable=schedulable)
    model = _fit(optimizer)
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * updates


def test_the_pass_through_trains_as_the_stock_optimizer():
    stock = _fit(keras.optimizers.SGD(0.01))
    ours = _fit(GradientAccumulator(keras.optimizers.SGD(0.01), accum_steps=1))
    assert ref.max_abs_diff(ours.get_weights(), stock.get_weights()) == 0.0


def test_gradient_cache_counts_the_updates_made():
    model = GradientCache(cm.built("two_tower"), 4)
    model.compile(optimizer=keras.optimizers.SGD(0.1))
    model.fit(_unknown_size(cm.interactions(128), batch=32), epochs=EPOCHS, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == EPOCHS * 4
