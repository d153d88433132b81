"""Tuning on the gradient noise scale: the probe, and search choices centred on it.

The probe is checked against the closed form of least squares at fixed weights
(the library's own test problem, `tests/accumulator/test_noise_scale*.py`:
B_simple = 1 + d (1 + s^2 / |delta|^2) = 31) and, with moving weights, against
a GradientAccumulator built by hand on the same micro-batches. The choices are
checked by brute force (the log-nearest multiple) and by handing them to
`declare_accumulation` and `AccumulatingHyperModel`.
"""

import math

import pytest

keras_tuner = pytest.importorskip("keras_tuner")     # not in the oldest environment
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfx_gradient_accumulator.accumulator import GradientAccumulator  # noqa: E402
from tfx_gradient_accumulator.accumulator.tuning import (  # noqa: E402
    AccumulatingHyperModel,
    NoiseScaleProbe,
    accum_steps_for_noise_scale,
    accumulation_choices_around,
    declare_accumulation,
    effective_batch_sizes_around,
    probe_noise_scale,
)
from tests.accumulator import reference as ref  # noqa: E402
from tests.accumulator import test_noise_scale as fit_tests  # noqa: E402
from tests.accumulator import test_noise_scale_estimator as est


def _log_nearest_multiple(target, unit, search=10_000):
    """Brute force: the positive multiple of `unit` closest to `target` in log distance."""
    return min((unit * k for k in range(1, search)), key=lambda b: (abs(math.log(b / target)), b))


# ------------------------------------------------------------------ the probe

# Apart (14 s each): the same 1000 windows reach the closed form through fit in
# test_noise_scale.py (test_least_squares_through_fit_matches_the_closed_form), and the probe's
# sums, history and accum_steps are a hand-built accumulator's below, on arrays and a dataset.
@pytest.mark.apart
@pytest.mark.parametrize("as_dataset", [False, True])
def test_probe_on_least_squares_lands_on_the_closed_form(as_dataset):
    """Fixed weights (SGD, learning rate 0): every window samples B_simple = 31.

    1000 windows of 4 x 16 (64,000 samples, one pass), smoothing 0.998: the
    setting whose spread over 20 seeds is measured in the estimator's tests
    (std 2.4%, max 5.0%); the tolerance is theirs, 12%.
    """
    windows, micro, accum = est.LSQ_WINDOWS, 16, 4
    x, y, weights = fit_tests._least_squares_data(windows, micro * accum)
    truth = est._least_squares_truth(10, 1.0, 2.0)[2]

    def build_model():
        model = fit_tests._least_squares_model(weights)
        model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
        return model

    data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(100)) if as_dataset else dict(x=x, y=y)
    probe = probe_noise_scale(build_model, **data, micro_batch_size=micro, accum_steps=accum,
                              updates=windows, noise_scale_smoothing=est.LSQ_SMOOTHING, seed=3,
                              shuffle_buffer=4096)
    print("probe", probe.noise_scale, "closed form", truth)
    assert (probe.windows, probe.updates, probe.accum_steps, probe.micro_batch_size) == (windows, windows, accum, micro)
    assert probe.resolved and abs(probe.noise_scale - truth) <= 0.12 * truth
    assert probe.noise_scale == pytest.approx(probe.trace / probe.gradient_sq_norm, rel=1e-6)
    # 31 / 16 = 1.9 micro-batches: accum_steps 2 (the log-nearest count).
    expected = _log_nearest_multiple(probe.noise_scale, micro) // micro
    assert probe.accum_steps_for_noise_scale == expected == 2
    assert [u for u, _ in probe.history] == list(range(1, windows + 1))
    assert probe.history[-1][1] == probe.noise_scale


