"""A run_fn that makes its own strategy, as modules written for the stock Trainer do
(TFX's penguin example: `MirroredStrategy()` and its scope), trains under the
executor's strategy: one process here; 2 processes in test_cluster.py."""

import contextlib
import os

import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import hooks
from tfx_gradient_accumulator.components import run_fn_swaps
from tests.accumulator.reference import max_abs_diff
from tests.components import fixtures

KERAS2_MODULE = os.path.join(fixtures.TESTDATA, "keras2_regression_module.py")
MADE = {
    "MirroredStrategy": lambda: tf.distribute.MirroredStrategy(),
    "OneDeviceStrategy": lambda: tf.distribute.OneDeviceStrategy("/cpu:0"),
    "MultiWorkerMirroredStrategy": lambda: tf.distribute.MultiWorkerMirroredStrategy(),
    "experimental.MultiWorkerMirroredStrategy": lambda: tf.distribute.experimental.MultiWorkerMirroredStrategy(),
}


@pytest.fixture(scope="module")
def stock(examples, tmp_path_factory):
    """The stock Trainer at batch 32, in one process and one replica: the large batch. (With the
    module's own MirroredStrategy, the stock Trainer here trains on this session's 2 logical CPUs, and
    Keras clips each replica's gradient by norm apart: 2.2e-3 off the large batch.)"""
    return fixtures.run_executor(tmp_path_factory.mktemp("stock"), examples, num_steps=4, stock=True)[2]


def test_a_strategy_made_inside_the_context_is_the_executors_and_one_made_after_is_its_own():
    executors = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                               cross_device_ops=tf.distribute.ReductionToOneDevice())
    classes = (tf.distribute.MirroredStrategy, tf.distribute.OneDeviceStrategy,
               tf.distribute.MultiWorkerMirroredStrategy, tf.distribute.experimental.MultiWorkerMirroredStrategy,
               tf.distribute.experimental.CentralStorageStrategy, tf.distribute.Strategy)
    before = [dict(vars(cls)) for cls in classes]
    with run_fn_swaps.strategies_made_map_onto(executors):
        for name, make_one in MADE.items():
            made = make_one()
            assert type(made) is tf.distribute.MirroredStrategy and run_fn_swaps.is_stand_in(made, executors), name
            assert made.num_replicas_in_sync == 2
            with made.scope():
                assert tf.distribute.get_strategy() is executors
                assert len(tf.Variable(1.0).values) == 2            # a MirroredVariable on both devices
        with pytest.raises(ValueError, match=r"tf\.distribute\.experimental\.CentralStorageStrategy, which "
                                             r"AccumulatingTrainer cannot honour.*MirroredStrategy \(2 replica"):
            tf.distribute.experimental.CentralStorageStrategy()
    # The control: outside the context, each is made as TensorFlow makes it.
    own = tf.distribute.OneDeviceStrategy("/cpu:0")
    assert type(own) is tf.distribute.OneDeviceStrategy and own.num_replicas_in_sync == 1
    assert not run_fn_swaps.is_stand_in(own, executors)
    assert [dict(vars(cls)) for cls in classes] == before


def test_a_stand_ins_scope_reaches_the_librarys_mapping_as_the_executors_strategy(caplog):
    # The executor's order (`accumulating_compile(strategy=...)`, then the stand-ins) and the probe's
    # (`run_fn_swaps.under_strategy`): the library's mapping warns of a scope the run_fn opened on a
    # strategy of its own, never of a stand-in, which already warned when it was made.
    executors = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                               cross_device_ops=tf.distribute.ReductionToOneDevice())
    for entered in (lambda: [hooks.strategy_scopes_map_onto(executors), run_fn_swaps.strategies_made_map_onto(executors)],
                    lambda: [run_fn_swaps.under_strategy(executors)]):
        caplog.clear()
        with contextlib.ExitStack() as stack:
            for context in entered():
                stack.enter_context(context)
            with tf.distribute.MirroredStrategy().scope():
                assert tf.distribute.get_strategy() is executors
        messages = [r.getMessage() for r in caplog.records]
        assert any("run_fn constructed tf.distribute.MirroredStrategy" in m for m in messages), messages
        assert not any("opened the scope of its own" in m for m in messages), messages


# Apart (about 10 s each): a OneDeviceStrategy and a MultiWorkerMirroredStrategy made under the
# executor's default strategy; each is mapped onto it like MirroredStrategy
# (test_a_strategy_made_inside_the_context_is_the_executors_...), and ("mirrored", "auto") and
# ("multi_worker", "mirrored") train through that mapping here.
@pytest.mark.parametrize("own, strategy", [("mirrored", "auto"), pytest.param("one_device", "auto", marks=pytest.mark.apart),
                                           pytest.param("multi_worker", "auto", marks=pytest.mark.apart),
                                           ("default", "auto"), ("multi_worker", "mirrored")])
def test_a_run_fn_with_its_own_strategy_trains_under_the_executors_like_the_large_batch(
        own, strategy, examples, stock, tmp_path):
    _, seen, weights = fixtures.run_executor(tmp_path, examples, num_steps=4, accum_steps=4, effective_batch_size=32,
                                             strategy=strategy, custom_config={"own_strategy": own})
    # In-process "mirrored" is this session's 2 logical CPUs: 2 replicas of micro-batch 4.
    executors, replicas = ("MirroredStrategy", 2) if strategy == "mirrored" else ("_DefaultDistributionStrategy", 1)
    assert (seen["own_strategy"], seen["own_strategy_replicas"], seen["strategy"]) == (executors, replicas, executors)
    assert (seen["iterations"], seen["accum_steps"], seen["train_batch"]) == (4, 4, 8)
    print(f"[measured] run_fn's own {own} under the executor's {executors}: max |dw| vs the stock Trainer = "
          f"{max_abs_diff(weights, stock):.1e}")
    assert max_abs_diff(weights, stock) <= 1e-5


@pytest.mark.parametrize("own", [   # multi_worker's apart (24 s): the Keras 3 run_fn's runs above
    "mirrored", pytest.param("multi_worker", marks=pytest.mark.apart)])
def test_a_keras_2_run_fn_with_its_own_strategy_trains_under_the_executors(own, examples, tmp_path):
    pytest.importorskip("tf_keras")
    stock_weights = fixtures.run_executor(tmp_path / "stock", examples, num_steps=4, stock=True,
                                          module=KERAS2_MODULE)[2]
    _, seen, weights = fixtures.run_executor(tmp_path / "ours", examples, num_steps=4, accum_steps=4,
                                             effective_batch_size=32, module=KERAS2_MODULE, strategy="mirrored",
                                             custom_config={"own_strategy": own})
    assert (seen["keras"][:2], seen["strategy"], seen["iterations"]) == ("2.", "MirroredStrategy", 4)
    print(f"[measured] Keras 2 run_fn's own {own}: max |dw| vs the stock Trainer = "
          f"{max_abs_diff(weights, stock_weights):.1e}")
    assert max_abs_diff(weights, stock_weights) <= 1e-5


def test_a_strategy_the_executor_cannot_honour_is_refused_naming_it(examples, tmp_path):
    with pytest.raises(ValueError, match=r"run_fn constructed tf\.distribute\.experimental\.CentralStorageStrategy"):
        fixtures.run_executor(tmp_path, examples, num_steps=2, accum_steps=2,
                              custom_config={"own_strategy": "central_storage"})
    assert not os.path.exists(tmp_path / "model_run" / "seen.json")
    assert "__init__" in vars(tf.distribute.experimental.CentralStorageStrategy)     # restored, not deleted
