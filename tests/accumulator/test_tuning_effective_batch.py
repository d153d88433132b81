"""Tuning spends no trial on `accum_steps` at a fixed effective batch (it changes memory
and speed, not the training): with `micro_batch_size`, the effective batch alone is
searched, with the fewest `accum_steps` whose micro-batches fit."""

import numpy as np
import pytest

keras_tuner = pytest.importorskip("keras_tuner")
import keras  # noqa: E402

from tfx_gradient_accumulator.accumulator.tuning import AccumulatingHyperModel, accum_steps_that_fit  # noqa: E402


def _build(hp):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(hp.Choice("learning_rate", [1e-2, 1e-1])), loss="mse")
    return model


def test_the_fewest_accum_steps_that_fit_the_largest_effective_batch():
    assert accum_steps_that_fit(16, (1, 2, 4, 8), (16, 32, 64)) == 4
    assert accum_steps_that_fit(48, (8, 1, 2), (32, 96)) == 2
    assert accum_steps_that_fit(48, (8, 1, 3), (32, 96)) == 8      # 3 does not divide 32


@pytest.mark.parametrize("bad, match", [(0, "micro_batch_size"), ("16", "micro_batch_size"),
                                        (4, "no `accum_steps` choice")])
def test_a_micro_batch_size_that_fits_nothing_is_refused_before_any_work(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        AccumulatingHyperModel(_build, accum_steps=(1, 2), effective_batch_sizes=(32,), micro_batch_size=bad)


def _trials(tmp_path, **kwargs):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(128, 4)).astype("float32")
    y = x[:, :1]
    tuner = keras_tuner.GridSearch(
        AccumulatingHyperModel(_build, accum_steps=(1, 2, 4), effective_batch_sizes=(16, 32), **kwargs),
        objective="loss", max_trials=20, directory=str(tmp_path), project_name="p")
    tuner.search(x, y, epochs=1, steps_per_epoch=1, verbose=0)
    return [t.hyperparameters.values for t in tuner.oracle.trials.values()]


def test_trials_differ_in_the_effective_batch_or_the_models_own_hyperparameters(tmp_path):
    trials = _trials(tmp_path / "fit", micro_batch_size=16)
    seen = {(v["effective_batch_size"], v["learning_rate"]) for v in trials}
    assert len(trials) == len(seen) == 4       # 2 effective batches x 2 learning rates
    assert all(v["accum_steps"] == 2 for v in trials)   # 32 // 16


@pytest.mark.apart      # 12 trials (about 100 s); the search above is the behaviour
def test_control_searching_accum_steps_too_spends_trials_that_differ_in_it_alone(tmp_path):
    searched = _trials(tmp_path / "all")
    assert len(searched) == 12 and len({(v["effective_batch_size"], v["learning_rate"]) for v in searched}) == 4
