"""`GradientCache` on a TensorFlow Recommenders model: the task scores the whole batch.

A `tfrs.Model`'s representations exist only as the arguments of its task's
call, so passes 1 and 3 record them with the task swapped for a recorder, and
pass 2 calls the real task once on the whole batch. TensorFlow Recommenders is
never imported: a model is one only when that package is already loaded.
"""

from __future__ import annotations

import inspect
import sys

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.cache import across_replicas, cache_passes
from tfx_gradient_accumulator.accumulator.core import flavours, seam

_UNSUPPORTED_ARGUMENTS = ("score_mask",)


def find_task(model) -> str | None:
    """The attribute of a TensorFlow Recommenders model that holds its task.

    Args:
        model: the model `GradientCache` was given (any Keras 2 model).

    Returns:
        The attribute's name, or None when `model` is not a `tfrs.Model` (or
        TensorFlow Recommenders is not loaded).

    Raises:
        ValueError: what the task mode cannot make exact: several tasks (or
            none), a task other than `tfrs.tasks.Retrieval`.
    """
    tfrs = sys.modules.get("tensorflow_recommenders")
    if tfrs is None or not isinstance(model, tfrs.models.Model):
        return None
    tasks = sorted(name for name, value in vars(model).items() if isinstance(value, tfrs.tasks.Task))
    if len(tasks) != 1:
        raise ValueError(
            f"GradientCache: a TensorFlow Recommenders model must hold exactly one task "
            f"attribute; {type(model).__name__} holds {len(tasks)} ({', '.join(tasks) or 'none'}). "
            "Several tasks (multitask models) are not supported.")
    task = getattr(model, tasks[0])
    if not isinstance(task, tfrs.tasks.Retrieval):
        raise ValueError(
            f"GradientCache: the task {tasks[0]!r} is a {type(task).__name__}; only "
            "tfrs.tasks.Retrieval is supported (its loss couples the batch).")
    return tasks[0]


class _Recorder:
    """Stands in for the task during one `compute_loss`: keeps the arguments of
    the call, returns a stand-in loss."""

    def __init__(self, task):
        self.signature = inspect.signature(task.call)
        self.calls = []
        self.stand_in = None

    def __call__(self, *args, **kwargs):
        bound = self.signature.bind(*args, **kwargs)
        for name in _UNSUPPORTED_ARGUMENTS:
            if bound.arguments.get(name) is not None:
                raise ValueError(f"GradientCache: the task's `{name}` is not supported (it "
                                 "masks the scores of one batch, not of the whole batch).")
        self.calls.append(dict(bound.arguments))
        self.stand_in = tf.zeros([], tf.float32)
        return self.stand_in


def _record(model, attribute, part, training: bool = True):
    """The task's arguments when `model.compute_loss(part, training=training)` runs."""
    task = getattr(model, attribute)
    recorder = _Recorder(task)
    # Set past Keras' attribute tracking, and put back: the model is unchanged.
    object.__setattr__(model, attribute, recorder)
    try:
        loss = model.compute_loss(part, training=training)
    finally:
        object.__setattr__(model, attribute, task)
    if len(recorder.calls) != 1:
        raise ValueError(f"GradientCache: `compute_loss` must call the task once; it called it "
                         f"{len(recorder.calls)} times.")
    if loss is not recorder.stand_in:
        raise ValueError("GradientCache: `compute_loss` must return the task's loss as it is "
                         "(`return self.task(...)`); scaling it or adding to it is not supported.")
    arguments = recorder.calls[0]
    query, candidate = arguments["query_embeddings"], arguments["candidate_embeddings"]
    if not query.shape[:1].is_compatible_with(candidate.shape[:1]):
        raise ValueError("GradientCache: the task's candidate embeddings must be one per query "
                         f"(in-batch negatives); got {candidate.shape[0]} for {query.shape[0]}.")
    return arguments


def _split(arguments):
    """The tensors that follow the samples (float ones are differentiated, as the
    large batch does), the other tensors, and the Python options."""
    floats, others, options = {}, {}, {}
    for name, value in arguments.items():
        if isinstance(value, (tf.Tensor, tf.Variable)):
            (floats if value.dtype.is_floating else others)[name] = value
        elif value is not None:
            options[name] = value
    return floats, others, options