@pytest.mark.parametrize("as_dataset", [False, True])
def test_probe_trains_and_measures_like_a_hand_built_accumulator(as_dataset):
    """Moving weights (Adam): the probe's estimate is that of a GradientAccumulator
    built by hand, fed the same micro-batches in the same order (a dataset batched
    at 100 is re-batched at the micro-batch)."""
    x, y = ref.regression_data(512)

    def build_model():
        model = ref.mlp()
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="mse")
        return model

    data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(100)) if as_dataset else dict(x=x, y=y)
    probe = probe_noise_scale(build_model, **data, micro_batch_size=16, accum_steps=4, updates=20,
                              noise_scale_smoothing=0.9, shuffle=False)

    model = ref.mlp()
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), 4, measure_noise_scale=True,
                                    noise_scale_smoothing=0.9)
    model.compile(optimizer=optimizer, loss="mse")
    by_update = {}

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            by_update[int(optimizer.iterations.numpy())] = optimizer.noise_scale

    data = tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(16, drop_remainder=True)
    model.fit(data, steps_per_epoch=80, verbose=0, callbacks=[Record()])
    print("probe", probe.noise_scale, "hand-built", optimizer.noise_scale)
    assert (probe.windows, probe.updates, probe.smoothing) == (20, 20, 0.9)
    assert probe.noise_scale == pytest.approx(optimizer.noise_scale, rel=1e-6)
    assert dict(probe.history) == pytest.approx({u: v for u, v in by_update.items() if u > 0}, rel=1e-6)
    assert probe.resolved and probe.accum_steps_for_noise_scale == max(
        1, _log_nearest_multiple(probe.noise_scale, 16) // 16)


def test_default_smoothing_weighs_the_whole_probe():
    x, y = ref.regression_data(256)

    def build_model():
        model = ref.mlp()
        model.compile(optimizer="sgd", loss="mse")
        return model

    assert probe_noise_scale(build_model, x, y, micro_batch_size=8, accum_steps=2, updates=4).smoothing == 0.75


def _build_plain():
    model = ref.mlp()
    model.compile(optimizer="sgd", loss="mse")
    return model


def _build_uncompiled():
    return ref.mlp()


def _build_own_accumulator():
    model = ref.mlp()
    model.compile(optimizer=GradientAccumulator(keras.optimizers.SGD(), 2), loss="mse")
    return model


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(accum_steps=1), ValueError, r"`accum_steps` must be an integer >= 2; received 1"),
        (dict(micro_batch_size=0), ValueError, "`micro_batch_size` must be a positive integer"),
        (dict(micro_batch_size=4.0), TypeError, "`micro_batch_size`"),
        (dict(micro_batch_size=1000), ValueError, r"`micro_batch_size` \(1000\) is larger than the data"),
        (dict(updates=0), ValueError, "`updates` must be a positive integer"),
        (dict(noise_scale_smoothing=1.0), ValueError, "`noise_scale_smoothing`"),
        (dict(y=None), ValueError, "`y`"),
        (dict(build_model="model"), TypeError, "`build_model` must be callable"),
        (dict(build_model=_build_uncompiled), ValueError, "must compile the model"),
        (dict(build_model=_build_own_accumulator), ValueError, "its own GradientAccumulator"),
    ],
)
def test_probe_arguments_are_checked(kwargs, error, message):
    x, y = ref.regression_data(64)
    args = dict(build_model=_build_plain, x=x, y=y, micro_batch_size=8, accum_steps=2, updates=2)
    args.update(kwargs)
    with pytest.raises(error, match=message):
        probe_noise_scale(args.pop("build_model"), args.pop("x"), args.pop("y"), **args)


def test_probe_of_a_dataset_takes_no_y():
    x, y = ref.regression_data(64)
    with pytest.raises(ValueError, match="`y` must be None"):
        probe_noise_scale(_build_plain, tf.data.Dataset.from_tensor_slices((x, y)).batch(8), y,
                          micro_batch_size=8, updates=1)


# ---------------------------------------------------------------- the choices

def _probe(noise_scale, micro=16):
    return NoiseScaleProbe(noise_scale, windows=10, micro_batch_size=micro, accum_steps=4, updates=10,
                           smoothing=0.9, gradient_sq_norm=1.0, trace=noise_scale)


