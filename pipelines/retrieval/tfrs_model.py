"""Module file of the retrieval pipeline written with TensorFlow Recommenders (Keras 2).

The same two-tower model as `pipelines/retrieval/model.py`, as a TFRS user writes
it: a `tfrs.Model` whose `compute_loss` runs a query tower over user ids and a
candidate tower over item ids and ends in a `tfrs.tasks.Retrieval` (each query's
softmax over every candidate of its batch), with `FactorizedTopK` over every
item measured on the validation batches only. The batch is the set of
negatives, so `run_fn` wraps the model in `GradientCache(model, accum_steps=1)`,
unchanged (`accumulator.keras2.task_cache` runs its task once on the whole batch), and
`AccumulatingTrainer(gradient_cache=True)` sets the accum_steps and batches the
training data at the effective batch.

TFRS needs `tf.keras` to be Keras 2: `TF_USE_LEGACY_KERAS=1` before TensorFlow
first resolves `tf.keras` (in a TFX executor, importing `tensorflow_transform`
sets it; in a process running the whole pipeline, TFX's own imports resolve
`tf.keras` before that, so the variable must be set when the process starts:
`run_local --retrieval_model=tfrs` does it). Keras 2 is imported here as
`tf_keras`, which is what `tf.keras` then is.

No `tuner_fn`: KerasTuner builds Keras 3 models only, so this module trains with
the Trainer's `accum_steps` and effective batch. The export has the same `query`
and `candidate` signatures as the Keras 3 module's (int64 ids of shape [None]),
so `pipelines/retrieval/evaluate.py` scores either. `run_fn` also writes what it
trained (`TRAINED_FILE` in the model run directory): the model's classes and
Keras, and the settings that must match the Keras 3 module's.
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
    """

    def __init__(self, dim=EMBEDDING_DIM):
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
    """The TFRS model wrapped in `GradientCache` (accum_steps set by the Trainer),
    compiled with a plain Keras 2 optimizer."""
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
    """Trains the model; the Trainer decides the steps, the batch and the accum_steps."""
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
