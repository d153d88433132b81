"""Accumulation as KerasTuner hyperparameters.

`declare_accumulation(hp)` adds `accum_steps` and `effective_batch_size` to a search
space; `AccumulatingHyperModel(build_model)` makes every trial train with its own
accumulation and micro-batch, in any KerasTuner tuner and in TFX's Tuner component
(return it from `tuner_fn`; the best values reach `AccumulatingTrainer` through its
`hyperparameters`). `probe_noise_scale` measures the gradient noise scale briefly, and
`effective_batch_sizes_around` / `accumulation_choices_around` centre the search on it.
At a fixed effective batch `accum_steps` changes memory and speed, not the training.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import TYPE_CHECKING
from typing import Optional, Tuple

import keras
import keras_tuner
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.autowrap import accumulating_compile
from tfx_gradient_accumulator.accumulator.batch.micro_batch import find_micro_batch
from tfx_gradient_accumulator.accumulator.core.options import (
    AUTO, AUTO_START_ACCUM_STEPS, FIT, WindowOptions, integer_at_least,
)

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)

ACCUM_STEPS = "accum_steps"
EFFECTIVE_BATCH_SIZE = "effective_batch_size"


def declare_accumulation(hp: keras_tuner.HyperParameters, accum_steps: Sequence[int] = (1, 2, 4, 8),
                         effective_batch_sizes: Sequence[int] = (32, 64, 128)) -> tuple[int, int]:
    """Declares `accum_steps` and `effective_batch_size` as choices on `hp`.

    Args:
        hp: the search space.
        accum_steps: the `accum_steps` choices.
        effective_batch_sizes: the effective-batch choices; each must divide evenly
            into every `accum_steps` choice.

    Returns:
        `(accum_steps, effective_batch_size)`: the trial's values.

    Raises:
        ValueError: a choice is not a positive integer, or an effective batch does not
            divide into an `accum_steps` choice.
        TypeError: a choice is not an integer.
    """
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


def accum_steps_that_fit(micro_batch_size: int, accum_steps: Sequence[int] = (1, 2, 4, 8),
                         effective_batch_sizes: Sequence[int] = (32, 64, 128)) -> int:
    """One `accum_steps` for the whole search, fitted to its largest batch.

    Args:
        micro_batch_size: the largest micro-batch that fits in memory.
        accum_steps: the `accum_steps` choices.
        effective_batch_sizes: the effective-batch choices.

    Returns:
        The fewest micro-batches (the fastest) among `accum_steps` that cut every
        effective batch evenly into micro-batches of at most `micro_batch_size`.

    Raises:
        ValueError: a value is not a positive integer, or no choice fits.
        TypeError: a value is not an integer.
    """
    micro_batch_size = integer_at_least(micro_batch_size, "micro_batch_size")
    accum_steps = sorted(integer_at_least(v, f"accum_steps[{i}]") for i, v in enumerate(accum_steps))
    batches = [integer_at_least(v, f"effective_batch_sizes[{i}]") for i, v in enumerate(effective_batch_sizes)]
    fitting = [a for a in accum_steps if all(b % a == 0 and b // a <= micro_batch_size for b in batches)]
    if not fitting:
        raise ValueError(
            f"`micro_batch_size`={micro_batch_size}: no `accum_steps` choice {accum_steps} cuts every "
            f"effective batch {batches} into even micro-batches of at most {micro_batch_size}; add a "
            "larger accum_steps choice or a larger micro_batch_size."
        )
    return fitting[0]


MAX_EFFECTIVE_BATCH_SIZE = "max_effective_batch_size"


def micro_batch(hp: keras_tuner.HyperParameters) -> int:
    """The trial's micro-batch: its effective batch over its (starting) `accum_steps`.

    Args:
        hp: the trial's hyperparameters (`declare_accumulation`'s).

    Returns:
        The micro-batch size in samples.
    """
    return hp.get(EFFECTIVE_BATCH_SIZE) // _starting_accum_steps(hp)


def _starting_accum_steps(hp):
    """The trial's `accum_steps`, or the one "auto" starts from."""
    accum = hp.get(ACCUM_STEPS)
    return AUTO_START_ACCUM_STEPS if accum == AUTO else accum


