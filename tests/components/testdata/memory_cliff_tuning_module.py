"""A digits module file whose Tuner searches the effective batch alone, on a model with a
memory cliff: a step of `CLIFF` samples or more runs out of memory
(`tests.accumulator.memory_cliff.MemoryCliff`, which changes nothing of the model's math).

`tuner_fn` returns `AccumulatingHyperModel(accum_steps="fit", effective_batch_sizes=(16, 64))`:
64 is above the cliff, so that trial trains micro-batches found below it. The run_fn sets no
accumulation: the Trainer takes "fit" and the effective batch from the best hyperparameters.
Evaluation batches stay below the cliff (the model runs it in inference too).
"""

import keras
import keras_tuner
from tfx import v1 as tfx

from tests.accumulator.memory_cliff import MemoryCliff
from tfx_gradient_accumulator.accumulator.tuning import AccumulatingHyperModel
from tfx_gradient_accumulator.pipelines.digits import model as digits
from tfx_gradient_accumulator.pipelines.digits.data import FEATURE_KEYS

CLIFF = 24
EFFECTIVE_BATCH_SIZES = (16, 64)
BATCH_SIZE = 32          # the run_fn's own: re-batched at each trial's (the Trainer's) micro-batch
EVAL_BATCH_SIZE = 16     # below the cliff


def build_model(hp: keras_tuner.HyperParameters) -> keras.Model:
    keras.utils.set_random_seed(0)
    inputs = [keras.layers.Input(shape=(1,), name=key) for key in FEATURE_KEYS]
    x = keras.layers.Concatenate()(inputs)
    x = MemoryCliff(CLIFF)(x)
    x = keras.layers.Rescaling(1.0 / 16.0)(x)
    x = keras.layers.Dense(32, activation="relu")(x)
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(x))
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(),
                  metrics=[keras.metrics.SparseCategoricalAccuracy()])
    return model


def _data(fn_args):
    schema = digits._schema()
    return (digits._input_fn(fn_args.train_files, fn_args.data_accessor, schema, BATCH_SIZE),
            digits._input_fn(fn_args.eval_files, fn_args.data_accessor, schema, EVAL_BATCH_SIZE))


def run_fn(fn_args: tfx.components.FnArgs) -> None:
    train, evaluation = _data(fn_args)
    model = build_model(keras_tuner.HyperParameters.from_config(fn_args.hyperparameters))
    model.fit(train, steps_per_epoch=fn_args.train_steps, validation_data=evaluation,
              validation_steps=fn_args.eval_steps, verbose=2)
    model.export(fn_args.serving_model_dir)


def tuner_fn(fn_args: tfx.components.FnArgs) -> tfx.components.TunerFnResult:
    tuner = keras_tuner.GridSearch(
        AccumulatingHyperModel(build_model, accum_steps="fit", effective_batch_sizes=EFFECTIVE_BATCH_SIZES),
        max_trials=len(EFFECTIVE_BATCH_SIZES),
        objective=keras_tuner.Objective("val_sparse_categorical_accuracy", "max"),
        directory=fn_args.working_dir, project_name="fit")
    train, evaluation = _data(fn_args)
    return tfx.components.TunerFnResult(tuner=tuner, fit_kwargs={
        "x": train, "validation_data": evaluation, "steps_per_epoch": fn_args.train_steps,
        "validation_steps": fn_args.eval_steps, "verbose": 2})
