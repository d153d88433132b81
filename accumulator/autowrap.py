"""Accumulation for training code that was written without it: `accumulating_compile`.

Under the context manager, `Model.compile` (Keras 3's, and Keras 2's where installed)
wraps every optimizer it is given in a `GradientAccumulator`, so an unchanged training
function trains with accumulation (the TFX executor and the KerasTuner helpers use it).
Everything is restored when the context closes; the mechanics are `accumulator.hooks`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import TYPE_CHECKING
from typing import Any, Dict, Optional

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import hooks
from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.batch_norm import configure_batch_norm
from tfx_gradient_accumulator.accumulator.schedules.auto_batch import AutoAccumulation
from tfx_gradient_accumulator.accumulator.schedules.callbacks import AccumulationSchedule, accum_steps_at
from tfx_gradient_accumulator.accumulator.gradient_cache import GradientCache, validate_gather_across_replicas
from tfx_gradient_accumulator.accumulator.optimizer import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core.options import (
    DEFAULT_SMOOTHING, WindowOptions, validate_accum_steps, validate_bool, validate_lr_ramp_updates,
    validate_lr_scaling, validate_schedule, validate_schedule_by,
)
from tfx_gradient_accumulator.accumulator.window.window import AccumulationWindow

if TYPE_CHECKING:
    from tfx_gradient_accumulator.accumulator.batch.backup import TrainingBackup

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What `accumulating_compile` was asked for, checked once: the wrappers' options
    and what every `fit` of theirs follows."""

    options: WindowOptions
    schedule: Optional[Dict[int, int]] = None
    schedule_by: str = "epoch"
    lr_scaling: str = "none"
    auto: Optional[Dict[str, Any]] = None
    lr_ramp_updates: int = 0