def _fit_choices(effective_batch_sizes, gradient_cache, micro_batch_size, max_effective_batch_size):
    """The effective-batch choices of `accum_steps="fit"`, checked; what "fit" excludes refused."""
    if gradient_cache:
        raise ValueError("`accum_steps='fit'` is not supported with `gradient_cache=True`: GradientCache "
                         "cuts each batch into `accum_steps` micro-batches itself; set int `accum_steps`.")
    if micro_batch_size is not None:
        raise ValueError("`micro_batch_size` states the micro-batch that fits; `accum_steps='fit'` finds it "
                         "on the device for each trial: give one or the other.")
    if max_effective_batch_size is not None:
        raise ValueError("`max_effective_batch_size` is the limit of `accum_steps='auto'`; `accum_steps` "
                         "is 'fit'.")
    if isinstance(effective_batch_sizes, (str, bytes)) or not effective_batch_sizes:
        raise ValueError("`accum_steps='fit'` searches the effective batch: `effective_batch_sizes` must be "
                         f"a non-empty list of positive integers; received {effective_batch_sizes!r}.")
    return tuple(integer_at_least(v, f"effective_batch_sizes[{i}]") for i, v in enumerate(effective_batch_sizes))


def _sample_batch(x, y, effective_batch_size):
    """`(x, y, sample_weight)` as arrays, for `find_micro_batch`: the first `effective_batch_size`
    rows of arrays, or the first batch a dataset yields."""
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ValueError("`y` must be None when `x` is a tf.data.Dataset (it yields (features, labels)).")
        batch = tf.nest.map_structure(lambda t: t.numpy(), next(iter(x.take(1))))
        return keras.utils.unpack_x_y_sample_weight(batch if isinstance(batch, tuple) else (batch,))
    if isinstance(x, list):
        x = tuple(x)
    first = tf.nest.map_structure(lambda a: None if a is None else np.asarray(a)[:effective_batch_size], (x, y))
    return first[0], first[1], None


def _fit_to_device(model, x, y, effective_batch_size):
    """`find_micro_batch` for a trial: its `MicroBatchFit` (b divides E); a trial whose step does
    not fit even at one sample fails (KerasTuner's `FailedTrialError`), and the search goes on."""
    sample_x, sample_y, sample_weight = _sample_batch(x, y, effective_batch_size)
    try:
        found = find_micro_batch(model, sample_x, sample_y, sample_weight=sample_weight,
                                 effective_batch_size=effective_batch_size, uniform=True)
    except tf.errors.ResourceExhaustedError as err:
        raise keras_tuner.errors.FailedTrialError(
            f"accum_steps='fit': effective_batch_size={effective_batch_size} cannot train on this device: "
            "not even a micro-batch of 1 sample fits (the model, its optimizer state and one sample's "
            f"activations need more memory than the device has). The trial is failed. ({err.message})"
        ) from err
    logger.info("AccumulatingHyperModel(accum_steps='fit'): the trial trains micro-batches of %d x %d "
                "per update (effective batch %d; largest micro-batch that fit: %d).",
                found.micro_batch, found.accum_steps, effective_batch_size, found.largest_fitting)
    return found