@pytest.mark.parametrize("noise_scale", [5.3, 31.0, 300.0, 4321.0])
@pytest.mark.parametrize("accum_steps", [(1, 2, 4, 8), (2, 3), (4,)])
def test_effective_batches_are_centred_on_the_noise_scale_and_valid_for_the_hypermodel(noise_scale, accum_steps):
    factors = (0.5, 1.0, 2.0)
    choices = effective_batch_sizes_around(noise_scale, accum_steps, factors)
    unit = math.lcm(*accum_steps)
    expected = sorted({_log_nearest_multiple(f * noise_scale, unit) for f in factors})
    assert list(choices) == expected
    assert all(b % a == 0 for b in choices for a in accum_steps)
    # Centred: the middle factor's choice is the valid batch nearest the estimate.
    assert _log_nearest_multiple(noise_scale, unit) in choices
    # Accepted as they are by the search space, and every trial's micro-batch is whole.
    hp = keras_tuner.HyperParameters()
    declare_accumulation(hp, accum_steps, choices)
    hypermodel = AccumulatingHyperModel(lambda hp: _build_plain(), accum_steps=accum_steps, effective_batch_sizes=choices)
    model = hypermodel.build(hp)
    assert isinstance(model.optimizer, GradientAccumulator)
    assert effective_batch_sizes_around(_probe(noise_scale), accum_steps, factors) == choices


def test_effective_batches_divide_over_replicas_too():
    choices = effective_batch_sizes_around(300.0, (1, 2, 4), replicas=3)
    assert list(choices) == sorted({_log_nearest_multiple(f * 300.0, 12) for f in (0.5, 1.0, 2.0)})
    assert all(b % (a * 3) == 0 for b in choices for a in (1, 2, 4))


@pytest.mark.parametrize("noise_scale, micro, replicas", [(300.0, 32, 1), (31.0, 16, 1), (5000.0, 64, 2), (3.0, 64, 1)])
def test_accumulation_choices_keep_every_trial_within_the_micro_batch(noise_scale, micro, replicas):
    choices = accumulation_choices_around(noise_scale, micro, replicas=replicas)
    (accum,) = choices["accum_steps"]
    sizes = choices["effective_batch_sizes"]
    assert all(b % (accum * replicas) == 0 and b // (accum * replicas) <= micro for b in sizes)
    # The smallest such accum_steps: one less overflows the micro-batch or changes the grid.
    if accum > 1:
        smaller = effective_batch_sizes_around(noise_scale, (accum - 1,), replicas=replicas)
        assert max(smaller) > (accum - 1) * replicas * micro
    assert sizes == effective_batch_sizes_around(noise_scale, (accum,), replicas=replicas)
    AccumulatingHyperModel(lambda hp: _build_plain(), **choices).build(keras_tuner.HyperParameters())


@pytest.mark.parametrize("noise_scale, micro, expected", [(31.0, 16, 2), (55.0, 16, 3), (56.0, 16, 4),
                                                         (3.0, 16, 1), (16.0, 16, 1)])
def test_accum_steps_for_noise_scale_rounds_on_a_log_scale(noise_scale, micro, expected):
    # 55 / 16 = 3.44 < sqrt(12) = 3.46 < 56 / 16 = 3.5
    assert accum_steps_for_noise_scale(noise_scale, micro) == expected
    assert _probe(noise_scale, micro).accum_steps_for_noise_scale == expected


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -3.0, 0.0, True, "31"])
def test_unusable_estimates_are_refused(bad):
    with pytest.raises(ValueError, match="`noise_scale` must be a finite, positive number"):
        effective_batch_sizes_around(bad)
    with pytest.raises(ValueError, match="`noise_scale`"):
        accumulation_choices_around(bad, 16)
    with pytest.raises(ValueError, match="`noise_scale`"):
        accum_steps_for_noise_scale(bad, 16)


def test_an_unresolved_probe_is_refused_and_has_no_accum_steps():
    probe = _probe(float("nan"))
    assert not probe.resolved and probe.accum_steps_for_noise_scale is None
    with pytest.raises(ValueError, match="NoiseScaleProbe without a usable estimate"):
        effective_batch_sizes_around(probe)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(accum_steps=()), ValueError, "`accum_steps` must be a non-empty list"),
        (dict(accum_steps=(2, 0)), ValueError, r"`accum_steps\[1\]` must be a positive integer"),
        (dict(factors=()), ValueError, "`factors` must be a non-empty list"),
        (dict(factors=(1.0, -2.0)), ValueError, r"`factors\[1\]` must be a finite, positive number"),
        (dict(replicas=0), ValueError, "`replicas` must be a positive integer"),
    ],
)
def test_choice_arguments_are_checked(kwargs, error, message):
    with pytest.raises(error, match=message):
        effective_batch_sizes_around(100.0, **kwargs)
