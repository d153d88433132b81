"""Module file of the retrieval pipeline: a two-tower model with in-batch negatives.

user id -> query tower, item id -> candidate tower; the loss is each query's
softmax over every candidate of its batch (`accumulator.contrastive.in_batch_softmax`,
TensorFlow Recommenders' `Retrieval` task). The batch *is* the set of
negatives, so plain gradient accumulation would be wrong (micro-batches would
have only their own negatives): the model is wrapped in
`accumulator.GradientCache(two_tower, accum_steps=1)`, and
`AccumulatingTrainer(gradient_cache=True)` sets its accum_steps and batches the
training data at the effective batch. Under the stock Trainer the same module
trains at its own `BATCH_SIZE` without micro-batches.

The export has two signatures, `query` (user ids -> query embeddings) and
`candidate` (item ids -> candidate embeddings): retrieval scores every
candidate against a query by dot product (`pipelines/retrieval/evaluate.py`).
"""

import keras
import keras_tuner
import tensorflow as tf
from tfx import v1 as tfx

from tfx_gradient_accumulator.accumulator import GradientCache, contrastive
from tfx_gradient_accumulator.accumulator.tuning import AccumulatingHyperModel
from tfx_gradient_accumulator.pipelines.retrieval.data import ITEM_KEY, ITEMS, USER_KEY, USERS
from tfx_gradient_accumulator.pipelines.retrieval.inputs import input_fn

BATCH_SIZE = 128         # the run_fn's own batch: replaced by the effective batch when set
EVAL_BATCH_SIZE = 256    # fixed, so validation losses (in-batch negatives) compare across trials
EMBEDDING_DIM = 16
LEARNING_RATE = 0.01
# Decoupled weight decay keeps the id embeddings from memorizing the training pairs:
# in-batch negatives push away every other item of a batch, the user's unseen
# in-cluster items included (held-out recall falls with longer training without it).
WEIGHT_DECAY = 0.5


class TwoTower(keras.Model):
    """Query and candidate towers over ids; `compute_loss` is the in-batch softmax.

    The candidate tower has no output bias: it would shift every logit of a
    query's row alike, which the softmax ignores (its gradient is zero)."""

    def __init__(self, dim=EMBEDDING_DIM, **kwargs):
        super().__init__(**kwargs)
        self.query = keras.Sequential([keras.layers.Embedding(USERS, dim), keras.layers.Dense(dim)], name="query")
        self.candidate = keras.Sequential([keras.layers.Embedding(ITEMS, dim),
                                           keras.layers.Dense(dim, use_bias=False)], name="candidate")

    def call(self, inputs):
        return {"query": self.query(tf.reshape(inputs[USER_KEY], [-1])),
                "candidate": self.candidate(tf.reshape(inputs[ITEM_KEY], [-1]))}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        return contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])


def build_model(hp: keras_tuner.HyperParameters) -> keras.Model:
    """The two-tower model wrapped in `GradientCache` (accum_steps set by the Trainer
    or the tuner), compiled with a plain optimizer."""
    del hp    # accum_steps and the effective batch are the Trainer's (or the tuner's)
    keras.utils.set_random_seed(0)
    two_tower = TwoTower()
    two_tower({USER_KEY: tf.zeros([1, 1], tf.int64), ITEM_KEY: tf.zeros([1, 1], tf.int64)})
    model = GradientCache(two_tower, accum_steps=1)
    model.compile(optimizer=keras.optimizers.AdamW(LEARNING_RATE, weight_decay=WEIGHT_DECAY))
    return model


def _hyperparameters(fn_args) -> keras_tuner.HyperParameters:
    if fn_args.hyperparameters:
        return keras_tuner.HyperParameters.from_config(fn_args.hyperparameters)
    return keras_tuner.HyperParameters()


def _export(two_tower: TwoTower, directory: str) -> None:
    """SavedModel with `query` and `candidate` signatures (int64 ids of shape [None])."""
    archive = keras.export.ExportArchive()
    archive.track(two_tower)
    ids = [tf.TensorSpec([None], tf.int64)]
    archive.add_endpoint("query", lambda user_ids: two_tower.query(user_ids), input_signature=ids)
    archive.add_endpoint("candidate", lambda item_ids: two_tower.candidate(item_ids), input_signature=ids)
    archive.write_out(directory)


def run_fn(fn_args: tfx.components.FnArgs) -> None:
    """Trains the model; the Trainer decides the steps, the batch and the accum_steps."""
    train = input_fn(fn_args.train_files, fn_args.data_accessor, BATCH_SIZE)
    evaluation = input_fn(fn_args.eval_files, fn_args.data_accessor, EVAL_BATCH_SIZE, shuffle=False)
    model = build_model(_hyperparameters(fn_args))
    model.fit(
        train,
        steps_per_epoch=fn_args.train_steps,
        validation_data=evaluation,
        validation_steps=fn_args.eval_steps,
        callbacks=[keras.callbacks.TensorBoard(fn_args.model_run_dir)],
        verbose=2,
    )
    _export(model.model, fn_args.serving_model_dir)


def tuner_fn(fn_args: tfx.components.FnArgs) -> tfx.components.TunerFnResult:
    """Searches accum_steps and the effective batch (the number of in-batch negatives).

    Validation batches stay at `EVAL_BATCH_SIZE` in every trial, so the
    objective, the validation loss, scores every trial against the same negatives.
    """
    custom_config = fn_args.custom_config or {}
    tuner = keras_tuner.RandomSearch(
        AccumulatingHyperModel(build_model, accum_steps=(2, 4), effective_batch_sizes=(64, 128),
                               gradient_cache=True),
        max_trials=int(custom_config.get("max_trials", 2)),
        objective=keras_tuner.Objective("val_loss", "min"),
        directory=fn_args.working_dir,
        project_name="retrieval",
        seed=1,
    )
    return tfx.components.TunerFnResult(
        tuner=tuner,
        fit_kwargs={
            "x": input_fn(fn_args.train_files, fn_args.data_accessor, BATCH_SIZE),
            "validation_data": input_fn(fn_args.eval_files, fn_args.data_accessor, EVAL_BATCH_SIZE, shuffle=False),
            "steps_per_epoch": fn_args.train_steps,   # optimizer updates per trial
            "validation_steps": fn_args.eval_steps,
            "verbose": 2,
        },
    )