class AccumulatingHyperModel(keras_tuner.HyperModel):
    """Wraps `build_model(hp) -> compiled keras.Model`; each trial accumulates.

    Args:
        build_model: builds and compiles the model for `hp`, with a plain
            optimizer; it is wrapped in `GradientAccumulator(hp accum_steps)`.
            With `gradient_cache`, the model it compiles must be an
            `accumulator.GradientCache`, which gets the trial's `accum_steps`.
        accum_steps, effective_batch_sizes: the choices to search.
        gradient_cache: for losses that couple the batch: trials train with
            `GradientCache` (batches of the effective batch, one update each)
            instead of `GradientAccumulator` (micro-batches, `accum_steps` per
            update). Default False.
        micro_batch_size: the largest micro-batch that fits in memory. Given,
            only the effective batch (and `build_model`'s own hyperparameters)
            is searched, with one `accum_steps`: the fewest whose micro-batch
            fits for the largest effective batch (`accum_steps_that_fit`). At
            a fixed effective batch `accum_steps` changes memory and speed,
            not the training, so trials that differ only in it would train
            alike. Without it, `accum_steps` is searched too.
        accum_steps: also "fit": only the effective batch (and `build_model`'s
            own hyperparameters) is searched, and each trial finds its micro-batch
            on this device before it trains: `find_micro_batch(uniform=True)`
            runs real training steps of growing micro-batches on one sample of
            the trial's data (arrays: the first `effective_batch_size` rows; a
            `tf.data.Dataset`: the first batch it yields, one more pass
            started) until one runs out of memory, and the trial trains at
            `batch_size=b`, N = E / b micro-batches per update (both logged).
            The hyperparameters hold `accum_steps="fit"`, so
            `AccumulatingTrainer` given them finds the Trainer's micro-batch
            itself. A trial whose step does not fit even at 1 sample fails
            (KerasTuner's `FailedTrialError`: recorded as failed with the
            message, and the search goes on). The probe costs each trial
            about 2 log2(b) training steps.
        max_effective_batch_size: with `accum_steps="auto"`: each trial starts
            from its `effective_batch_sizes` choice (2 micro-batches of half of
            it) and grows the window with the measured noise scale up to this
            (`AutoAccumulation`), as `AccumulatingTrainer(accum_steps="auto")`
            trains the best: the hyperparameters hold `accum_steps="auto"` and
            this limit, so the Trainer needs neither. `steps_per_epoch` then
            counts updates at the starting batch (the samples stay).
        name: the hypermodel's name (KerasTuner's).
        tunable: whether `build_model`'s own hyperparameters are searched (KerasTuner's).

    `steps_per_epoch` given to `search`/`fit` counts optimizer updates, as TFX's
    `TrainArgs.num_steps` does, so trials with different `accum_steps` make the same
    number of updates (in a plain `fit` it counts micro-batches).

    Raises:
        ValueError: a choice is not a positive integer or does not divide evenly,
            `gradient_cache` is not a bool, or "auto" is asked with
            `gradient_cache`, `micro_batch_size` or without `max_effective_batch_size`.
    """

    def __init__(self, build_model: Callable[[keras_tuner.HyperParameters], keras.Model],
                 accum_steps: Sequence[int] | str = (1, 2, 4, 8),
                 effective_batch_sizes: Sequence[int] = (32, 64, 128), name: str | None = None,
                 tunable: bool = True, gradient_cache: bool = False,
                 micro_batch_size: int | None = None, max_effective_batch_size: int | None = None):
        super().__init__(name=name, tunable=tunable)
        if not isinstance(gradient_cache, bool):
            raise ValueError(f"`gradient_cache` must be True or False; received {gradient_cache!r}.")
        self._max_effective_batch_size = None
        self._fit = isinstance(accum_steps, str) and accum_steps == FIT
        if self._fit:
            effective_batch_sizes = _fit_choices(effective_batch_sizes, gradient_cache, micro_batch_size,
                                                 max_effective_batch_size)
            accum_steps = (FIT,)
        elif isinstance(accum_steps, str) and accum_steps != AUTO:
            raise ValueError(f"`accum_steps` must be a list of positive integers, {AUTO!r} or {FIT!r}; "
                             f"received {accum_steps!r}.")
        elif accum_steps == AUTO:
            self._max_effective_batch_size = _auto_limit(
                max_effective_batch_size, effective_batch_sizes, gradient_cache, micro_batch_size)
            accum_steps = (AUTO,)
        elif max_effective_batch_size is not None:
            raise ValueError("`max_effective_batch_size` is the limit of `accum_steps='auto'`; "
                             f"`accum_steps` is {accum_steps!r}.")
        if micro_batch_size is not None:   # one accum_steps: trials differ in the rest
            accum_steps = (accum_steps_that_fit(micro_batch_size, accum_steps, effective_batch_sizes),)
        if micro_batch_size is None and len(set(accum_steps)) > 1:
            logger.warning(
                "AccumulatingHyperModel searches accum_steps %s: at a fixed effective batch, trials that "
                "differ only in accum_steps train alike (the accumulation is exact). Pass "
                "micro_batch_size= (the largest that fits) to search the effective batch alone.",
                tuple(accum_steps))
        self._build_model = build_model
        self._accum_steps = tuple(accum_steps)
        self._effective_batch_sizes = tuple(effective_batch_sizes)
        self._gradient_cache = gradient_cache

    def build(self, hp: keras_tuner.HyperParameters) -> keras.Model:
        """Builds the trial's model, its optimizer wrapped for the trial's accumulation.

        Args:
            hp: the trial's hyperparameters.

        Returns:
            The compiled model `build_model(hp)` returned.
        """
        if self._max_effective_batch_size is not None:
            hp.Fixed(ACCUM_STEPS, AUTO)
            hp.Fixed(MAX_EFFECTIVE_BATCH_SIZE, self._max_effective_batch_size)
            effective = hp.Choice(EFFECTIVE_BATCH_SIZE, list(self._effective_batch_sizes))
            auto = {"micro_batch_size": effective // AUTO_START_ACCUM_STEPS,
                    "max_effective_batch_size": self._max_effective_batch_size}
            with accumulating_compile(AUTO_START_ACCUM_STEPS, auto=auto):
                return self._build_model(hp)
        if self._fit:    # one micro-batch a window until `fit` finds the trial's split
            hp.Fixed(ACCUM_STEPS, FIT)
            hp.Choice(EFFECTIVE_BATCH_SIZE, list(self._effective_batch_sizes))
            with accumulating_compile(options=WindowOptions(accum_steps=1, schedulable=True)):
                return self._build_model(hp)
        accum, _ = declare_accumulation(hp, self._accum_steps, self._effective_batch_sizes)
        with accumulating_compile(accum, gradient_cache=self._gradient_cache):
            return self._build_model(hp)

    def fit(self, hp: keras_tuner.HyperParameters, model: keras.Model, x=None, y=None, *args,
            steps_per_epoch: int | None = None, batch_size: int | None = None, **kwargs):
        """Trains the trial's model at its micro-batch (or, with `gradient_cache`, its effective batch).

        Args:
            hp: the trial's hyperparameters.
            model: the model `build` returned.
            x: arrays, or a `tf.data.Dataset` batched at any size (re-batched here).
            y: the labels (with arrays).
            *args: passed on to `model.fit`.
            steps_per_epoch: optimizer updates per epoch (turned into `fit` steps).
            batch_size: ignored: the trial's batch is used.
            **kwargs: passed on to `model.fit`.

        Returns:
            The `History` that `model.fit` returns.
        """
        # One `fit` step: a micro-batch (accum_steps per update), or with
        # gradient_cache a whole effective batch (one update).
        if self._gradient_cache:
            batch, steps_per_update = hp.get(EFFECTIVE_BATCH_SIZE), 1
        elif self._fit:
            found = _fit_to_device(model, x, y, hp.get(EFFECTIVE_BATCH_SIZE))
            batch, steps_per_update = found.micro_batch, found.accum_steps
        else:
            batch, steps_per_update = micro_batch(hp), _starting_accum_steps(hp)
        if isinstance(x, tf.data.Dataset):
            # Datasets arrive batched at whatever size; trials need their own.
            x = x.unbatch().batch(batch)
        else:
            batch_size = batch
        if steps_per_epoch is not None:
            steps_per_epoch = steps_per_epoch * steps_per_update
        return model.fit(x, y, *args, steps_per_epoch=steps_per_epoch, batch_size=batch_size, **kwargs)