@contextlib.contextmanager
def accumulating_compile(accum_steps: int | None = None, schedule: dict[int, int] | None = None,
                         partial_window: str = "apply", strategy: tf.distribute.Strategy | None = None,
                         measure_noise_scale: bool = False, noise_scale_smoothing: float = DEFAULT_SMOOTHING,
                         merge_duplicate_rows: bool = False, gradient_cache: bool = False,
                         backup: TrainingBackup | None = None, schedule_by: str = "epoch",
                         lr_scaling: str = "none", auto: dict | None = None, gather_across_replicas: bool = False,
                         options: Optional[WindowOptions] = None, lr_ramp_updates: int = 0):
    """Context: `keras.Model.compile` wraps the optimizers it is given in `GradientAccumulator`.

    Works with Keras 3's `compile` and, where installed, Keras 2's (`tf_keras`). For a
    `mixed_float16` model the wrapper goes around a `LossScaleOptimizer`, with Keras' own
    loss-scale wrapping turned off; the model's `AccumBatchNormalization` layers get
    the same `accum_steps`. Everything is restored when the context closes.

    Args:
        accum_steps: micro-batches per update (the starting window with `auto`).
        schedule: `{epoch: accum_steps}` (or `{update: accum_steps}` with
            `schedule_by="update"`): the wrappers are schedulable and every `fit` of a
            model compiled here follows it (`AccumulationSchedule`).
        partial_window: the wrappers' (see `GradientAccumulator`).
        strategy: the body runs under it, and every strategy scope opened inside
            maps onto it.
        measure_noise_scale: the wrappers' (needs `accum_steps >= 2` or a `schedule`).
        noise_scale_smoothing: the wrappers'.
        merge_duplicate_rows: the wrappers'.
        gradient_cache: for losses that couple the batch: nothing is wrapped;
            `compile` on a `GradientCache` model (of either Keras) sets its
            `accum_steps` and keeps its plain optimizer (the batch `fit` is given is
            the effective batch), and `compile` on any other model is refused.
            Without it, `compile` on a `GradientCache` is refused (wrapping its
            optimizer would accumulate twice).
        backup: a `TrainingBackup` that every `fit` inside runs through (backed up,
            resumed from its latest backup, exactly).
        schedule_by: "epoch" or "update" (see `AccumulationSchedule`).
        lr_scaling: "none", "linear" or "sqrt": the learning rate as the window
            grows (see `AccumulationSchedule`).
        auto: `{"micro_batch_size": global micro-batch, "max_effective_batch_size":
            ...}` (and optionally the rule's other settings, e.g. `max_sample_overhead`): `accum_steps`
            (>= 2) is the starting window and every `fit` grows it with the measured
            noise scale (`AutoAccumulation`, read back as `wrapper.auto_accumulation`).
        gather_across_replicas: with `gradient_cache` only: every compiled
            `GradientCache` scores the global batch on every replica (True), or each
            replica's share (False).
        options: a `WindowOptions` instead of `accum_steps`, `partial_window`,
            `measure_noise_scale`, `noise_scale_smoothing` and `merge_duplicate_rows`
            (not both).
        lr_ramp_updates: with a `schedule` by update: the updates over which the
            learning rate ramps to its new value after each change (see
            `AccumulationSchedule`; 0 jumps). `auto` takes its own in `auto`.

    Yields:
        The list of wrappers made (with `gradient_cache`: the optimizers of the
        `GradientCache` models compiled), filled as `compile` is called.

    Raises:
        ValueError: an argument is out of its allowed values, both `options` and the
            options it holds are given, window options or `auto` come with
            `gradient_cache`, or `gather_across_replicas` comes without it; all
            before the body runs.
        TypeError: an argument has the wrong type.
    """
    window_arguments = dict(partial_window=partial_window, measure_noise_scale=measure_noise_scale,
                            noise_scale_smoothing=noise_scale_smoothing, merge_duplicate_rows=merge_duplicate_rows)
    validate_bool(gather_across_replicas, "gather_across_replicas")
    if gather_across_replicas and not gradient_cache:
        raise ValueError("accumulating_compile(gather_across_replicas=True) needs gradient_cache=True: "
                         "only GradientCache scores a loss over the whole batch.")
    if gradient_cache:
        _refuse_window_options(schedule, window_arguments if options is None else options.get_config())
        if auto is not None:
            raise ValueError("accumulating_compile(gradient_cache=True) does not support `auto`: "
                             "GradientCache has no windows and measures no noise scale.")
    if options is not None:
        options = WindowOptions.from_arguments(options, **window_arguments)    # not both
    plan = _plan(accum_steps, schedule, schedule_by, lr_scaling, auto, options, window_arguments, lr_ramp_updates)
    accum_steps = plan.options.accum_steps
    made = []

    def wrapping_compile(original):
        def compile(self, optimizer="rmsprop", *args, **kwargs):
            if gradient_cache or isinstance(self, GradientCache):
                _set_up_gradient_cache(self, optimizer, accum_steps, gradient_cache, gather_across_replicas)
                result = original(self, optimizer, *args, **kwargs)
                made.append(self.optimizer)
                return result
            if optimizer is not None:
                optimizer = _wrapped(self, optimizer, kwargs, plan)
                made.append(optimizer)
            return original(self, optimizer, *args, **kwargs)

        compile.__doc__ = original.__doc__
        return compile

    with contextlib.ExitStack() as stack:
        stack.enter_context(hooks.swapped(keras.Model, "compile", wrapping_compile))
        keras2 = flavours.keras2_module()
        if keras2 is not None and keras2.Model is not keras.Model:
            stack.enter_context(hooks.swapped(keras2.Model, "compile", wrapping_compile))
        if strategy is not None and (strategy is not tf.distribute.get_strategy() or tf.distribute.has_strategy()):
            stack.enter_context(strategy.scope())
            stack.enter_context(hooks.strategy_scopes_map_onto(strategy))
        if backup is not None:
            stack.enter_context(hooks.fits_backed_up(backup))
        yield made



