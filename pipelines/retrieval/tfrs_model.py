"""Module file of the retrieval pipeline written with TensorFlow Recommenders (Keras 2).

The same two-tower model as `model.py`, as a TFRS user writes it (a `tfrs.Model`
ending in a `Retrieval` task), wrapped in `GradientCache`. No `tuner_fn`
(KerasTuner builds Keras 3 models only). TFRS needs `tf.keras` to be Keras 2:
`TF_USE_LEGACY_KERAS=1` before TensorFlow first resolves it.
"""

import json
import os

import tensorflow as tf
import tensorflow_recommenders as tfrs
import tf_keras
from absl import logging
from tfx import v1 as tfx

from tfx_gradient_accumulator.accumulator import GradientCache
from tfx_gradient_accumulator.pipelines.retrieval.data import ITEM_KEY, ITEMS, USER_KEY, USERS
from tfx_gradient_accumulator.pipelines.retrieval.inputs import input_fn

# The Keras 3 module's settings (`model.py`): the two flavours train the same model.
BATCH_SIZE = 128         # the run_fn's own batch: replaced by the effective batch when set
EVAL_BATCH_SIZE = 256
EMBEDDING_DIM = 16
LEARNING_RATE = 0.01
WEIGHT_DECAY = 0.5       # decoupled weight decay (AdamW), as in model.py, which says why
TOP_K = 10               # FactorizedTopK's k on the validation batches, as the held-out recall@10
TRAINED_FILE = "trained.json"


class TwoTowerModel(tfrs.Model):
    """Query and candidate towers over ids (the ids are dense indices, so no
    StringLookup); the loss is the Retrieval task's in-batch softmax.

    The loss is the batch's MEAN cross-entropy, where TFRS's default sums over
    the batch: the Keras 3 module's `contrastive.in_batch_softmax` is a mean, and
    with the same reduction both modules minimise the same function, so their
    val_loss compare and neither depends on the batch size (with a sum,
    gradients and losses grow with the effective batch; Adam's update is nearly
    scale-free, so a sum would train alike, but its logged losses would not).

    Under a strategy with several replicas, Keras 2 refuses this mean inside a
    replica (a share's mean is not the batch's); with the Trainer's
    `gather_across_replicas=True` every replica's task scores the whole effective
    batch, whose mean it is, as on one device: this module runs unchanged there.

    Args:
        dim: the embeddings' size.
    """

    def __init__(self, dim: int = EMBEDDING_DIM):
        super().__init__()
        self.query_model = tf_keras.Sequential(
            [tf_keras.layers.Embedding(USERS, dim), tf_keras.layers.Dense(dim)], name="query")
        # No output bias: it would shift every logit of a query's row alike, which
        # the softmax ignores.
        self.candidate_model = tf_keras.Sequential(
            [tf_keras.layers.Embedding(ITEMS, dim), tf_keras.layers.Dense(dim, use_bias=False)],
            name="candidate")
        items = tf.data.Dataset.range(ITEMS).batch(ITEMS)
        self.task = tfrs.tasks.Retrieval(
            loss=tf_keras.losses.CategoricalCrossentropy(
                from_logits=True, reduction=tf_keras.losses.Reduction.SUM_OVER_BATCH_SIZE),
            metrics=tfrs.metrics.FactorizedTopK(candidates=items.map(self.candidate_model), ks=(TOP_K,)),
        )

    def compute_loss(self, features, training=False):
        """The Retrieval task's loss on `features`' user and item ids (TFRS's `compute_loss`)."""
        query_embeddings = self.query_model(tf.reshape(features[USER_KEY], [-1]))
        candidate_embeddings = self.candidate_model(tf.reshape(features[ITEM_KEY], [-1]))
        # Top-k over every item on validation batches only: training needs the loss.
        return self.task(query_embeddings, candidate_embeddings, compute_metrics=not training)


class _Embeddings(tf.Module):
    """What is exported: the towers behind `query` and `candidate` functions."""

    def __init__(self, model: TwoTowerModel):
        super().__init__()
        self.query_model = model.query_model
        self.candidate_model = model.candidate_model

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def query(self, user_ids):
        return self.query_model(user_ids)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int64)])
    def candidate(self, item_ids):
        return self.candidate_model(item_ids)


def build_model() -> GradientCache:
    """The TFRS model wrapped in `GradientCache`, compiled with a plain Keras 2 optimizer.

    Returns:
        `GradientCache(TwoTowerModel(), accum_steps=1)` (the Keras 2 class);
        the Trainer sets its accum_steps.
    """
    tf_keras.utils.set_random_seed(0)
    model = GradientCache(TwoTowerModel(), accum_steps=1)
    model.compile(optimizer=tf_keras.optimizers.AdamW(LEARNING_RATE, weight_decay=WEIGHT_DECAY))
    return model


def _export(two_tower: TwoTowerModel, directory: str) -> None:
    """SavedModel with `query` and `candidate` signatures (int64 ids of shape [None])."""
    embeddings = _Embeddings(two_tower)
    tf.saved_model.save(embeddings, directory,
                        signatures={"query": embeddings.query, "candidate": embeddings.candidate})


def _write_trained(model: GradientCache, directory: str) -> None:
    """What trained, for whoever reads the run: classes, Keras, settings."""
    trained = {
        "model": type(model).__name__,
        "wrapped": type(model.model).__name__,
        "tfrs_model": isinstance(model.model, tfrs.Model),
        "keras": f"{tf_keras.__name__} {tf_keras.__version__}",
        "accum_steps": int(model.accum_steps),
        "optimizer": type(model.optimizer).__name__,
        "optimizer_updates": int(model.optimizer.iterations.numpy()),
        "embedding_dim": EMBEDDING_DIM,
        "learning_rate": LEARNING_RATE,
        "weight_decay": WEIGHT_DECAY,
    }
    logging.info("Trained: %s", trained)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, TRAINED_FILE), "w") as f:
        json.dump(trained, f, sort_keys=True)


def run_fn(fn_args: tfx.components.FnArgs) -> None:
    """Trains the model; the Trainer decides the steps, the batch and the accum_steps.

    Also writes what it trained (`TRAINED_FILE` in the model run folder).

    Args:
        fn_args: the Trainer's `FnArgs` (files, steps, the serving and run
            folders, `data_accessor`).
    """
    train = input_fn(fn_args.train_files, fn_args.data_accessor, BATCH_SIZE)
    evaluation = input_fn(fn_args.eval_files, fn_args.data_accessor, EVAL_BATCH_SIZE, shuffle=False)
    model = build_model()
    model.fit(
        train,
        steps_per_epoch=fn_args.train_steps,
        validation_data=evaluation,
        validation_steps=fn_args.eval_steps,
        callbacks=[tf_keras.callbacks.TensorBoard(fn_args.model_run_dir)],
        verbose=2,
    )
    _write_trained(model, fn_args.model_run_dir)
    _export(model.model, fn_args.serving_model_dir)
