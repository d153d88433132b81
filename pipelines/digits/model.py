"""Module file of the digits pipeline, written for the stock TFX Trainer and Tuner.

Nothing here knows about accumulation except `tuner_fn`, which searches over it,
and the batch normalization layers, which are `AccumBatchNormalization` (a
drop-in for Keras' layer whose moving statistics are those of the effective
batch): `AccumulatingTrainer` wraps the optimizer that `run_fn` compiles, tells
those layers the accumulation, and batches the training data at the micro-batch.
"""

from typing import List

import keras
import keras_tuner
import tensorflow as tf
from tfx import v1 as tfx
from tfx_bsl.public import tfxio

from tfx_gradient_accumulator.accumulator import AccumBatchNormalization
from tfx_gradient_accumulator.accumulator.tuning import AccumulatingHyperModel
from tfx_gradient_accumulator.pipelines.digits.data import FEATURE_KEYS, LABEL_KEY

BATCH_SIZE = 64          # the run_fn's own batch: replaced by the micro-batch when tuned
EVAL_BATCH_SIZE = 128


def _input_fn(file_pattern: List[str], data_accessor: tfx.components.DataAccessor,
              schema, batch_size: int) -> tf.data.Dataset:
    return data_accessor.tf_dataset_factory(
        file_pattern,
        tfxio.TensorFlowDatasetOptions(batch_size=batch_size, label_key=LABEL_KEY),
        schema=schema,
    ).repeat()


def _feature_spec():
    spec = {key: tf.io.FixedLenFeature([1], tf.float32) for key in FEATURE_KEYS}
    spec[LABEL_KEY] = tf.io.FixedLenFeature([1], tf.int64)
    return spec


def _schema():
    from tensorflow_transform.tf_metadata import schema_utils
    return schema_utils.schema_from_feature_spec(_feature_spec())


def build_model(hp: keras_tuner.HyperParameters) -> keras.Model:
    """A small CNN over the 8x8 image: where a bigger batch steadies training.

    Args:
        hp: the hyperparameters; `learning_rate` is read.

    Returns:
        The model, compiled with a plain Adam (the Trainer or the tuner wraps it).
    """
    inputs = [keras.layers.Input(shape=(1,), name=key) for key in FEATURE_KEYS]
    x = keras.layers.Concatenate()(inputs)
    x = keras.layers.Rescaling(1.0 / 16.0)(x)
    x = keras.layers.Reshape((8, 8, 1))(x)
    x = keras.layers.Conv2D(16, 3, padding="same", use_bias=False)(x)
    x = keras.layers.Activation("relu")(AccumBatchNormalization(momentum=0.9)(x))
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(32, 3, padding="same", use_bias=False)(x)
    x = keras.layers.Activation("relu")(AccumBatchNormalization(momentum=0.9)(x))
    x = keras.layers.GlobalAveragePooling2D()(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    outputs = keras.layers.Dense(10, activation="softmax")(x)
    model = keras.Model(inputs=inputs, outputs=outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(hp.get("learning_rate")),
        loss=keras.losses.SparseCategoricalCrossentropy(),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )
    return model


def _hyperparameters(fn_args) -> keras_tuner.HyperParameters:
    """The Tuner's best hyperparameters, or a fixed learning rate without a Tuner."""
    if fn_args.hyperparameters:
        return keras_tuner.HyperParameters.from_config(fn_args.hyperparameters)
    hp = keras_tuner.HyperParameters()
    hp.Fixed("learning_rate", 1e-2)
    return hp


def _export(model: keras.Model, directory: str) -> None:
    """SavedModel whose `serving_default` parses serialized tf.Examples (for TFMA)."""
    archive = keras.export.ExportArchive()
    archive.track(model)
    spec = {k: v for k, v in _feature_spec().items() if k != LABEL_KEY}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="examples")])
    def serve(examples):
        features = tf.io.parse_example(examples, spec)
        return {"probabilities": model([features[k] for k in FEATURE_KEYS], training=False)}

    archive.add_endpoint("serving_default", serve)
    archive.write_out(directory)


def run_fn(fn_args: tfx.components.FnArgs) -> None:
    """Trains the model; the Trainer decides the steps, the batch and the optimizer's wrapper.

    Args:
        fn_args: the Trainer's `FnArgs` (files, steps, `hyperparameters`, the
            serving and run folders, `data_accessor`).
    """
    schema = _schema()
    train = _input_fn(fn_args.train_files, fn_args.data_accessor, schema, BATCH_SIZE)
    evaluation = _input_fn(fn_args.eval_files, fn_args.data_accessor, schema, EVAL_BATCH_SIZE)
    model = build_model(_hyperparameters(fn_args))
    model.fit(
        train,
        steps_per_epoch=fn_args.train_steps,
        validation_data=evaluation,
        validation_steps=fn_args.eval_steps,
        callbacks=[keras.callbacks.TensorBoard(fn_args.model_run_dir)],
        verbose=2,
    )
    _export(model, fn_args.serving_model_dir)


def tuner_fn(fn_args: tfx.components.FnArgs) -> tfx.components.TunerFnResult:
    """Searches accum_steps, the effective batch and the learning rate.

    accum_steps from 2: the Trainer measures the gradient noise scale, which
    needs windows of two or more micro-batches.

    Args:
        fn_args: the Tuner's `FnArgs`; `custom_config["max_trials"]` (default 4)
            bounds the search.

    Returns:
        The KerasTuner random search and `fit`'s arguments for its trials.
    """
    hp = keras_tuner.HyperParameters()
    hp.Choice("learning_rate", [3e-3, 1e-2])
    max_trials = int((fn_args.custom_config or {}).get("max_trials", 4))
    tuner = keras_tuner.RandomSearch(
        AccumulatingHyperModel(build_model, accum_steps=(2, 4), effective_batch_sizes=(32, 64)),
        hyperparameters=hp,
        max_trials=max_trials,
        objective=keras_tuner.Objective("val_sparse_categorical_accuracy", "max"),
        directory=fn_args.working_dir,
        project_name="digits",
        seed=1,
    )
    schema = _schema()
    return tfx.components.TunerFnResult(
        tuner=tuner,
        fit_kwargs={
            "x": _input_fn(fn_args.train_files, fn_args.data_accessor, schema, BATCH_SIZE),
            "validation_data": _input_fn(fn_args.eval_files, fn_args.data_accessor, schema, EVAL_BATCH_SIZE),
            "steps_per_epoch": fn_args.train_steps,   # optimizer updates per trial
            "validation_steps": fn_args.eval_steps,
            "verbose": 2,
        },
    )