def train_step(cache, data, attribute: str) -> dict:
    """One step of a Keras 2 `GradientCache` on a TFRS model.

    Args:
        cache: the Keras 2 `GradientCache` (its `model`, `optimizer`, `accum_steps`).
        data: the step's batch, as `tfrs.Model.compute_loss` takes it.
        attribute: the model's task attribute (`find_task`).

    Returns:
        The logs as `tfrs.Model.train_step` returns them: the model's metrics,
        `loss`, `regularization_loss` and `total_loss`.

    Raises:
        ValueError: a `compute_loss` the task mode cannot make exact (it calls
            the task other than once, or returns other than the task's loss as
            it is), a `score_mask`, or candidates that are not one per query.
    """
    model, optimizer = cache.model, cache.optimizer
    scaling = isinstance(optimizer, flavours.keras2_module().mixed_precision.LossScaleOptimizer)
    first_pass = []
    scored = {}   # the task's other arguments (ids): the batch's, or when gathering the global batch's

    def forward(part):
        floats, others, options = _split(_record(model, attribute, part))
        if len(first_pass) < cache.accum_steps:
            first_pass.append((others, options))
        return floats

    def score(whole):
        if not scored:
            scored.update({name: tf.concat([o[name] for o, _ in first_pass], 0) for name in first_pass[0][0]})
        loss = _task_loss(model, attribute, whole, scored, first_pass[0][1], cache.gather_across_replicas)
        regularization = tf.reduce_sum([tf.reduce_sum(term) for term in model.losses])
        total = loss + regularization
        logs.update(loss=loss, regularization_loss=regularization, total_loss=total)
        return total, optimizer.get_scaled_loss(total) if scaling else total

    gather = None
    if cache.gather_across_replicas:
        def gather(whole):
            others = {name: tf.concat([o[name] for o, _ in first_pass], 0) for name in first_pass[0][0]}
            shares, gathered = across_replicas.global_batch(whole, others)
            scored.update(gathered)
            return across_replicas.Scored(shares.whole["whole"], shares)

    logs = {}
    variables = []  # filled after pass 1: a TFRS tower may build its weights only then
    _, _, grads = cache_passes.cached_gradients(
        forward, data, cache.accum_steps, score, variables,
        after_pass_1=lambda: (cache._refuse_losses_added_while_running(),
                              variables.extend(model.trainable_variables)),
        gather=gather)
    if scaling:
        grads = optimizer.get_unscaled_gradients(grads)
    with cache_passes.ready_for_update(grads):
        optimizer.apply_gradients(zip(grads, variables))
    return {**{metric.name: metric.result() for metric in model.metrics},
            **_per_replica(logs, cache.gather_across_replicas)}


def test_step(cache, data, attribute: str) -> dict:
    """A TFRS model's evaluation step with its task scoring the global batch
    (`gather_across_replicas`): TFRS's `test_step`, its loss one device's.

    Args:
        cache: the Keras 2 `GradientCache`.
        data: the step's batch, as `tfrs.Model.compute_loss` takes it.
        attribute: the model's task attribute (`find_task`).

    Returns:
        The logs as `tfrs.Model.test_step` returns them.
    """
    model = cache.model
    floats, others, options = _split(_record(model, attribute, data, training=False))
    shares, gathered = across_replicas.global_batch(floats, others)
    loss = _task_loss(model, attribute, shares.whole["whole"], gathered, options, True)
    regularization = tf.reduce_sum([tf.reduce_sum(term) for term in model.losses])
    logs = {"loss": loss, "regularization_loss": regularization, "total_loss": loss + regularization}
    return {**{metric.name: metric.result() for metric in model.metrics}, **_per_replica(logs, True)}


def _per_replica(logs: dict, gathered: bool) -> dict:
    """The losses a replica logs. Keras 2 sums the replicas' logs (its own losses are
    scaled by 1/R for that); a gathered loss is the global batch's on every replica,
    so each logs 1/R of it and the sum is one device's."""
    replicas = tf.distribute.get_strategy().num_replicas_in_sync
    if not gathered or replicas == 1:
        return logs
    return {name: value / replicas for name, value in logs.items()}


def _task_loss(model, attribute, floats, others, options, gathered: bool):
    """The real task's loss on the batch's arguments. On a gathered global batch its
    Keras 2 loss may average (`SUM_OVER_BATCH_SIZE`), which Keras 2 refuses in a replica:
    that batch is one device's (`seam.keras2_losses_scoring_the_global_batch`)."""
    task = getattr(model, attribute)
    if not gathered:
        return task(**floats, **others, **options)
    with seam.keras2_losses_scoring_the_global_batch(task):
        return task(**floats, **others, **options)