def _auto_limit(max_effective_batch_size, effective_batch_sizes, gradient_cache, micro_batch_size):
    """`max_effective_batch_size` checked against the starting choices of "auto"."""
    if gradient_cache:
        raise ValueError("`accum_steps='auto'` is not supported with `gradient_cache=True`: GradientCache "
                         "has no windows and measures no noise scale.")
    if micro_batch_size is not None:
        raise ValueError("`micro_batch_size` chooses one `accum_steps`; `accum_steps='auto'` starts "
                         "from 2 micro-batches of half of each effective batch: leave it unset.")
    if max_effective_batch_size is None:
        raise ValueError("`accum_steps='auto'` needs `max_effective_batch_size`: the largest effective "
                         "batch a trial grows to.")
    starts = [integer_at_least(v, f"effective_batch_sizes[{i}]") for i, v in enumerate(effective_batch_sizes)]
    odd = [b for b in starts if b % AUTO_START_ACCUM_STEPS]
    if odd:
        raise ValueError(f"with `accum_steps='auto'` every `effective_batch_sizes` choice is the starting "
                         f"batch of 2 micro-batches and must be even; these are not: {odd}.")
    return integer_at_least(max_effective_batch_size, "max_effective_batch_size", max(starts))


# --------------------------------------------------------- the noise scale

