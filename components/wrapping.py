"""The strategy the user's run_fn runs under, and only while it runs.

`accumulator.autowrap.accumulating_compile` does the other half: it wraps the
optimizers the run_fn compiles with.
"""

import contextlib

import tensorflow as tf
from absl import logging
from tensorflow.python.distribute import distribute_lib


@contextlib.contextmanager
def strategy_scope(strategy):
    """Runs the body under `strategy`; other strategies' scopes map onto it."""
    if strategy is tf.distribute.get_strategy() and not tf.distribute.has_strategy():
        yield
        return
    original = distribute_lib.StrategyBase.scope

    def scope(self):
        if self is not strategy:
            logging.warning(
                "run_fn opened the scope of its own %s; it trains under the "
                "executor's %s (%d replicas) instead.",
                type(self).__name__, type(strategy).__name__, strategy.num_replicas_in_sync,
            )
        return original(strategy)

    with original(strategy):
        distribute_lib.StrategyBase.scope = scope
        try:
            yield
        finally:
            distribute_lib.StrategyBase.scope = original
