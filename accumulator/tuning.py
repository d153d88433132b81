"""Accumulation as KerasTuner hyperparameters.

`declare_accumulation(hp)` adds `accum_steps` and `effective_batch_size` to a
search space; `AccumulatingHyperModel(build_model)` makes every trial train
with its own accumulation and micro-batch (effective batch ÷ accum_steps),
whatever the training data's own batch. It works with any KerasTuner tuner
and in TFX's Tuner component (return it from `tuner_fn`); the best values then
reach `AccumulatingTrainer` through `hyperparameters=tuner.outputs[...]`.

`steps_per_epoch` given to `search`/`fit` counts optimizer updates, as
`TrainArgs.num_steps` does, so trials with different `accum_steps` make the
same number of updates.
"""

import keras_tuner
import tensorflow as tf

from accumulator.autowrap import accumulating_compile
from accumulator.validation import integer_at_least

ACCUM_STEPS = "accum_steps"
EFFECTIVE_BATCH_SIZE = "effective_batch_size"


def declare_accumulation(hp, accum_steps=(1, 2, 4, 8), effective_batch_sizes=(32, 64, 128)):
    """Declares the two hyperparameters on `hp`; returns (accum_steps, effective batch)."""
    accum_steps = [integer_at_least(v, f"accum_steps[{i}]") for i, v in enumerate(accum_steps)]
    effective_batch_sizes = [
        integer_at_least(v, f"effective_batch_sizes[{i}]") for i, v in enumerate(effective_batch_sizes)
    ]
    bad = [(b, a) for b in effective_batch_sizes for a in accum_steps if b % a]
    if bad:
        raise ValueError(
            "every `effective_batch_sizes` choice must divide evenly into every `accum_steps` "
            f"choice; these do not: {bad}."
        )
    accum = hp.Choice(ACCUM_STEPS, list(accum_steps))
    effective = hp.Choice(EFFECTIVE_BATCH_SIZE, list(effective_batch_sizes))
    return accum, effective


def micro_batch(hp):
    return hp.get(EFFECTIVE_BATCH_SIZE) // hp.get(ACCUM_STEPS)


class AccumulatingHyperModel(keras_tuner.HyperModel):
    """Wraps `build_model(hp) -> compiled keras.Model`; each trial accumulates.

    Args:
        build_model: builds and compiles the model for `hp`, with a plain
            optimizer; it is wrapped in `GradientAccumulator(hp accum_steps)`.
        accum_steps, effective_batch_sizes: the choices to search.
    """

    def __init__(self, build_model, accum_steps=(1, 2, 4, 8),
                 effective_batch_sizes=(32, 64, 128), name=None, tunable=True):
        super().__init__(name=name, tunable=tunable)
        self._build_model = build_model
        self._accum_steps = tuple(accum_steps)
        self._effective_batch_sizes = tuple(effective_batch_sizes)

    def build(self, hp):
        accum, _ = declare_accumulation(hp, self._accum_steps, self._effective_batch_sizes)
        with accumulating_compile(accum):
            return self._build_model(hp)

    def fit(self, hp, model, x=None, y=None, *args, steps_per_epoch=None, batch_size=None, **kwargs):
        accum, micro = hp.get(ACCUM_STEPS), micro_batch(hp)
        if isinstance(x, tf.data.Dataset):
            # Datasets arrive batched at whatever size; trials need their own.
            x = x.unbatch().batch(micro)
        else:
            batch_size = micro
        if steps_per_epoch is not None:
            steps_per_epoch = steps_per_epoch * accum
        return model.fit(x, y, *args, steps_per_epoch=steps_per_epoch, batch_size=batch_size, **kwargs)