@dataclasses.dataclass(frozen=True)
class NoiseScaleProbe:
    """What `probe_noise_scale` measured.

    Attributes:
        noise_scale: B_simple in samples when the probe ended (the smoothed
            estimate); NaN when no window closed, and possibly negative or
            infinite when the smoothed |G|^2 is not resolved from 0 (see
            `resolved`).
        windows: the windows (of `accum_steps` micro-batches) it came from.
        micro_batch_size, accum_steps, updates: how the probe trained.
        smoothing: the decay of the moving averages over windows.
        gradient_sq_norm, trace: the smoothed |G|^2 and tr(Sigma) (per-sample
            gradients of the mean loss), whose ratio is `noise_scale`.
        history: `((update, noise_scale), ...)` after every update: how the
            estimate moved during the probe.
    """

    noise_scale: float
    windows: int
    micro_batch_size: int
    accum_steps: int
    updates: int
    smoothing: float
    gradient_sq_norm: float
    trace: float
    history: Tuple[Tuple[int, float], ...] = ()

    @property
    def resolved(self) -> bool:
        """True when `noise_scale` is a finite, positive estimate."""
        return math.isfinite(self.noise_scale) and self.noise_scale > 0

    @property
    def effective_batch_size(self) -> int:
        """The probe's own effective batch, micro_batch_size x accum_steps."""
        return self.micro_batch_size * self.accum_steps

    @property
    def accum_steps_for_noise_scale(self) -> Optional[int]:
        """The accum_steps that brings `micro_batch_size x accum_steps` nearest the
        estimate (`accum_steps_for_noise_scale`); None when not `resolved`."""
        if not self.resolved:
            return None
        return accum_steps_for_noise_scale(self.noise_scale, self.micro_batch_size)


def _noise_scale_value(noise_scale, name="noise_scale"):
    """The noise scale as a finite positive float (a `NoiseScaleProbe`'s, resolved); ValueError otherwise."""
    if isinstance(noise_scale, NoiseScaleProbe):
        if not noise_scale.resolved:
            raise ValueError(
                f"`{name}` is a NoiseScaleProbe without a usable estimate (noise_scale="
                f"{noise_scale.noise_scale!r} from {noise_scale.windows} window(s)); probe "
                "with more `updates`, or a larger `accum_steps`."
            )
        return float(noise_scale.noise_scale)
    if isinstance(noise_scale, bool) or not isinstance(noise_scale, numbers.Real) \
            or not math.isfinite(noise_scale) or noise_scale <= 0:
        raise ValueError(
            f"`{name}` must be a finite, positive number (B_simple in samples) or a resolved "
            f"NoiseScaleProbe; received {noise_scale!r}."
        )
    return float(noise_scale)


def _nearest_count(ratio):
    """The positive integer nearest `ratio` on a log scale (at least 1)."""
    if ratio <= 1:
        return 1
    low = math.floor(ratio)
    high = low + 1
    # log-nearest: ratio below the geometric mean sqrt(low * high) rounds down.
    return low if ratio * ratio <= low * high else high


