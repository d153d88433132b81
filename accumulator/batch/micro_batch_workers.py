"""`find_micro_batch` on a cluster: each worker probes a copy of the model, all take the smallest.

Under a strategy with several workers (`MultiWorkerMirroredStrategy`) every step
all-reduces the gradients. A probe step that runs out of memory on one worker would leave
the others waiting in that all-reduce, so no probe step runs under that strategy: each
worker probes a copy of the model (its configuration and its compile configuration, the
same `GradientAccumulator` included) built outside the strategy on its first device, and
then one collective gives every worker the smallest of the largest micro-batches found
(devices can differ between workers: the run must fit on the smallest). The copy holds a
second set of weights and optimizer state while it probes, so the micro-batch found is
somewhat smaller than the device allows (safe, never larger); it is dropped before
training. Every worker's random state is put back after the copy is made.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import seam


def workers_of(strategy: tf.distribute.Strategy) -> int:
    """The workers `strategy` spans (1 without a cluster)."""
    resolver = getattr(strategy, "cluster_resolver", None)
    spec = resolver.cluster_spec().as_dict() if resolver is not None else {}
    return max(1, sum(len(spec.get(job, ())) for job in ("chief", "worker")))


def local_copy(model: keras.Model) -> keras.Model:
    """`model` built and compiled again outside its strategy, on this worker's first device.

    Raises:
        ValueError: called inside a strategy's scope (the copy would be the strategy's).
        TypeError: the model cannot be rebuilt from its configuration (a subclassed model
            without `get_config`), or was compiled with objects that do not serialize.
    """
    if tf.distribute.has_strategy():
        raise ValueError("find_micro_batch on several workers probes a copy of the model outside the "
                         "strategy: call it outside `strategy.scope()` (after `compile`, before `fit`).")
    random = seam.random_state()
    try:
        copy = keras.models.clone_model(model)
        copy.compile_from_config(model.get_compile_config())
    except (TypeError, ValueError, NotImplementedError) as err:
        raise TypeError(
            "find_micro_batch on several workers probes a copy of the model on each worker's own device "
            "(a probe step that runs out of memory must not leave the other workers in an all-reduce), "
            f"and this model could not be copied from its configuration: {type(err).__name__}: {err}. "
            "Give the model a `get_config`, or find the micro-batch on one worker and set `accum_steps`."
        ) from err
    finally:
        seam.restore_random_state(random)
    return copy


def smallest_over_workers(strategy: tf.distribute.Strategy, value: int) -> int:
    """The smallest `value` any worker of `strategy` holds, on every worker (one collective)."""
    everyone = strategy.gather(strategy.run(lambda: tf.constant([value], tf.int64)), axis=0)
    return int(tf.reduce_min(everyone).numpy())

