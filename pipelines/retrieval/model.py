"""Module file of the retrieval pipeline: a two-tower model with in-batch negatives.

The batch is the set of negatives, so the model is wrapped in
`GradientCache(two_tower, accum_steps=1)`, and `AccumulatingTrainer(options=TrainerOptions(gradient_cache=True))`
sets its accum_steps; the export has `query` and `candidate` signatures.
"""

import keras
import keras_tuner
import tensorflow as tf
from tfx import v1 as tfx

from tfx_gradient_accumulator.accumulator import GradientCache
from tfx_gradient_accumulator.accumulator.cache import contrastive
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
    query's row alike, which the softmax ignores (its gradient is zero).

    Args:
        dim: the embeddings' size.
        **kwargs: those of `keras.Model`.
    """

    def __init__(self, dim: int = EMBEDDING_DIM, **kwargs):
        super().__init__(**kwargs)
        self.query = keras.Sequential([keras.layers.Embedding(USERS, dim), keras.layers.Dense(dim)], name="query")
        self.candidate = keras.Sequential([keras.layers.Embedding(ITEMS, dim),
                                           keras.layers.Dense(dim, use_bias=False)], name="candidate")

    def call(self, inputs):
        """`{"query": ..., "candidate": ...}` embeddings of `inputs`' user and item ids."""
        return {"query": self.query(tf.reshape(inputs[USER_KEY], [-1])),
                "candidate": self.candidate(tf.reshape(inputs[ITEM_KEY], [-1]))}

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        """The in-batch softmax of `y_pred`'s embeddings (Keras' `compute_loss` arguments)."""
        return contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])


def build_model(hp: keras_tuner.HyperParameters) -> keras.Model:
    """The two-tower model wrapped in `GradientCache`, compiled with a plain optimizer.

    Args:
        hp: unused: accum_steps and the effective batch are the Trainer's (or
            the tuner's, through `AccumulatingHyperModel`).

    Returns:
        `GradientCache(two_tower, accum_steps=1)`; the Trainer or the tuner
        sets its accum_steps.
    """
    del hp    # accum_steps and the effective batch are the Trainer's (or the tuner's)
    keras.utils.set_random_seed(0)
    two_tower = TwoTower()
    two_tower({USER_KEY: tf.zeros([1, 1], tf.int64), ITEM_KEY: tf.zeros([1, 1], tf.int64)})
    model = GradientCache(two_tower, accum_steps=1)
    model.compile(optimizer=keras.optimizers.AdamW(LEARNING_RATE, weight_decay=WEIGHT_DECAY))
    return model


def _hyperparameters(fn_args) -> keras_tuner.HyperParameters:
    """The Tuner's best hyperparameters, or empty ones without a Tuner."""
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
    """Trains the model; the Trainer decides the steps, the batch and the accum_steps.

    Args:
        fn_args: the Trainer's `FnArgs` (files, steps, the serving and run
            folders, `data_accessor`).
    """
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

    Args:
        fn_args: the Tuner's `FnArgs`; `custom_config["max_trials"]` (default 2)
            bounds the search.

    Returns:
        The KerasTuner random search and `fit`'s arguments for its trials.
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