def _wrapped(model, optimizer, kwargs, plan):
    """`optimizer` (as `compile` got it) in a `GradientAccumulator` made by `plan`;
    a mixed_float16 model's loss scaling goes inside it (Keras would put it around)."""
    if isinstance(optimizer, AccumulationWindow):
        logger.warning(
            "run_fn compiled with its own GradientAccumulator (accum_steps=%d); "
            "it is kept, and the component's accum_steps=%d is not applied.",
            optimizer.accum_steps, plan.options.accum_steps,
        )
        return optimizer
    keras2 = flavours.is_keras2_object(model)
    package = flavours.keras_package_of(model) if keras2 else keras
    inner = package.optimizers.get(optimizer)
    policy = getattr(model, "dtype_policy", None)
    mixed_float16 = policy is not None and policy.name == "mixed_float16"
    if keras2 and mixed_float16 and not isinstance(inner, package.mixed_precision.LossScaleOptimizer):
        # Keras 2's compile would put one around the accumulator; put it inside.
        inner = package.mixed_precision.LossScaleOptimizer(inner)
    elif not keras2 and mixed_float16 and kwargs.get("auto_scale_loss", True) and \
            not isinstance(inner, keras.optimizers.LossScaleOptimizer):
        inner = keras.optimizers.LossScaleOptimizer(inner)
        kwargs["auto_scale_loss"] = False
    wrapper = GradientAccumulator(inner, options=plan.options)
    wrapper.fit_callback = _fit_callback(package, plan)
    wrapper.auto_accumulation = wrapper.fit_callback() if plan.auto is not None else None
    if not keras2:
        configure_batch_norm(model, plan.options.accum_steps, wrapper)
    logger.info("Wrapped %s in GradientAccumulator(accum_steps=%d).", type(inner).__name__,
                plan.options.accum_steps)
    return wrapper


def _plan(accum_steps, schedule, schedule_by, lr_scaling, auto, options, window_arguments,
          lr_ramp_updates=0) -> _Plan:
    """Checks what `accumulating_compile` was given (`options`, or `accum_steps` and the
    `window_arguments`), once; the wrappers are schedulable with a schedule or `auto`,
    and measure the noise scale with `auto`."""
    validate_lr_scaling(lr_scaling)
    validate_schedule_by(schedule_by)
    validate_lr_ramp_updates(lr_ramp_updates, schedule_by, changes=schedule is not None, advice=(
        "accumulating_compile(lr_ramp_updates=...) goes with a `schedule` by update; without one nothing "
        "changes (`auto` takes its own ramp in `auto`)."))
    if options is not None and accum_steps is None:
        accum_steps = options.accum_steps
    if auto is not None:
        if schedule is not None:
            raise ValueError("accumulating_compile: `auto` and `schedule` exclude each other "
                             "(auto makes the schedule).")
        accum_steps = validate_accum_steps(accum_steps)
        if accum_steps < 2:
            raise ValueError(f"accumulating_compile(auto=...) needs `accum_steps` >= 2 to start from "
                             f"(the noise scale is measured over windows of several micro-batches); "
                             f"received {accum_steps}.")
        AutoAccumulation.for_keras(keras)(start_accum_steps=accum_steps, lr_scaling=lr_scaling, **auto)
    if schedule is not None:
        schedule = validate_schedule(schedule)
        accum_steps = accum_steps_at(schedule, 0)
    changing = schedule is not None or auto is not None
    if options is None:
        measure = window_arguments["measure_noise_scale"] or auto is not None
        options = WindowOptions(**dict(window_arguments, accum_steps=accum_steps, schedulable=changing,
                                       measure_noise_scale=measure))
    else:
        options = dataclasses.replace(options, accum_steps=accum_steps, schedulable=options.schedulable or changing,
                                      measure_noise_scale=options.measure_noise_scale or auto is not None)
    return _Plan(options, schedule, schedule_by, lr_scaling, auto, lr_ramp_updates)


