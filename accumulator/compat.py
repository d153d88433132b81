"""Workarounds for Keras 3 bugs that stop `fit` under MultiWorkerMirroredStrategy.

keras-team/keras#20585: Keras 3 `model.fit` fails with several workers. Two
causes, each fixed here by wrapping one Keras function; the wrappers change
nothing unless the active strategy is a multi-worker collective one, and
`apply_keras_multiworker_fixes()` is idempotent. `GradientAccumulator` applies
them when it is created under such a strategy; call the function yourself to
run plain Keras optimizers multi-worker.

* ``symbolic_build``: `TensorFlowTrainer._maybe_symbolic_build` builds the model
  from the first batch and, when that batch is a `PerReplica`, reduces it
  eagerly with `strategy.reduce("MEAN", ...)`, which multi-worker strategies
  cannot do outside a `tf.function`. Only the shapes matter for the build, so
  the wrapper builds from the local replica's batch instead.
* ``scalar_logs``: `reduce_per_replica` reduces every log with
  `strategy.reduce("MEAN", v, axis=0)`, and the loss logs are scalars, which
  have no axis 0. The wrapper reduces scalars with `axis=None`.
"""

import functools

import tensorflow as tf

FIXES = ("symbolic_build", "scalar_logs")
_applied = set()


def is_multi_worker(strategy):
    """The test Keras uses itself (`_collective_all_reduce_multi_worker`)."""
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and strategy.extended._in_multi_worker_mode()


def apply_keras_multiworker_fixes(fixes=FIXES):
    """Installs the named workarounds (all by default); returns those now active."""
    unknown = set(fixes) - set(FIXES)
    if unknown:
        raise ValueError(f"`fixes` must be a subset of {FIXES}; unknown: {sorted(unknown)}.")
    from keras.src.backend.tensorflow import trainer as tf_trainer

    if "symbolic_build" in fixes and "symbolic_build" not in _applied:
        original = tf_trainer.TensorFlowTrainer._maybe_symbolic_build

        @functools.wraps(original)
        def _maybe_symbolic_build(self, iterator=None, data_batch=None):
            strategy = self._distribute_strategy
            if strategy is None or iterator is None or not is_multi_worker(strategy):
                return original(self, iterator=iterator, data_batch=data_batch)
            for _, _, it in iterator:
                batch = next(it)
                data_batch = tf.nest.map_structure(
                    lambda v: strategy.experimental_local_results(v)[0]
                    if isinstance(v, tf.distribute.DistributedValues) else v,
                    batch,
                )
                break
            return original(self, iterator=None, data_batch=data_batch)

        tf_trainer.TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build
        _applied.add("symbolic_build")

    if "scalar_logs" in fixes and "scalar_logs" not in _applied:
        original_reduce = tf_trainer.reduce_per_replica

        @functools.wraps(original_reduce)
        def reduce_per_replica(values, strategy, reduction):
            if not is_multi_worker(strategy) or reduction not in ("auto", "mean"):
                return original_reduce(values, strategy, reduction)

            def reduce_one(v):
                if v.shape.rank == 0:
                    return strategy.reduce("MEAN", v, axis=None)
                return original_reduce(v, strategy, reduction)

            return tf.nest.map_structure(reduce_one, values)

        tf_trainer.reduce_per_replica = reduce_per_replica
        _applied.add("scalar_logs")
    return sorted(_applied)