def accum_steps_for_noise_scale(noise_scale: float | NoiseScaleProbe, micro_batch_size: int) -> int:
    """The accum_steps that makes `micro_batch_size x accum_steps` nearest `noise_scale`.

    "Nearest" on a log scale (the estimate is a scale, and the critical batch a
    soft threshold): 3.4 micro-batches round to 3, 3.5 to 4 (sqrt(12) = 3.46).

    Args:
        noise_scale: B_simple in samples, or a resolved `NoiseScaleProbe`.
        micro_batch_size: samples per micro-batch.

    Returns:
        The accum_steps, at least 1.

    Raises:
        ValueError: `noise_scale` is not a finite positive number (or the probe is not
            resolved), or `micro_batch_size` is not a positive integer.
    """
    value = _noise_scale_value(noise_scale)
    micro_batch_size = integer_at_least(micro_batch_size, "micro_batch_size")
    return _nearest_count(value / micro_batch_size)


def _factors(factors):
    """`factors` as floats, checked finite and positive."""
    factors = list(factors) if isinstance(factors, (list, tuple)) else None
    if not factors:
        raise ValueError(f"`factors` must be a non-empty list of positive numbers; received {factors!r}.")
    for i, factor in enumerate(factors):
        if isinstance(factor, bool) or not isinstance(factor, numbers.Real) \
                or not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"`factors[{i}]` must be a finite, positive number; received {factor!r}.")
    return [float(f) for f in factors]


def effective_batch_sizes_around(noise_scale: float | NoiseScaleProbe, accum_steps: Sequence[int] = (1, 2, 4, 8),
                                 factors: Sequence[float] = (0.5, 1.0, 2.0), replicas: int = 1) -> tuple[int, ...]:
    """Effective-batch choices centred on the noise scale, valid with every `accum_steps` choice.

    Each choice is the multiple of `replicas x lcm(accum_steps)` nearest (on a
    log scale) to `factor x noise_scale`, for each of `factors`: so every one
    divides evenly into every `accum_steps` choice, as `declare_accumulation`
    and `AccumulatingHyperModel` require (and, with `replicas`, into
    `accum_steps x replicas`, as `AccumulatingTrainer` does). Sorted, without
    repeats (a coarse unit can merge neighbours, so there may be fewer choices
    than factors).

    Args:
        noise_scale: B_simple in samples, or a resolved `NoiseScaleProbe`.
        accum_steps: the `accum_steps` choices the search will use.
        factors: multiples of the noise scale to try (default half, once, twice).
        replicas: the replicas the Trainer will train on (1 for the Tuner).

    Returns:
        The effective batches, sorted.

    Raises:
        ValueError: `noise_scale` is not a finite positive number (or the probe is not
            resolved), `accum_steps` is not a non-empty list of positive integers,
            a factor is not finite and positive, or `replicas` < 1.
    """
    value = _noise_scale_value(noise_scale)
    if not isinstance(accum_steps, (list, tuple)) or not accum_steps:
        raise ValueError(f"`accum_steps` must be a non-empty list of positive integers; received {accum_steps!r}.")
    accum = [integer_at_least(a, f"accum_steps[{i}]") for i, a in enumerate(accum_steps)]
    replicas = integer_at_least(replicas, "replicas")
    unit = replicas * math.lcm(*accum)
    return tuple(sorted({unit * _nearest_count(f * value / unit) for f in _factors(factors)}))


def accumulation_choices_around(noise_scale: float | NoiseScaleProbe, micro_batch_size: int,
                                factors: Sequence[float] = (0.5, 1.0, 2.0), replicas: int = 1) -> dict:
    """`AccumulatingHyperModel` choices centred on the noise scale, every trial within memory.

    One accum_steps: with exact accumulation, trials that differ only in
    accum_steps train alike.

    Args:
        noise_scale: B_simple in samples, or a resolved `NoiseScaleProbe`.
        micro_batch_size: the largest micro-batch per replica that fits one device
            (the probe's, say).
        factors: multiples of the noise scale to try (default half, once, twice).
        replicas: the replicas the Trainer will train on (1 for the Tuner).

    Returns:
        `{"accum_steps": (a,), "effective_batch_sizes": (...)}`
        (`AccumulatingHyperModel(build_model, **choices)`): the effective batches of
        `effective_batch_sizes_around(noise_scale, (a,), factors, replicas)` and the
        smallest `a` for which every trial's micro-batch per replica,
        effective / (a x replicas), is at most `micro_batch_size`.

    Raises:
        ValueError: as `effective_batch_sizes_around`, or `micro_batch_size` < 1.
    """
    value = _noise_scale_value(noise_scale)
    micro_batch_size = integer_at_least(micro_batch_size, "micro_batch_size")
    replicas = integer_at_least(replicas, "replicas")
    factors = _factors(factors)
    # Below this, the largest choice rounds to more than micro_batch_size + 1 micro-batches.
    accum = max(1, math.floor(max(factors) * value / (replicas * (micro_batch_size + 1))))
    while True:
        sizes = effective_batch_sizes_around(value, (accum,), factors, replicas)
        if max(sizes) <= accum * replicas * micro_batch_size:
            return {"accum_steps": (accum,), "effective_batch_sizes": sizes}
        accum += 1


