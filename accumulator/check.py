"""`check_exact`: does accumulation train *this* model like Keras' own large batch?

The library's promise is the large batch's weights. This module proves it, or
shows where it does not hold, on the user's own model, data and optimizer:

1. Keras' own `fit` at the large batch `accum_steps * batch_size` (the
   reference), `updates` updates, `shuffle=False`;
2. the same again with the samples permuted inside each large batch: in exact
   arithmetic the same training, so its distance from (1) is Keras' own
   rounding on this model (the noise floor);
3. `GradientAccumulator(optimizer_fn(), accum_steps)`, `fit` at `batch_size`,
   `shuffle=False`: the same samples in the same updates.

All three start from the same initial weights and the same random seed. For
every model variable (trainable or not, by its path) the check reports max |Δw|
between (3) and (1); a variable is exact when its Δ is at most
`max(tolerance, floor_factor * floor)`. Where it is not, the report says which
variables differ and of what kind: "dense", "rows" (an embedding table's
per-sample lookups), "once-per-batch rows" (a lookup whose ids do not depend on
the sample, such as a position table), "batch-norm statistics" (a plain
`BatchNormalization`'s moving mean and variance, computed per micro-batch) or
other non-trainable state; random layers (`Dropout`, `GaussianNoise`, ...) draw
differently at another batch size by design, and are named.

Command line: `python -m tfx_gradient_accumulator.accumulator.check module:function` (see `main`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import logging
import numbers
import sys
from typing import Any, Callable, Dict, List, Optional

import keras
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import seam
from tfx_gradient_accumulator.accumulator.validation import integer_at_least

if seam.keras_is_3():
    from tfx_gradient_accumulator.accumulator.optimizer import GradientAccumulator
else:
    from tfx_gradient_accumulator.accumulator.keras2 import GradientAccumulator

logger = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 1e-5
DEFAULT_FLOOR_FACTOR = 10.0
DEFAULT_UPDATES = 3
KINDS = ("dense", "rows", "once-per-batch rows", "dense + rows", "dense + once-per-batch rows", "maximum",
         "batch-norm statistics", "non-trainable state")
_RANDOM_LAYER_NAMES = ("Dropout", "GaussianNoise", "GaussianDropout", "AlphaDropout")


@dataclasses.dataclass(frozen=True)
class VariableDelta:
    """One model variable's result: `delta` = max |Δw| accumulation vs Keras' large batch,
    `floor` = the same for the permuted large batch (this variable's noise floor),
    `moved` = how far the large batch moved it from the initial weights, `limit` =
    `max(tolerance, floor_factor * floor)`, `differs` = `delta > limit`."""

    path: str
    kind: str
    delta: float
    floor: float
    moved: float
    limit: float
    differs: bool


@dataclasses.dataclass(frozen=True)
class ExactnessReport:
    """What `check_exact` found. `str(report)` is the table; the fields are for code.

    Attributes:
        exact: True when every variable's delta is within its limit.
        verdict: "exact" or "differs".
        variables: a `VariableDelta` per model variable, in `model.weights` order.
        floor: the noise floor: max |Δw| of Keras' large batch against itself with the
            samples permuted inside each large batch (over all variables; each
            `VariableDelta` has its own).
        rule: how each variable's limit was set: `max(tolerance, floor_factor * its
            floor)`, or `tolerance` alone where the model has random layers (their
            draws move the floor too).
        kinds: the kinds of the variables that differ (a subset of `KINDS`).
        random_layers: names of the model's random layers (Dropout, ...).
        causes: readable explanations of what differs, and what to do.
        settings: what was compared (accum_steps, batch sizes, updates, optimizer, ...).
    """

    exact: bool
    verdict: str
    variables: List[VariableDelta]
    floor: float
    rule: str
    kinds: List[str]
    random_layers: List[str]
    causes: List[str]
    settings: Dict[str, Any]

    @property
    def max_delta(self) -> float:
        return max((v.delta for v in self.variables), default=0.0)

    @property
    def differing(self) -> List[VariableDelta]:
        return [v for v in self.variables if v.differs]

    def report(self) -> str:
        """The table: one line per variable, then the rule and the verdict."""
        s = self.settings
        width = max([len("variable")] + [len(v.path) for v in self.variables])
        lines = [
            f"check_exact: GradientAccumulator({s['optimizer']}, accum_steps={s['accum_steps']}) at batch "
            f"{s['batch_size']} against Keras' fit at batch {s['large_batch']}, {s['updates']} updates "
            f"({s['samples']} samples, Keras {s['keras']})",
            f"{'variable':<{width}}  {'kind':<21}  {'max |dw|':>9}  {'floor':>9}  {'limit':>9}  {'moved':>9}",
        ]
        for v in self.variables:
            mark = "  DIFFERS" if v.differs else ""
            lines.append(f"{v.path:<{width}}  {v.kind:<21}  {v.delta:9.2e}  {v.floor:9.2e}  {v.limit:9.2e}  {v.moved:9.2e}{mark}")
        lines.append(f"floor: Keras' batch {s['large_batch']} against itself with the samples permuted "
                     f"(max {self.floor:.2e}); limit: {self.rule}; moved: how far Keras' batch moved it")
        if self.exact:
            lines.append(f"verdict: EXACT (max |dw| {self.max_delta:.2e}, every variable within its limit)")
        else:
            named = ", ".join(f"{v.path} ({v.kind})" for v in self.differing)
            lines.append(f"verdict: DIFFERS: {len(self.differing)} of {len(self.variables)} variables: {named}")
        lines.extend(f"- {cause}" for cause in self.causes)
        return "\n".join(lines)

    __str__ = report


# ------------------------------------------------------------------ arguments
def _validate_numbers(accum_steps, updates, batch_size, tolerance, floor_factor):
    accum_steps = integer_at_least(accum_steps, "accum_steps", minimum=2)
    updates = integer_at_least(updates, "updates")
    if batch_size is not None:
        batch_size = integer_at_least(batch_size, "batch_size")
    for name, value, low in (("tolerance", tolerance, 0.0), ("floor_factor", floor_factor, 1.0)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not value >= low or \
                (name == "tolerance" and not value > 0):
            allowed = "a positive number (1e-5, ...)" if name == "tolerance" else "a number >= 1"
            raise ValueError(f"`{name}` must be {allowed}; received {value!r}.")
    return accum_steps, updates, batch_size


def _split_data(data, batch_size, accum_steps, updates):
    """(x, y, sample_weight) as numpy structures, from a tuple or a batched tf.data.Dataset
    (its first samples: a repeated dataset is never read to its end), and the dataset's batch."""
    batch = None
    if isinstance(data, tf.data.Dataset):
        batch = _dataset_batch(data)
        needed = updates * accum_steps * (batch_size or batch)
        data = tuple(data.unbatch().take(needed).batch(needed).get_single_element())
        data = tf.nest.map_structure(lambda t: t.numpy(), data)
    if not isinstance(data, (tuple, list)) or len(data) not in (2, 3):
        raise ValueError(
            "`data` must be (x, y) or (x, y, sample_weight) of arrays (x may be a dict or list of "
            "arrays), or a tf.data.Dataset of such batches; received "
            f"{type(data).__name__}{'' if not isinstance(data, (tuple, list)) else f' of {len(data)}'}.")
    x, y, weights = (tuple(data) + (None,))[:3]
    return x, y, weights, batch


def _dataset_batch(dataset):
    leaf = tf.nest.flatten(dataset.element_spec)[0]
    if leaf.shape.rank and leaf.shape[0] is not None:
        return int(leaf.shape[0])
    first = tf.nest.flatten(next(iter(dataset.take(1))))[0]
    return int(first.shape[0])


def _samples(x):
    return len(tf.nest.flatten(x)[0])


def _take(structure, index):
    return None if structure is None else tf.nest.map_structure(lambda a: np.asarray(a)[index], structure)


def _resolve_batch(batch_size, dataset_batch, samples, accum_steps, updates):
    if batch_size is None:
        batch_size = dataset_batch or min(32, samples // (accum_steps * updates))
    needed = accum_steps * batch_size * updates
    if batch_size < 1 or samples < needed:
        raise ValueError(
            f"`data` holds {samples} samples; the check needs `updates` x `accum_steps` x `batch_size` = "
            f"{updates} x {accum_steps} x {batch_size or 1} = {updates * accum_steps * max(batch_size, 1)}. "
            "Pass more data, or lower `updates`, `accum_steps` or `batch_size`.")
    return batch_size


def _build(model_fn, x, batch_size):
    model = model_fn()
    if not _is_model(model):
        raise TypeError(
            "`model_fn` must return a Keras model (keras.Model, or a tf_keras.Model for Keras 2); "
            f"it returned {type(model).__name__}.")
    if not model.weights:
        model(_take(x, slice(0, batch_size)))          # a subclassed model builds on its first call
    if not model.weights:
        raise ValueError("The model `model_fn` returned has no weights to compare, even after a call.")
    return model


def _is_model(model):
    if isinstance(model, keras.Model):
        return True
    return seam.is_keras2_object(model) and isinstance(model, seam.keras_package_of(model).Model)


def _optimizer_factory(optimizer_fn, model):
    if optimizer_fn is not None:
        if not callable(optimizer_fn):
            raise TypeError("`optimizer_fn` must be a function that returns a fresh optimizer "
                            f"(e.g. `lambda: keras.optimizers.Adam(1e-3)`); received {optimizer_fn!r}.")
        return optimizer_fn
    compiled = getattr(model, "optimizer", None)
    compiled = getattr(compiled, "inner_optimizer", compiled) if isinstance(compiled, GradientAccumulator) \
        else compiled
    if compiled is None:
        raise ValueError("`optimizer_fn` is None and `model_fn`'s model is not compiled with an "
                         "optimizer: pass `optimizer_fn` (a function returning a fresh optimizer).")
    config, cls = compiled.get_config(), type(compiled)
    return lambda: cls.from_config(dict(config))


def _loss_of(model, loss):
    if loss is None:
        loss = getattr(model, "loss", None) or None
    if loss is None:
        raise ValueError("No loss to train with: pass `loss=` (anything `Model.compile` takes), or "
                         "return a model compiled with its loss from `model_fn`.")
    return loss


# ---------------------------------------------------------------- the runs
def _train(model_fn, initial, optimizer, compile_kwargs, arrays, batch_size, seed, first=None):
    keras.utils.set_random_seed(seed)
    model = first if first is not None else model_fn()
    if not model.weights:
        model(_take(arrays[0], slice(0, batch_size)))
    model.set_weights(initial)
    model.compile(optimizer=optimizer, **compile_kwargs)
    x, y, weights = arrays
    model.fit(x, y, sample_weight=weights, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    return model


def _permuted(arrays, block, seed):
    samples = _samples(arrays[0])
    rng = np.random.RandomState(seed + 1)
    index = np.concatenate([start + rng.permutation(block) for start in range(0, samples, block)])
    return tuple(_take(a, index) for a in arrays)


class _Progress:
    def __init__(self, verbose, total):
        self.verbose, self.total, self.step = verbose, total, 0

    def __call__(self, text):
        self.step += 1
        line = f"check_exact [{self.step}/{self.total}] {text}"
        logger.info(line)
        if self.verbose:
            print(line, file=sys.stderr, flush=True)


# ---------------------------------------------------------- classification
def _paths(model):
    return [getattr(v, "path", None) or v.name for v in model.weights]


def _layer_of_variables(model):
    """{id(variable): the innermost layer holding it}."""
    owners = {}
    for layer in seam.flatten_layers(model):
        for variable in layer.weights:
            owners[id(variable)] = layer
    return owners


def _package_layer(model, name):
    package = seam.keras_package_of(model) if seam.is_keras2_object(model) else keras
    return getattr(package.layers, name, None)


def _random_layers(model):
    classes = tuple(c for c in (_package_layer(model, n) for n in _RANDOM_LAYER_NAMES) if c is not None)
    found = []
    for layer in seam.flatten_layers(model):
        if getattr(layer, "rate", None) == 0:
            continue
        if isinstance(layer, classes) or getattr(layer, "seed_generator", None) is not None:
            found.append(f"{layer.name} ({type(layer).__name__})")
    return found


def _norm_layers(model):
    norm = _package_layer(model, "BatchNormalization")
    return [layer for layer in seam.flatten_layers(model) if norm is not None and isinstance(layer, norm)]


def _kinds(model, optimizer):
    """The kind of each of `model.weights` (list, in order); None for an
    `AccumBatchNormalization`'s window bookkeeping (not compared)."""
    gradient_kinds = getattr(optimizer, "gradient_kinds", None) or {}
    owners = _layer_of_variables(model)
    embedding = _package_layer(model, "Embedding")
    trainable = {id(v) for v in model.trainable_weights}
    statistics = {id(getattr(layer, name, None)) for layer in _norm_layers(model)
                  for name in ("moving_mean", "moving_variance")}
    kinds = []
    for variable, path in zip(model.weights, _paths(model)):
        layer = owners.get(id(variable))
        if id(variable) in statistics:
            kinds.append("batch-norm statistics")
        elif id(variable) not in trainable:
            kinds.append(None if layer in _norm_layers(model) else "non-trainable state")
        else:
            table = embedding is not None and isinstance(layer, embedding)
            kind = gradient_kinds.get(path, "dense")
            # A table whose rows the window merged (merge_duplicate_rows) is still a table of rows.
            kinds.append("rows" if table and kind == "dense" else kind)
    return kinds


def _causes(differing, random_layers, norm_layers, merged):
    kinds = {v.kind for v in differing}
    causes = []
    if random_layers:
        causes.append(
            f"The model has random layers ({', '.join(random_layers)}): their draws differ between one "
            "batch and its micro-batches by design, so the weights cannot match; the noise floor is "
            "not used. Check the model with their rates at 0 to see everything else.")
    if norm_layers and differing:
        causes.append(
            f"The model has batch normalization ({', '.join(norm_layers)}): in training each micro-batch is "
            "normalized with its own statistics (a forward pass sees one micro-batch), by design, so the "
            "weights after it cannot match the large batch's. A plain BatchNormalization's moving "
            "statistics also drift; accumulator.AccumBatchNormalization updates them with the effective "
            "batch's.")
    if merged and any("rows" in kind for kind in kinds):
        causes.append(
            "merge_duplicate_rows=True sums each id's rows before the optimizer: adaptive optimizers "
            "(Adam, RMSprop, ...) then see (g1 + g2)^2 where Keras' large batch applies its rows one by one. "
            "Leave it off (it is needed only under XLA).")
    elif any("rows" in kind for kind in kinds):
        causes.append(
            "Embedding rows differ from Keras' large batch: rows of a per-sample lookup must stay apart, "
            "rows of a lookup whose ids do not depend on the sample (a position table) must be summed "
            "across the window; the kind column says how the window held them.")
    if differing and not causes and kinds <= {"dense"}:
        causes.append("Dense variables differ: look for a loss or layer that couples the samples of a "
                      "batch (in-batch negatives: accumulator.GradientCache), or a custom train_step.")
    return causes


def _compare(reference, floor_model, accumulated, initial, optimizer, tolerance, floor_factor, random_layers):
    ref = reference.get_weights()
    deltas = [float(np.max(np.abs(a - r), initial=0.0)) for a, r in zip(accumulated.get_weights(), ref)]
    floors = [float(np.max(np.abs(f - r), initial=0.0)) for f, r in zip(floor_model.get_weights(), ref)]
    moved = [float(np.max(np.abs(r - np.asarray(i)), initial=0.0)) for r, i in zip(ref, initial)]
    limits = [float(tolerance) if random_layers else max(float(tolerance), floor_factor * f) for f in floors]
    kinds = _kinds(accumulated, optimizer)
    variables = [VariableDelta(path, kind, d, f, m, limit, d > limit)
                 for path, kind, d, f, m, limit in zip(_paths(reference), kinds, deltas, floors, moved, limits)
                 if kind is not None]
    rule = f"{tolerance:g} (random layers)" if random_layers else f"max({tolerance:g}, {floor_factor:g} x floor)"
    return variables, max(floors, default=0.0), rule


# ------------------------------------------------------------------- entry
def check_exact(model_fn: Callable[[], Any], data, optimizer_fn: Optional[Callable[[], Any]] = None,
                accum_steps: int = 4, *, batch_size: Optional[int] = None, updates: int = DEFAULT_UPDATES,
                loss=None, compile_kwargs: Optional[Dict[str, Any]] = None,
                accumulator_options: Optional[Dict[str, Any]] = None, tolerance: float = DEFAULT_TOLERANCE,
                floor_factor: float = DEFAULT_FLOOR_FACTOR, seed: int = 0, verbose: bool = True) -> ExactnessReport:
    """Trains `updates` updates three ways and reports whether accumulation matched Keras.

    Keras' own `fit` at batch `accum_steps * batch_size` is the reference; the same
    with the samples permuted inside each large batch gives the noise floor;
    `GradientAccumulator(optimizer_fn(), accum_steps)` at `batch_size` is what is
    checked. Every run starts from the first model's initial weights, with the same
    seed, `shuffle=False`, on one device. Arguments are checked before any training.

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
            `jit_compile`, ...). Default `jit_compile=False` (a sparse gradient needs
            `merge_duplicate_rows=True` under XLA).
        accumulator_options: keyword arguments of `GradientAccumulator`
            (`merge_duplicate_rows`, ...).
        tolerance: the absolute |Δw| always accepted (default 1e-5).
        floor_factor: a variable is exact when its Δ is at most
            `max(tolerance, floor_factor * floor)` (default 10).
        seed: the seed set before each run (`keras.utils.set_random_seed`) and of the
            permutation.
        verbose: print a progress line per phase on stderr (they are logged anyway).

    Returns:
        An `ExactnessReport`: `exact`, `verdict`, per-variable deltas (by path) and
        kinds, the floor, the causes; `print(report)` shows the table.
    """
    accum_steps, updates, batch_size = _validate_numbers(accum_steps, updates, batch_size, tolerance, floor_factor)
    if not callable(model_fn):
        raise TypeError(f"`model_fn` must be a function returning a Keras model; received {model_fn!r}.")
    x, y, weights, dataset_batch = _split_data(data, batch_size, accum_steps, updates)
    batch_size = _resolve_batch(batch_size, dataset_batch, _samples(x), accum_steps, updates)
    samples = updates * accum_steps * batch_size
    arrays = tuple(_take(a, slice(0, samples)) for a in (x, y, weights))
    keras.utils.set_random_seed(seed)
    first = _build(model_fn, arrays[0], batch_size)
    initial = first.get_weights()
    new_optimizer = _optimizer_factory(optimizer_fn, first)
    compile_kwargs = {"jit_compile": False, **(compile_kwargs or {}), "loss": _loss_of(first, loss)}
    accumulator_options = dict(accumulator_options or {})
    large = accum_steps * batch_size
    progress = _Progress(verbose, 3)

    progress(f"Keras' fit at batch {large}, {updates} updates (the reference)")
    reference = _train(model_fn, initial, new_optimizer(), compile_kwargs, arrays, large, seed, first)
    progress(f"Keras' fit at batch {large}, samples permuted inside each batch (the noise floor)")
    floor_model = _train(model_fn, initial, new_optimizer(), compile_kwargs, _permuted(arrays, large, seed),
                         large, seed)
    progress(f"GradientAccumulator(accum_steps={accum_steps}) at batch {batch_size}")
    inner = new_optimizer()
    optimizer = GradientAccumulator(inner, accum_steps, **accumulator_options)
    accumulated = _train(model_fn, initial, optimizer, compile_kwargs, arrays, batch_size, seed)

    random_layers = _random_layers(reference)
    norm_layers = [f"{layer.name} ({type(layer).__name__})" for layer in _norm_layers(reference)]
    variables, floor, rule = _compare(reference, floor_model, accumulated, initial, optimizer,
                                           tolerance, floor_factor, random_layers)
    differing = [v for v in variables if v.differs]
    settings = {"accum_steps": accum_steps, "batch_size": batch_size, "large_batch": large, "updates": updates,
                "samples": samples, "optimizer": type(inner).__name__, "keras": _keras_version(reference),
                "tolerance": float(tolerance), "floor_factor": float(floor_factor), **accumulator_options}
    report = ExactnessReport(
        exact=not differing, verdict="differs" if differing else "exact", variables=variables, floor=floor,
        rule=rule, kinds=sorted({v.kind for v in differing}, key=lambda k: (KINDS + (k,)).index(k)),
        random_layers=random_layers, causes=_causes(differing, random_layers, norm_layers,
                                                     bool(accumulator_options.get("merge_duplicate_rows"))), settings=settings)
    logger.info("%s", report)
    return report


def _keras_version(model):
    package = seam.keras_package_of(model) if seam.is_keras2_object(model) else keras
    return getattr(package, "__version__", "?")


# --------------------------------------------------------------- the command
def load_target(spec):
    """What `module:function` returns, as `check_exact`'s keyword arguments."""
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


def main(argv=None):
    """`python -m tfx_gradient_accumulator.accumulator.check module:function [--accum_steps N --batch_size B --updates K]`.

    Prints the report; exit status 0 when exact, 1 when not (2: bad arguments).
    """
    parser = argparse.ArgumentParser(
        prog="python -m tfx_gradient_accumulator.accumulator.check",
        description="Train a few updates with Keras' large batch and with GradientAccumulator; "
                    "report whether the weights match.")
    parser.add_argument("target", help="module:function returning (model_fn, data, optimizer_fn) or a "
                                       "dict of check_exact's arguments")
    parser.add_argument("--accum_steps", type=int, help="micro-batches per update (default: the "
                                                        "function's, else 4)")
    parser.add_argument("--batch_size", type=int, help="the micro-batch")
    parser.add_argument("--updates", type=int, help=f"updates trained each way (default {DEFAULT_UPDATES})")
    parser.add_argument("--tolerance", type=float, help=f"always accepted |dw| (default {DEFAULT_TOLERANCE})")
    parser.add_argument("--floor_factor", type=float, help=f"multiple of the floor (default {DEFAULT_FLOOR_FACTOR})")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    try:
        target = load_target(args.target)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    flags = {name: getattr(args, name) for name in
             ("accum_steps", "batch_size", "updates", "tolerance", "floor_factor", "seed")}
    target.update({name: value for name, value in flags.items() if value is not None})
    if args.quiet:
        target["verbose"] = False
    report = check_exact(**target)
    print(report)
    return 0 if report.exact else 1


if __name__ == "__main__":
    sys.exit(main())
