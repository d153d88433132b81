"""Tuning that searches the effective batch alone, `AccumulatingHyperModel(accum_steps="fit")`:
each trial finds the micro-batch that trains on the device (real out-of-memory errors,
`memory_cliff`) and trains its effective batch exactly; a trial whose step does not fit at
one sample is failed with a message, and the search goes on."""

import numpy as np
import pytest

keras_tuner = pytest.importorskip("keras_tuner")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfx_gradient_accumulator.accumulator.tuning import AccumulatingHyperModel  # noqa: E402
from tests.accumulator import memory_cliff  # noqa: E402
from tests.accumulator import reference as ref  # noqa: E402

CLIFF = 24          # a step of 24 samples or more runs out of memory
UPDATES = 2


class _Recording(AccumulatingHyperModel):
    """Keeps each trial's trained weights, window and updates, by effective batch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained = {}

    def fit(self, hp, model, *args, **kwargs):
        history = super().fit(hp, model, *args, **kwargs)
        self.trained[hp.get("effective_batch_size")] = (
            model.get_weights(), int(model.optimizer.accum_steps), int(model.optimizer.iterations.numpy()))
        return history


def _build(cliff_of):
    def build(hp):
        model = memory_cliff.mlp(cliff_of(hp.get("effective_batch_size")))
        model.compile(keras.optimizers.Adam(1e-2), "mse")
        return model
    return build


def _search(tmp_path, hypermodel, x, y):
    tuner = keras_tuner.GridSearch(hypermodel, objective="loss", max_trials=4,
                                   directory=str(tmp_path), project_name="fit")
    tuner.search(x, y, epochs=1, steps_per_epoch=UPDATES, shuffle=False, verbose=0)
    return tuner


def _large_batch(x, y, effective_batch_size):
    reference = memory_cliff.mlp(cliff=None)
    reference.compile(keras.optimizers.Adam(1e-2), "mse")
    reference.fit(x, y, batch_size=effective_batch_size, epochs=1, steps_per_epoch=UPDATES,
                  shuffle=False, verbose=0)
    return reference.get_weights()


@pytest.mark.parametrize("as_dataset", [False, pytest.param(True, marks=pytest.mark.apart)],  # dataset apart (23 s):
                         ids=["arrays", "dataset"])                  # the tuned pipeline reads one in make test
def test_a_search_over_the_effective_batch_alone_trains_each_trial_exactly(tmp_path, as_dataset):
    x, y = ref.regression_data(128)
    hypermodel = _Recording(_build(lambda e: CLIFF), accum_steps="fit", effective_batch_sizes=(16, 64))
    data = (tf.data.Dataset.from_tensor_slices((x, y)).batch(32), None) if as_dataset else (x, y)
    tuner = _search(tmp_path, hypermodel, *data)

    trials = list(tuner.oracle.trials.values())
    assert sorted(t.status for t in trials) == ["COMPLETED", "COMPLETED"]
    assert all(t.hyperparameters.values["accum_steps"] == "fit" for t in trials)
    # 16 fits whole, with its headroom (18 fits): 16 x 1; 64 is above the cliff: 16 x 4.
    assert {e: n for e, (_, n, _) in hypermodel.trained.items()} == {16: 1, 64: 4}
    for effective, (weights, _, updates) in hypermodel.trained.items():
        assert updates == UPDATES
        assert ref.max_abs_diff(weights, _large_batch(x, y, effective)) <= 1e-5


def test_a_trial_that_fits_not_even_one_sample_is_failed_and_the_search_goes_on(tmp_path):
    x, y = ref.regression_data(128)
    hypermodel = _Recording(_build(lambda e: 1 if e == 64 else CLIFF), accum_steps="fit",
                            effective_batch_sizes=(16, 64))
    tuner = _search(tmp_path, hypermodel, x, y)

    status = {t.hyperparameters.values["effective_batch_size"]: t for t in tuner.oracle.trials.values()}
    assert (status[16].status, status[64].status) == ("COMPLETED", "FAILED")
    assert "effective_batch_size=64 cannot train on this device: not even a micro-batch of 1" in status[64].message
    assert list(hypermodel.trained) == [16]
    assert tuner.get_best_hyperparameters()[0].values["effective_batch_size"] == 16


@pytest.mark.parametrize("kwargs, message", [
    (dict(micro_batch_size=16), "`micro_batch_size` states the micro-batch that fits"),
    (dict(gradient_cache=True), "not supported with `gradient_cache=True`"),
    (dict(max_effective_batch_size=128), "the limit of `accum_steps='auto'`"),
    (dict(effective_batch_sizes=()), "`effective_batch_sizes` must be a non-empty list"),
    (dict(effective_batch_sizes=(16, 0)), r"`effective_batch_sizes\[1\]`"),
])
def test_what_fit_excludes_is_refused_up_front(kwargs, message):
    kwargs = dict(dict(effective_batch_sizes=(16, 64)), **kwargs)
    with pytest.raises(ValueError, match=message):
        AccumulatingHyperModel(_build(lambda e: None), accum_steps="fit", **kwargs)


def test_an_unknown_accum_steps_word_is_refused():
    with pytest.raises(ValueError, match="`accum_steps` must be a list of positive integers, 'auto' or 'fit'"):
        AccumulatingHyperModel(_build(lambda e: None), accum_steps="fits")