def _probe_dataset(x, y, micro_batch_size, shuffle, shuffle_buffer, seed):
    """Endless micro-batches of `micro_batch_size` samples (full ones only)."""
    if isinstance(x, tf.data.Dataset):
        if y is not None:
            raise ValueError("`y` must be None when `x` is a tf.data.Dataset (it yields (features, labels)).")
        data = x.unbatch()   # batched at any size, as AccumulatingHyperModel takes it
        if shuffle:
            data = data.shuffle(shuffle_buffer, seed=seed, reshuffle_each_iteration=True)
        return data.repeat().batch(micro_batch_size, drop_remainder=True)
    if y is None:
        raise ValueError("`y` (the labels) is needed when `x` holds arrays; or pass a tf.data.Dataset as `x`.")
    if isinstance(x, list):
        x = tuple(x)
    samples = len(np.asarray(y))
    if micro_batch_size > samples:
        raise ValueError(
            f"`micro_batch_size` ({micro_batch_size}) is larger than the data ({samples} samples)."
        )
    data = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        data = data.shuffle(samples, seed=seed, reshuffle_each_iteration=True)
    return data.repeat().batch(micro_batch_size, drop_remainder=True)


def probe_noise_scale(build_model: Callable[..., keras.Model], x, y=None, *, micro_batch_size: int,
                      accum_steps: int = 8, updates: int = 100,
                      hyperparameters: keras_tuner.HyperParameters | None = None,
                      noise_scale_smoothing: float | None = None, shuffle: bool = True,
                      shuffle_buffer: int = 10_000, seed: int | None = None) -> NoiseScaleProbe:
    """Trains a fresh model briefly and measures its gradient noise scale.

    `build_model()` (or `build_model(hyperparameters)` when given, as for
    `AccumulatingHyperModel`) builds and compiles the model with a plain
    optimizer; it trains for `updates` optimizer updates of `accum_steps`
    micro-batches of `micro_batch_size` samples with
    `GradientAccumulator(measure_noise_scale=True)`, and the smoothed B_simple
    it ends with is returned in a `NoiseScaleProbe`, with
    `accum_steps_for_noise_scale` (the accum_steps that makes
    `micro_batch_size x accum_steps` reach it).

    What it measures is the noise scale *of the probe's stretch of training*:
    B_simple typically grows as the loss falls, so a probe of a fresh model
    reads the early value, usually lower than later in training; probe a
    trained model (let `build_model` load its weights) to read the later one.
    It is the *critical* batch (where larger batches stop saving steps), not
    the batch of the best final accuracy.

    Args:
        build_model: returns a compiled `keras.Model` (plain optimizer).
        x, y: arrays (or dicts/tuples of arrays) and labels; or `x` a
            `tf.data.Dataset` of `(features, labels)` batched at any size (it is
            re-batched at `micro_batch_size`) and `y` None.
        micro_batch_size: samples per micro-batch (what fits the device).
        accum_steps: micro-batches per window, at least 2 (the estimator
            compares each micro-batch's gradient with its window's); larger
            windows resolve |G|^2 better when the noise scale is large.
        updates: optimizer updates (windows) to train and measure.
        hyperparameters: passed to `build_model` when not None.
        noise_scale_smoothing: the decay of the moving averages over windows;
            None: 1 - 1/updates (at most 0.999), which weighs the whole probe.
        shuffle: shuffle the samples (arrays: all of them, every pass;
            datasets: in a buffer of `shuffle_buffer`): the estimator assumes
            the micro-batches are independent samples.
        shuffle_buffer: the shuffle buffer's size, for a dataset.
        seed: seeds Keras (the model's initial weights) and the shuffling.

    Returns:
        The `NoiseScaleProbe`.

    Raises:
        TypeError: `build_model` is not callable, or a count is not an integer.
        ValueError: a count is out of range (`accum_steps` < 2, `updates` < 1, ...),
            or `noise_scale_smoothing` is not in [0, 1).
    """
    if not callable(build_model):
        raise TypeError(f"`build_model` must be callable (returning a compiled keras.Model); received {build_model!r}.")
    micro_batch_size = integer_at_least(micro_batch_size, "micro_batch_size")
    accum_steps = integer_at_least(accum_steps, "accum_steps", minimum=2)
    updates = integer_at_least(updates, "updates")
    shuffle_buffer = integer_at_least(shuffle_buffer, "shuffle_buffer")
    if seed is not None:
        seed = integer_at_least(seed, "seed", minimum=0)
    if noise_scale_smoothing is None:
        noise_scale_smoothing = min(1.0 - 1.0 / updates, 0.999)
    options = WindowOptions(accum_steps=accum_steps, measure_noise_scale=True,
                            noise_scale_smoothing=noise_scale_smoothing)
    data = _probe_dataset(x, y, micro_batch_size, shuffle, shuffle_buffer, seed)
    if not isinstance(x, tf.data.Dataset) and micro_batch_size * accum_steps > len(np.asarray(y)):
        logger.warning(
            "A window of %d x %d samples is larger than the data (%d samples): micro-batches of a "
            "window repeat samples, and the estimate is biased low.",
            accum_steps, micro_batch_size, len(np.asarray(y)),
        )

    model, optimizer = _probed_model(build_model, hyperparameters, options, seed)

    history = []

    class _Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            update = int(optimizer.iterations.numpy())
            if not history or history[-1][0] != update:
                history.append((update, float(optimizer.noise_scale)))

    model.fit(data, steps_per_epoch=updates * accum_steps, epochs=1, shuffle=False, verbose=0,
              callbacks=[_Record()])
    estimate = optimizer.noise_scale_estimate
    probe = NoiseScaleProbe(
        noise_scale=float(optimizer.noise_scale),
        windows=int(estimate.window_count.numpy()),
        micro_batch_size=micro_batch_size,
        accum_steps=accum_steps,
        updates=int(optimizer.iterations.numpy()),
        smoothing=noise_scale_smoothing,
        gradient_sq_norm=float(estimate.gradient_sq_norm.numpy()),
        trace=float(estimate.trace.numpy()),
        history=tuple((u, v) for u, v in history if u > 0),
    )
    if not probe.resolved:
        logger.warning(
            "The noise-scale probe has no usable estimate (%r from %d windows): probe with more "
            "`updates` or a larger `accum_steps`.", probe.noise_scale, probe.windows,
        )
    return probe


def _probed_model(build_model, hyperparameters, options, seed):
    """The model `build_model` returns, compiled under `accumulating_compile(options=...)`,
    and its measuring `GradientAccumulator`; refused where the run_fn's own optimizer
    would not measure."""
    if seed is not None:
        keras.utils.set_random_seed(seed)
    with accumulating_compile(options=options) as made:
        model = build_model() if hyperparameters is None else build_model(hyperparameters)
    optimizer = getattr(model, "optimizer", None)
    if not made or optimizer is not made[-1]:
        raise ValueError(
            "`build_model` must compile the model it returns with a plain Keras optimizer "
            "(it is wrapped to accumulate and measure); "
            + ("it compiled none." if not made else "it returned a model compiled otherwise.")
        )
    if not optimizer.measure_noise_scale:
        raise ValueError(
            "`build_model` compiled its own GradientAccumulator, which does not measure the noise "
            "scale; compile with the plain optimizer inside it."
        )
    return model, optimizer