def _fit_callback(package, plan):
    """What makes the window callback of each `fit` of a wrapper: a new
    `AccumulationSchedule` per `fit`, or the wrapper's one `AutoAccumulation`
    (its decisions carry on into a later `fit`); None for a plain `EpochWindows`."""
    if plan.auto is not None:
        rule = AutoAccumulation.for_keras(package)(start_accum_steps=plan.options.accum_steps,
                                                lr_scaling=plan.lr_scaling, **plan.auto)
        return lambda: rule
    if plan.schedule is None:
        return None
    schedule_class = AccumulationSchedule.for_keras(package)
    return lambda: schedule_class(plan.schedule, by=plan.schedule_by, lr_scaling=plan.lr_scaling,
                                  lr_ramp_updates=plan.lr_ramp_updates)


def _set_up_gradient_cache(model, optimizer, accum_steps, gradient_cache, gather_across_replicas=False):
    """Before `compile` under `gradient_cache`: gives a `GradientCache` model the
    `accum_steps` and `gather_across_replicas`; refuses any other model, and a
    `GradientCache` compiled without `gradient_cache` or with an accumulating
    optimizer (either would accumulate twice)."""
    if not isinstance(model, GradientCache):
        raise ValueError(
            f"With gradient_cache=True (AccumulatingTrainer's, or AccumulatingHyperModel's) the "
            "run_fn must wrap its model in accumulator.GradientCache before compiling it "
            "(`model = GradientCache(model, accum_steps=1)`, then `model.compile(optimizer=...)`: "
            "the accum_steps is set for it, the data come at the effective batch); it compiled a "
            f"{type(model).__name__}, which is not one.")
    if not gradient_cache:
        raise ValueError(
            "The training code compiled an accumulator.GradientCache under accumulating_compile "
            "without gradient_cache=True: its optimizer would be wrapped in a GradientAccumulator "
            "and every batch accumulated twice. Set gradient_cache=True on the component "
            "(AccumulatingTrainer(..., gradient_cache=True), or AccumulatingHyperModel(..., "
            "gradient_cache=True)); or compile a model that is not a GradientCache.")
    if isinstance(optimizer, AccumulationWindow):
        raise ValueError(
            "gradient_cache=True: the GradientCache was compiled with a GradientAccumulator, which "
            "would accumulate its batches a second time; compile it with the plain optimizer.")
    accum_steps = validate_accum_steps(accum_steps)
    if model.accum_steps not in (1, accum_steps):
        # A value of its own (1, as documented, is the placeholder): say it is replaced.
        logger.warning("GradientCache(accum_steps=%d) is given accum_steps=%d by accumulating_compile "
                       "(the component's or the tuner's value).", model.accum_steps, accum_steps)
    model.accum_steps = accum_steps
    _set_gathering(model, gather_across_replicas)


def _set_gathering(model, gather_across_replicas):
    """The component's (or tuner's) `gather_across_replicas` replaces the model's own,
    checked as `GradientCache` (of the model's Keras) checks it; a change is said, as
    for accum_steps."""
    if flavours.is_keras2_object(model):
        from tfx_gradient_accumulator.accumulator.keras2 import gradient_cache as keras2_gradient_cache

        keras2_gradient_cache.validate_gather_across_replicas(model.model, gather_across_replicas)
    else:
        validate_gather_across_replicas(model.model, gather_across_replicas)
    if model.gather_across_replicas != gather_across_replicas:
        logger.warning("GradientCache(gather_across_replicas=%s) is given gather_across_replicas=%s by "
                       "accumulating_compile (the component's value).", model.gather_across_replicas,
                       gather_across_replicas)
    model.gather_across_replicas = gather_across_replicas


def _refuse_window_options(schedule, window_arguments):
    """GradientCache makes one update of each batch and holds nothing between steps."""
    given = {"schedule": schedule is not None,
             "partial_window": window_arguments.get("partial_window", "apply") != "apply",
             "measure_noise_scale": bool(window_arguments.get("measure_noise_scale")),
             "merge_duplicate_rows": bool(window_arguments.get("merge_duplicate_rows"))}
    named = [name for name, set_ in given.items() if set_]
    if named:
        raise ValueError(
            f"accumulating_compile(gradient_cache=True) does not support {', '.join(named)}: those "
            "are options of GradientAccumulator's windows, and GradientCache makes one update of "
            "each batch, holding nothing between steps.")
