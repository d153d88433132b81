"""`check_exact`: does accumulation train *this* model like Keras' own large batch?

It trains the user's model three ways (Keras' large batch, the same with the samples
permuted inside each large batch: Keras' own rounding, and `GradientAccumulator` at the
micro-batch), reports max |Δw| per variable and says which differ and why; a float64
arbiter settles what float32 cannot. This module is the check's front: `check_exact`
(the steps in order) and its command line,
`python -m tfx_gradient_accumulator.accumulator.check module:function` (see `main`).
Each step is a module of its own, readable alone:

- `check_arguments`: every argument checked, and the samples taken, before any training;
- `check_runs`: the trainings (Keras' large batch, its permuted twin, the accumulator);
- `check_compare`: max |Δw| per variable against its floor, kinds, random layers, causes;
- `check_arbiter`: the float64 arbiter;
- `check_report`: `VariableDelta`, `ExactnessReport` and the defaults.

Their public names are importable from here too, as before the split.

May import: core, rows, noise, window, schedules, cache, batch, keras2, accumulator.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import logging
import sys
from typing import Any, Callable, Dict, Optional

import keras

from tfx_gradient_accumulator.accumulator.check import check_arbiter, check_compare, check_runs
from tfx_gradient_accumulator.accumulator.core import flavours
from tfx_gradient_accumulator.accumulator.check.check_arbiter import (  # noqa: F401 (public names, importable here)
    as_close_as_keras, float64_loss, float64_policy, to_float64)
from tfx_gradient_accumulator.accumulator.check.check_arguments import CheckArguments, check_argument, check_arguments
from tfx_gradient_accumulator.accumulator.check.check_report import (  # noqa: F401 (public names, importable here)
    ARBITER_CHOICES, ARBITER_SLACK, DEFAULT_ACCUM_STEPS, DEFAULT_ARBITER_FACTOR, DEFAULT_FLOOR_FACTOR,
    DEFAULT_TOLERANCE, DEFAULT_UPDATES, KINDS, ExactnessReport, VariableDelta)
from tfx_gradient_accumulator.accumulator.check.check_runs import GradientAccumulator  # noqa: F401

__all__ = ["ARBITER_CHOICES", "ARBITER_SLACK", "DEFAULT_ACCUM_STEPS", "DEFAULT_ARBITER_FACTOR", "DEFAULT_FLOOR_FACTOR",
           "DEFAULT_TOLERANCE", "DEFAULT_UPDATES", "KINDS", "ExactnessReport", "VariableDelta", "as_close_as_keras",
           "check_exact", "float64_loss", "float64_policy", "load_target", "main", "to_float64"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------- entry
def check_exact(model_fn: Callable[[], Any], data, optimizer_fn: Optional[Callable[[], Any]] = None,
                accum_steps: int = DEFAULT_ACCUM_STEPS, *, batch_size: Optional[int] = None,
                updates: int = DEFAULT_UPDATES, loss=None, compile_kwargs: Optional[Dict[str, Any]] = None,
                accumulator_options: Optional[Dict[str, Any]] = None, tolerance: float = DEFAULT_TOLERANCE,
                floor_factor: float = DEFAULT_FLOOR_FACTOR, arbiter="auto",
                arbiter_factor: float = DEFAULT_ARBITER_FACTOR, seed: int = 0,
                verbose: bool = True) -> ExactnessReport:
    """Trains `updates` updates three ways and reports whether accumulation matched Keras.

    Keras' own `fit` at batch `accum_steps * batch_size` is the reference; the same
    with the samples permuted inside each large batch gives the noise floor;
    `GradientAccumulator(optimizer_fn(), accum_steps)` at `batch_size` is what is
    checked. Every run starts from the first model's initial weights, with the same
    seed, `shuffle=False`, on one device. Arguments are checked before any training.

    When a variable lands outside its limit, float32 alone cannot say which side is
    right: the float64 arbiter (`arbiter`) trains both again in float64 and clears a
    variable that differs from Keras' rounding, not from what Keras computes; when
    every variable over its limit is cleared the verdict is "exact-by-arbiter".

    Args:
        model_fn: a function returning a fresh Keras model (Keras 3, or a `tf_keras`
            model for Keras 2), the same architecture at every call. It may return it
            compiled: its `loss` is then used when `loss` is None, and its optimizer
            (a fresh copy from its config) when `optimizer_fn` is None.
        data: `(x, y)` or `(x, y, sample_weight)` of numpy arrays (`x` may be a dict
            or list of arrays), or a `tf.data.Dataset` of such batches (its first
            samples are taken, its batch is the default `batch_size`). At least
            `updates * accum_steps * batch_size` samples.
        optimizer_fn: a function returning a fresh optimizer (called once per run),
            or None: the optimizer `model_fn` compiled with.
        accum_steps: micro-batches per update, an integer >= 2.
        batch_size: the micro-batch. Default: the dataset's batch, or for arrays the
            largest up to 32 that gives `updates` updates.
        updates: optimizer updates trained each way (default 3).
        loss: the loss given to `compile` (default: the loss `model_fn` compiled with).
        compile_kwargs: more `compile` arguments for all three runs (`loss_weights`,
            `jit_compile`, ...). Default `jit_compile=False`; `jit_compile=True` checks
            the XLA-compiled step (Keras' "auto" on one GPU).
        accumulator_options: keyword arguments of `GradientAccumulator`
            (`merge_duplicate_rows`, ...), the fields of `WindowOptions` but
            `accum_steps`; checked before any training.
        tolerance: the absolute |Δw| always accepted (default 1e-5).
        floor_factor: a variable is exact when its Δ is at most
            `max(tolerance, floor_factor * floor)` (default 10).
        arbiter: "auto" (default): run the float64 arbiter when some variable is over
            its limit (not when active random layers explain it: their draws differ in
            float64 too); True: always; False: never (the float32 verdict alone). Two
            more trainings, in float64. Where float64 cannot be had (a Keras 2 model,
            mixed precision, layers that fix their dtype, ...) the report says why.
        arbiter_factor: the arbiter clears a variable when its accumulated run is at
            most `arbiter_factor` times as far from the float64 large batch as Keras'
            float32 large batch is (plus `ARBITER_SLACK`), default 2.
        seed: the seed set before each run (`keras.utils.set_random_seed`) and of the
            permutation.
        verbose: print a progress line per phase on stderr (they are logged anyway).

    Returns:
        An `ExactnessReport`: `exact`, `verdict`, per-variable deltas (by path) and
        kinds, the floor, the causes, the arbiter's finding; `print(report)` shows the
        table (each variable's `kind`: `VariableDelta`).

    Raises:
        TypeError: `model_fn`/`optimizer_fn` not callable, or a count not an integer.
        ValueError: a count, tolerance, `arbiter`, seed or option out of range; too few
            samples (all checked before any model is built: `check_arguments`).
    """
    return _check(check_arguments(
        model_fn, data, optimizer_fn, accum_steps, batch_size=batch_size, updates=updates, loss=loss,
        compile_kwargs=compile_kwargs, accumulator_options=accumulator_options, tolerance=tolerance,
        floor_factor=floor_factor, arbiter=arbiter, arbiter_factor=arbiter_factor, seed=seed, verbose=verbose))


def _check(args: CheckArguments) -> ExactnessReport:
    """`check_exact`'s work, on arguments `check_arguments` has checked: the three runs,
    their comparison, the arbiter where asked for, the report."""
    keras.utils.set_random_seed(args.seed)
    first = check_runs.build(args.model_fn, args.arrays[0], args.batch_size)
    initial = first.get_weights()
    new_optimizer = check_runs.optimizer_factory(args.optimizer_fn, first)
    compile_kwargs = {"jit_compile": False, **args.compile_kwargs, "loss": check_runs.loss_of(first, args.loss)}
    large, arrays, seed = args.accum_steps * args.batch_size, args.arrays, args.seed
    runs = check_runs.Runs(args.model_fn, new_optimizer, compile_kwargs, arrays, large, args.batch_size, seed,
                           args.accum_steps, args.options)
    progress = check_runs.Progress(args.verbose, 5 if args.arbiter is True else 3)

    progress(f"Keras' fit at batch {large}, {args.updates} updates (the reference)")
    reference = check_runs.train(args.model_fn, initial, new_optimizer(), compile_kwargs, arrays, large, seed, first)
    progress(f"Keras' fit at batch {large}, samples permuted inside each batch (the noise floor)")
    floor_model = check_runs.train(args.model_fn, initial, new_optimizer(), compile_kwargs,
                                   check_runs.permuted(arrays, large, seed), large, seed)
    progress(f"GradientAccumulator(accum_steps={args.accum_steps}) at batch {args.batch_size}")
    inner = new_optimizer()
    optimizer = GradientAccumulator(inner, options=args.options)
    accumulated = check_runs.train(args.model_fn, initial, optimizer, compile_kwargs, arrays, args.batch_size, seed)

    random_layers = check_compare.layers_that_draw(reference)
    norm_layers = [f"{layer.name} ({type(layer).__name__})" for layer in check_compare.batch_norm_layers(reference)]
    variables, floor, rule, indices = check_compare.compare(reference, floor_model, accumulated, initial, optimizer,
                                                            args.tolerance, args.floor_factor, random_layers)
    trained = (first, reference, accumulated, initial)
    variables, finding, why, rule = check_arbiter.arbitrate(args.arbiter, args.arbiter_factor, args.tolerance,
                                                            variables, indices, rule, random_layers, trained,
                                                            progress, runs)
    differing = [v for v in variables if v.differs]
    cleared = any(v.cleared for v in variables)
    verdict = "differs" if differing else "exact-by-arbiter" if cleared else "exact"
    settings = {"accum_steps": args.accum_steps, "batch_size": args.batch_size, "large_batch": large,
                "updates": args.updates, "samples": args.updates * large, "optimizer": type(inner).__name__,
                "keras": _keras_version(reference), "tolerance": args.tolerance, "floor_factor": args.floor_factor,
                "arbiter": args.arbiter, "arbiter_factor": args.arbiter_factor, **args.accumulator_options}
    merged = bool(args.accumulator_options.get("merge_duplicate_rows"))
    report = ExactnessReport(
        exact=not differing, verdict=verdict, variables=variables, floor=floor,
        rule=rule, kinds=sorted({v.kind for v in differing}, key=lambda k: (KINDS + (k,)).index(k)),
        random_layers=random_layers, causes=check_compare.causes_of(differing, random_layers, norm_layers, merged),
        settings=settings, arbiter=finding, arbiter_reason=why, arbiter_factor=args.arbiter_factor)
    logger.info("%s", report)
    return report


def _keras_version(model):
    """The version of `model`'s Keras."""
    package = flavours.keras_package_of(model) if flavours.is_keras2_object(model) else keras
    return getattr(package, "__version__", "?")


# --------------------------------------------------------------- the command
def load_target(spec: str) -> dict:
    """What `module:function` returns, as `check_exact`'s keyword arguments.

    Args:
        spec: `module:function`; the function returns `(model_fn, data, optimizer_fn)`
            or a dict of `check_exact`'s arguments.

    Returns:
        `check_exact`'s keyword arguments.

    Raises:
        ValueError: `spec` is not `module:function`, names no function, or the function
            returns neither form.
    """
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"Expected `module:function` (e.g. `my_models:exactness_setup`); received {spec!r}.")
    module_name, function_name = spec.split(":")
    function = getattr(importlib.import_module(module_name), function_name, None)
    if not callable(function):
        raise ValueError(f"{module_name} has no function {function_name!r}.")
    target = function()
    if isinstance(target, (tuple, list)) and len(target) == 3:
        target = dict(zip(("model_fn", "data", "optimizer_fn"), target))
    if not isinstance(target, dict) or "model_fn" not in target or "data" not in target:
        raise ValueError(
            f"{spec} must return (model_fn, data, optimizer_fn) or a dict of check_exact's arguments "
            f"with at least 'model_fn' and 'data'; it returned {type(target).__name__}.")
    return target



def _flag(name: str, convert: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse `type` for the flag `--name`: the text converted, then checked by
    `check_argument`, so a bad value is argparse's one-line error (exit status 2), before
    the target is even imported."""
    def parse(text):
        try:
            value = convert(text)
        except ValueError:
            value = text                              # check_argument says what is allowed
        try:
            return check_argument(name, value)
        except (TypeError, ValueError) as err:
            raise argparse.ArgumentTypeError(str(err)) from None
    parse.__name__ = name
    return parse


# The flags that take a value: name, type, what it is and allows, its default when the function gives none.
_FLAGS = (
    ("accum_steps", int, "micro-batches per update, an integer >= 2", DEFAULT_ACCUM_STEPS),
    ("batch_size", int, "the micro-batch, an integer >= 1",
     "the dataset's batch, or for arrays the largest up to 32 that gives --updates updates"),
    ("updates", int, "updates trained each way, an integer >= 1", DEFAULT_UPDATES),
    ("tolerance", float, "the |dw| always accepted, a positive number", f"{DEFAULT_TOLERANCE:g}"),
    ("floor_factor", float, "a variable's limit in multiples of its floor, a number >= 1",
     f"{DEFAULT_FLOOR_FACTOR:g}"),
    ("arbiter_factor", float, "the arbiter's factor over Keras' own distance from float64, a finite number >= 1",
     f"{DEFAULT_ARBITER_FACTOR:g}"),
    ("seed", int, "the seed of every run and of the permutation", 0),
)


def _parser() -> argparse.ArgumentParser:
    """The command line's flags, each with its default in its help."""
    parser = argparse.ArgumentParser(
        prog="python -m tfx_gradient_accumulator.accumulator.check",
        description="Train a few updates with Keras' large batch and with GradientAccumulator; report whether "
                    "the weights match. Exit status: 0 exact (or exact by the float64 arbiter), 1 not exact, "
                    "2 bad arguments. A flag overrides what the target returns.")
    parser.add_argument("target", help="module:function returning (model_fn, data, optimizer_fn) or a "
                                       "dict of check_exact's arguments")
    for name, convert, what, default in _FLAGS:
        parser.add_argument(f"--{name}", type=_flag(name, convert),
                            help=f"{what} (default: the function's, else {default})")
    parser.add_argument("--arbiter", dest="arbiter", action="store_const", const=True,
                        help="always run the float64 arbiter (default: off: the function's, else \"auto\": "
                             "run it when some variable is over its limit)")
    parser.add_argument("--no_arbiter", dest="arbiter", action="store_const", const=False,
                        help="never run the float64 arbiter: the float32 verdict alone (default: off; see "
                             "--arbiter)")
    parser.add_argument("--quiet", action="store_true", help="no progress lines (default: off)")
    return parser


def main(argv=None):
    """`python -m tfx_gradient_accumulator.accumulator.check module:function [--accum_steps N ...] [--arbiter]`.

    Prints the report. Every argument is checked before any model is built; a bad one
    ends in argparse's one-line error, without a traceback.

    Args:
        argv: the command line's arguments (None: `sys.argv[1:]`).

    Returns:
        The exit status: 0 when exact (or exact by the float64 arbiter), 1 when not.
        Bad arguments (a flag's value, the target, what it returns, too few samples)
        exit with status 2 (`SystemExit`), as argparse does.
    """
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        target = load_target(args.target)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    flags = {name: getattr(args, name) for name in [flag[0] for flag in _FLAGS] + ["arbiter"]}
    target.update({name: value for name, value in flags.items() if value is not None})
    if args.quiet:
        target["verbose"] = False
    try:
        bound = inspect.signature(check_exact).bind(**target)
        bound.apply_defaults()
        checked = check_arguments(**bound.arguments)
    except (TypeError, ValueError) as err:
        parser.error(f"{args.target}: {err}")
    report = _check(checked)
    print(report)
    return 0 if report.exact else 1

