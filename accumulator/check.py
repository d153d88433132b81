"""`check_exact`: does accumulation train *this* model like Keras' own large batch?

It trains the user's model three ways (Keras' large batch, the same with the samples
permuted inside each large batch: Keras' own rounding, and `GradientAccumulator` at the
micro-batch), reports max |Δw| per variable and says which differ and why; a float64
arbiter settles what float32 cannot. Command line:
`python -m tfx_gradient_accumulator.accumulator.check module:function` (see `main`).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import logging
import numbers
import sys
from typing import Any, Callable, Dict, List, Optional
from typing import TYPE_CHECKING

import keras
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import flavours, seam
from tfx_gradient_accumulator.accumulator.options import WindowOptions, integer_at_least

if TYPE_CHECKING:
    from collections.abc import Iterator

if flavours.keras_is_3():
    from tfx_gradient_accumulator.accumulator.optimizer import GradientAccumulator
else:
    from tfx_gradient_accumulator.accumulator.keras2 import GradientAccumulator

logger = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 1e-5
DEFAULT_FLOOR_FACTOR = 10.0
DEFAULT_UPDATES = 3
DEFAULT_ARBITER_FACTOR = 2.0
# The arbiter's absolute slack: about float32's resolution on weights of order 1, so that a
# variable Keras' float32 lands on exactly (distance 0) still allows the accumulator its
# last bit.
ARBITER_SLACK = 1e-7
ARBITER_CHOICES = ("auto", True, False)
KINDS = ("dense", "rows", "once-per-batch rows", "dense + rows", "dense + once-per-batch rows", "maximum",
         "batch-norm statistics", "non-trainable state")
# What makes a layer draw: a rate above 0 under one of these names (`stddev`: GaussianNoise only),
# or being an augmentation layer (Keras' preprocessing classes named Random..., and these).
_RATE_NAMES = ("rate", "dropout", "recurrent_dropout", "attention_dropout", "dropout_rate")
_AUGMENTATION_NAMES = ("RandAugment", "AugMix", "CutMix", "MixUp")


@dataclasses.dataclass(frozen=True)
class VariableDelta:
    """One model variable's result: `delta` = max |Δw| accumulation vs Keras' large batch,
    `floor` = the same for the permuted large batch (this variable's noise floor),
    `moved` = how far the large batch moved it from the initial weights, `limit` =
    `max(tolerance, floor_factor * floor)`, `differs` = `delta > limit` and the arbiter
    (when it ran) did not clear it.

    Where the float64 arbiter ran: `keras_to_float64` = max |Δw| of Keras' float32 large
    batch from Keras' float64 large batch (how far Keras' own rounding takes it from
    exact arithmetic), `accumulated_to_float64` = the same for the float32 accumulated
    run, `float64_delta` = the float64 accumulated run from the float64 large batch
    (~1e-12 where accumulation is exact in exact arithmetic), and `cleared` = over its
    limit, but within the arbiter's rule (`as_close_as_keras`, and `float64_delta` within
    the tolerance); None where the arbiter did not run.

    `kind` says where a difference comes from: "dense", "rows" (an embedding table's
    per-sample lookups), "once-per-batch rows" (a lookup whose ids do not depend on the
    sample, as a position table), "batch-norm statistics" (a plain
    `BatchNormalization`'s moving statistics, computed per micro-batch) or other
    non-trainable state (`KINDS`)."""

    path: str
    kind: str
    delta: float
    floor: float
    moved: float
    limit: float
    differs: bool
    keras_to_float64: Optional[float] = None
    accumulated_to_float64: Optional[float] = None
    float64_delta: Optional[float] = None
    cleared: Optional[bool] = None

    @property
    def over_limit(self) -> bool:
        """`delta > limit` in float32, whatever the arbiter said."""
        return self.delta > self.limit


@dataclasses.dataclass(frozen=True)
class ExactnessReport:
    """What `check_exact` found. `str(report)` is the table; the fields are for code.

    Attributes:
        exact: True when every variable's delta is within its limit, or when the float64
            arbiter ran and cleared each variable over its limit: about as far from exact
            arithmetic as Keras' own float32 large batch, by its rule (verdict
            "exact-by-arbiter").
        verdict: "exact" (every variable within its limit), "exact-by-arbiter" (some are
            not, and the arbiter cleared them: they differ from Keras' rounding, not from
            what Keras computes) or "differs".
        variables: a `VariableDelta` per model variable, in `model.weights` order.
        floor: the noise floor: max |Δw| of Keras' large batch against itself with the
            samples permuted inside each large batch (over all variables; each
            `VariableDelta` has its own).
        rule: how each variable's limit was set: `max(tolerance, floor_factor * its
            floor)`, or `tolerance` alone where the model has random layers (their
            draws move the floor too).
        kinds: the kinds of the variables that differ (a subset of `KINDS`).
        random_layers: the model's layers that draw in training, as "name (Class: why)"
            (a rate above 0, an augmentation layer, or a seed generator with no rate the
            check can read); a Dropout at rate 0 is not one.
        causes: readable explanations of what differs, and what to do; only causes the
            check verified for the variables that differ.
        settings: what was compared (accum_steps, batch sizes, updates, optimizer, ...).
        arbiter: what the float64 arbiter said: "not run" (off, or nothing to judge),
            "unavailable" (float64 cannot be had for this model: `arbiter_reason` says
            why), "as close as Keras" (every variable within its limit or cleared) or
            "real difference".
        arbiter_reason: the arbiter's finding or why it did not run, in words.
        arbiter_factor: the arbiter's factor: a variable over its limit is cleared when
            its accumulated float32 run is at most `arbiter_factor` times as far from the
            float64 large batch as Keras' float32 large batch is (plus `ARBITER_SLACK`),
            and the float64 accumulated run is within `tolerance` of the float64 large batch.
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
    arbiter: str = "not run"
    arbiter_reason: str = ""
    arbiter_factor: float = DEFAULT_ARBITER_FACTOR

    @property
    def max_delta(self) -> float:
        """The largest max |Δw| over the variables."""
        return max((v.delta for v in self.variables), default=0.0)

    @property
    def differing(self) -> List[VariableDelta]:
        """The variables that make the verdict "differs" (over their limit, not cleared)."""
        return [v for v in self.variables if v.differs]

    def report(self) -> str:
        """The table: one line per variable, then the rule, the arbiter and the verdict."""
        s = self.settings
        judged = any(v.keras_to_float64 is not None for v in self.variables)
        width = max([len("variable")] + [len(v.path) for v in self.variables])
        header = f"{'variable':<{width}}  {'kind':<21}  {'max |dw|':>9}  {'floor':>9}  {'limit':>9}  {'moved':>9}"
        lines = [
            f"check_exact: GradientAccumulator({s['optimizer']}, accum_steps={s['accum_steps']}) at batch "
            f"{s['batch_size']} against Keras' fit at batch {s['large_batch']}, {s['updates']} updates "
            f"({s['samples']} samples, Keras {s['keras']})",
            header + (f"  {'keras>f64':>9}  {'accum>f64':>9}  {'f64 accum':>9}" if judged else ""),
        ]
        for v in self.variables:
            mark = "  DIFFERS" if v.differs else "  cleared by the arbiter" if v.cleared else ""
            row = f"{v.path:<{width}}  {v.kind:<21}  {v.delta:9.2e}  {v.floor:9.2e}  {v.limit:9.2e}  {v.moved:9.2e}"
            if judged:
                row += f"  {v.keras_to_float64:9.2e}  {v.accumulated_to_float64:9.2e}  {v.float64_delta:9.2e}"
            lines.append(row + mark)
        lines.append(f"floor: Keras' batch {s['large_batch']} against itself with the samples permuted "
                     f"(max {self.floor:.2e}); limit: {self.rule}; moved: how far Keras' batch moved it")
        if self.random_layers:
            lines.append(f"random layers (they draw in training): {', '.join(self.random_layers)}")
        if judged:
            lines.append("arbiter: the same trainings in float64 from the same initial weights; keras>f64 and "
                         "accum>f64: Keras' float32 large batch and the float32 accumulated run from the "
                         "float64 large batch; f64 accum: the float64 accumulated run from it")
        if self.arbiter != "not run" or self.arbiter_reason:
            lines.append(f"arbiter: {self.arbiter.upper()}: {self.arbiter_reason}")
        if self.verdict == "exact":
            lines.append(f"verdict: EXACT (max |dw| {self.max_delta:.2e}, every variable within its limit)")
        elif self.verdict == "exact-by-arbiter":
            cleared = [v for v in self.variables if v.cleared]
            lines.append(f"verdict: EXACT BY ARBITER ({len(cleared)} of {len(self.variables)} variables over "
                         "their limit: they differ from Keras' float32 rounding, but are as close to exact "
                         "arithmetic as Keras is, by the arbiter's rule)")
        else:
            named = ", ".join(f"{v.path} ({v.kind})" for v in self.differing)
            lines.append(f"verdict: DIFFERS: {len(self.differing)} of {len(self.variables)} variables: {named}")
        lines.extend(f"- {cause}" for cause in self.causes)
        return "\n".join(lines)

    __str__ = report


# ------------------------------------------------------------------ arguments
def _validate_numbers(accum_steps, updates, batch_size, tolerance, floor_factor):
    """The counts and tolerances checked; errors name the parameter."""
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


def _validate_arbiter(arbiter, arbiter_factor):
    """`arbiter` and `arbiter_factor` checked."""
    if not (arbiter is True or arbiter is False or (isinstance(arbiter, str) and arbiter == "auto")):
        raise ValueError(
            "`arbiter` must be \"auto\" (run the float64 arbiter when some variable is over its limit), "
            f"True (always) or False (never); received {arbiter!r}.")
    if isinstance(arbiter_factor, bool) or not isinstance(arbiter_factor, numbers.Real) or \
            not arbiter_factor >= 1 or not np.isfinite(arbiter_factor):
        raise ValueError(f"`arbiter_factor` must be a finite number >= 1 (2, ...); received {arbiter_factor!r}.")
    return arbiter, float(arbiter_factor)


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
    """A dataset's batch size: static, else its first batch's."""
    leaf = tf.nest.flatten(dataset.element_spec)[0]
    if leaf.shape.rank and leaf.shape[0] is not None:
        return int(leaf.shape[0])
    first = tf.nest.flatten(next(iter(dataset.take(1))))[0]
    return int(first.shape[0])


def _samples(x):
    """The number of samples in `x`'s first array."""
    return len(tf.nest.flatten(x)[0])


def _take(structure, index):
    """`structure`'s arrays indexed by `index` (None stays None)."""
    return None if structure is None else tf.nest.map_structure(lambda a: np.asarray(a)[index], structure)


def _resolve_batch(batch_size, dataset_batch, samples, accum_steps, updates):
    """The micro-batch (given, the dataset's, or the largest up to 32 that fits); ValueError for too few samples."""
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
    """A fresh model from `model_fn`, built on a batch of `x`."""
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
    """Whether `model` is a Keras 3 or Keras 2 model."""
    if isinstance(model, keras.Model):
        return True
    return flavours.is_keras2_object(model) and isinstance(model, flavours.keras_package_of(model).Model)


def _optimizer_factory(optimizer_fn, model):
    """`optimizer_fn`, or fresh copies of the optimizer `model` was compiled with."""
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
    """The loss to compile with: `loss`, or the one `model` was compiled with."""
    if loss is None:
        loss = getattr(model, "loss", None) or None
    if loss is None:
        raise ValueError("No loss to train with: pass `loss=` (anything `Model.compile` takes), or "
                         "return a model compiled with its loss from `model_fn`.")
    return loss


# ---------------------------------------------------------------- the runs
@dataclasses.dataclass(frozen=True)
class _Runs:
    """What every training of one check shares (float32 and the arbiter's float64): the
    model and optimizer factories, the compile arguments, the samples, Keras' large batch
    and the micro-batch, the seed, and the accumulator's window."""

    model_fn: Callable[[], Any]
    new_optimizer: Callable[[], Any]
    compile_kwargs: Dict[str, Any]
    arrays: tuple
    large: int
    batch_size: int
    seed: int
    accum_steps: int
    options: WindowOptions


def _train(model_fn, initial, optimizer, compile_kwargs, arrays, batch_size, seed, first=None):
    """One of the runs: a model set to `initial`, compiled and fit one epoch without shuffling."""
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
    """The samples permuted inside each block of `block` samples (the noise floor's run)."""
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
    """The model's variables' paths (names in Keras 2)."""
    return [getattr(v, "path", None) or v.name for v in model.weights]


def _layer_of_variables(model):
    """{id(variable): the innermost layer holding it}."""
    owners = {}
    for layer in seam.flatten_layers(model):
        for variable in layer.weights:
            owners[id(variable)] = layer
    return owners


def _package_layer(model, name):
    """The layer class `name` of `model`'s Keras."""
    package = flavours.keras_package_of(model) if flavours.is_keras2_object(model) else keras
    return getattr(package.layers, name, None)


def _random_layers(model):
    """The layers that draw random numbers in training, each as "name (Class: why)".

    A layer draws only when a rate says so: `rate` (Dropout and its kin), `dropout` /
    `recurrent_dropout` (recurrent layers and cells, MultiHeadAttention, KerasHub's
    layers), `stddev` (GaussianNoise) above 0, or when it is a random augmentation layer
    (active in training). Owning a `SeedGenerator` is not enough: a GRU with both
    dropouts at 0 owns one and draws nothing, and calling it random would throw away the
    noise floor of a model whose weights match. A layer with a seed generator and no rate
    the check can read is counted as random, to be safe, and says so. Layers inside a
    layer already named are not named again (MultiHeadAttention's own Dropout)."""
    found = {}
    for layer in seam.flatten_layers(model):
        why = _draws(model, layer)
        if why is not None:
            found[id(layer)] = (layer, why)
    inner = {id(sub) for layer, _ in found.values() for sub in seam.flatten_layers(layer)}
    return [f"{layer.name} ({type(layer).__name__}: {why})" for key, (layer, why) in found.items()
            if key not in inner]


def _draws(model, layer):
    """Why `layer` draws random numbers in training (a few words), or None when it does not."""
    if any(c.__name__ in _AUGMENTATION_NAMES or c.__name__.startswith("Random") and
           "preprocessing" in c.__module__ for c in type(layer).__mro__):
        return "random augmentation, active in training"
    noise = _package_layer(model, "GaussianNoise")
    keys = _RATE_NAMES + (("stddev",) if noise is not None and isinstance(layer, noise) else ())
    rates = _readable_rates(layer, keys)
    positive = [f"{key}={value:g}" for key, value in rates.items() if value > 0]
    if positive:
        return ", ".join(positive)
    if rates:
        return None                                   # every rate it has is 0: it draws nothing
    generator = getattr(getattr(keras, "random", None), "SeedGenerator", None)     # Keras 3 only
    if getattr(layer, "seed_generator", None) is not None or generator is not None and any(
            isinstance(value, generator) for key, value in vars(layer).items() if not key.startswith("_")):
        return "owns a SeedGenerator and no rate the check can read: counted as random to be safe"
    return None


def _readable_rates(layer, keys):
    """{name: value} of the numeric rates `layer` shows, as attributes or in its config
    (MultiHeadAttention keeps its `dropout` only in its config)."""
    rates = {}
    try:
        config = layer.get_config()
    except Exception:                                 # noqa: BLE001 (a custom layer without a config)
        config = {}
    for key in keys:
        value = getattr(layer, key, None)
        value = config.get(key) if value is None and isinstance(config, dict) else value
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            rates[key] = float(value)
    return rates


def _norm_layers(model):
    """The model's plain batch normalization layers."""
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
    """What explains the variables that differ, only what the check can tell for them.

    Active random layers come alone: their draws move every variable downstream, so
    no other explanation (rows, a coupled loss, ...) can be told apart from them."""
    if not differing:
        return []
    kinds = {v.kind for v in differing}
    if random_layers:
        return [
            f"The model has random layers ({', '.join(random_layers)}): their draws differ between one "
            "batch and its micro-batches by design, so the weights cannot match; the noise floor is "
            "not used, and no other cause can be told apart from the draws. Check the model with their "
            "rates at 0 to see everything else."]
    causes = []
    if norm_layers:
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
    if not causes and kinds <= {"dense"}:
        causes.append("Dense variables differ: look for a loss or layer that couples the samples of a "
                      "batch (in-batch negatives: accumulator.GradientCache), or a custom train_step.")
    return causes


def _distances(weights_a, weights_b):
    """max |a - b| per variable (float64 arithmetic, so a float32 and a float64 run compare)."""
    return [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
            for a, b in zip(weights_a, weights_b)]


def _compare(reference, floor_model, accumulated, initial, optimizer, tolerance, floor_factor, random_layers):
    """(the `VariableDelta`s, the floor, the rule, their positions in `model.weights`)."""
    ref = reference.get_weights()
    deltas = _distances(accumulated.get_weights(), ref)
    floors = _distances(floor_model.get_weights(), ref)
    moved = _distances(ref, initial)
    limits = [float(tolerance) if random_layers else max(float(tolerance), floor_factor * f) for f in floors]
    kinds = _kinds(accumulated, optimizer)
    rows = [(i, VariableDelta(path, kind, d, f, m, limit, d > limit)) for i, (path, kind, d, f, m, limit)
            in enumerate(zip(_paths(reference), kinds, deltas, floors, moved, limits)) if kind is not None]
    rule = f"{tolerance:g} (random layers)" if random_layers else f"max({tolerance:g}, {floor_factor:g} x floor)"
    return [v for _, v in rows], max(floors, default=0.0), rule, [i for i, _ in rows]


# ---------------------------------------------------------------- the arbiter
@contextlib.contextmanager
def float64_policy() -> Iterator[None]:
    """Context: Keras' global dtype policy is float64 inside; restored on leaving, also on error.

    A model that a `model_fn` builds inside (layers that do not fix their own dtype) has
    float64 variables and computes in float64. Keras' `floatx` stays as it was: set to
    float64 it also makes Python integers int64 in Keras' ops, which breaks models that mix
    them with int32 shapes (KerasHub's T5 among them); what `floatx` still decides, a loss's
    dtype, `float64_loss` sets. The arbiter builds its models this way, and tests that
    judge by the arbiter use the same context (Keras 3 only: a Keras 2 model does not read
    Keras 3's policy)."""
    policy = keras.mixed_precision.global_policy()           # (keras.config's names came after 3.0)
    try:
        keras.mixed_precision.set_global_policy("float64")
        yield
    finally:
        keras.mixed_precision.set_global_policy(policy)


class _Float64Loss(keras.losses.Loss):
    """A loss function (a name's, or the user's) as `compile` wraps it, computing in float64:
    the one of predictions and targets with an extra last axis of 1 is squeezed first."""

    def __init__(self, fn):
        super().__init__(name=getattr(fn, "__name__", None), dtype="float64")
        self.fn = fn

    def call(self, y_true, y_pred):
        if len(y_true.shape) == len(y_pred.shape) + 1 and y_true.shape[-1] == 1:
            y_true = keras.ops.squeeze(y_true, -1)
        elif len(y_pred.shape) == len(y_true.shape) + 1 and y_pred.shape[-1] == 1:
            y_pred = keras.ops.squeeze(y_pred, -1)
        return self.fn(y_true, y_pred)


def float64_loss(loss):
    """`loss` as Keras `Loss` objects that compute in float64.

    A Keras loss casts the predictions to its own dtype, `floatx` (float32) unless told
    otherwise: left so, a float64 model's gradients would start from float32 rounding.

    Args:
        loss: what `compile` takes: a name, a function, a Keras `Loss`, or a dict or
            list of them.

    Returns:
        The same structure, of float64 `Loss` objects.

    Raises:
        ValueError: a loss cannot be rebuilt in float64 (a `Loss` subclass whose config
            or constructor takes no `dtype`); the message names it.
    """
    def rebuilt(item):
        if item is None:
            return None
        found = keras.losses.get(item) if isinstance(item, str) else item
        if not isinstance(found, keras.losses.Loss):
            if not callable(found):
                raise ValueError(f"the loss {item!r} is not a name, a function or a keras.losses.Loss")
            return _Float64Loss(found)
        try:
            copy = type(found).from_config({**found.get_config(), "dtype": "float64"})
        except Exception as err:                      # noqa: BLE001 (any custom loss; said below)
            raise ValueError(f"the loss {type(found).__name__} cannot be rebuilt from its config with "
                             f"dtype=\"float64\" ({type(err).__name__}: {err})") from err
        if str(copy.dtype) != "float64":
            raise ValueError(f"the loss {type(found).__name__} computes in {copy.dtype} even when "
                             "rebuilt with dtype=\"float64\"")
        return copy
    return tf.nest.map_structure(rebuilt, loss)


def to_float64(structure):
    """`structure` with its floating arrays cast to float64 (float32 values are exact in float64).

    Args:
        structure: arrays, dicts, lists, None.

    Returns:
        The same structure; the rest (integer ids, masks) unchanged.
    """
    def cast(leaf):
        if leaf is None:
            return None
        leaf = np.asarray(leaf)
        return leaf.astype(np.float64) if np.issubdtype(leaf.dtype, np.floating) else leaf
    return None if structure is None else tf.nest.map_structure(cast, structure)


def as_close_as_keras(accumulated_to_float64: float, keras_to_float64: float,
                      factor: float = DEFAULT_ARBITER_FACTOR) -> bool:
    """The arbiter's rule for one variable.

    Both float32 runs are the same training up to float32 rounding when the
    accumulated one is about as close to exact arithmetic as Keras' own: the
    accumulator's rounding then differs from Keras', not its arithmetic.

    Args:
        accumulated_to_float64: max |Δw| of the accumulated float32 run from Keras'
            float64 large batch.
        keras_to_float64: the same for Keras' float32 large batch.
        factor: how many times Keras' own distance is allowed.

    Returns:
        Whether `accumulated_to_float64 <= factor * keras_to_float64 + ARBITER_SLACK`.
    """
    return accumulated_to_float64 <= factor * keras_to_float64 + ARBITER_SLACK


def _floating(dtype):
    """Whether `dtype` is a floating type."""
    return str(getattr(dtype, "name", dtype)).startswith(("float", "bfloat"))


def _float64_unavailable(model):
    """Why the arbiter cannot retrain `model` (the first, float32 build) in float64, or None."""
    if flavours.is_keras2_object(model):
        return ("a Keras 2 model: the arbiter rebuilds the model under Keras 3's dtype policy, which a "
                "Keras 2 model does not read")
    other = [f"{layer.name} ({layer.dtype_policy.name})" for layer in [model] + seam.flatten_layers(model)
             if getattr(getattr(layer, "dtype_policy", None), "name", "float32") != "float32"]
    if other:
        return (f"the model does not compute in float32 ({', '.join(other[:3])}"
                f"{', ...' if len(other) > 3 else ''}): mixed precision or another dtype is not the "
                "float32 rounding the arbiter weighs against float64")
    return None


def _not_float64(model):
    """Why `model`, built by `model_fn` under `float64_policy`, does not train in float64, or None."""
    if not _is_model(model):
        return f"model_fn returned {type(model).__name__} under the float64 policy, not a Keras model"
    variables = [f"{path} ({v.dtype})" for v, path in zip(model.weights, _paths(model))
                 if _floating(v.dtype) and str(v.dtype) != "float64"]
    # An input layer keeps floatx: the first layer casts its (float32-exact) values to float64.
    layers = [f"{layer.name} ({layer.compute_dtype})" for layer in seam.flatten_layers(model)
              if not isinstance(layer, keras.layers.InputLayer)
              and _floating(getattr(layer, "compute_dtype", "float64")) and str(layer.compute_dtype) != "float64"]
    if not variables and not layers:
        return None
    named = (variables + layers)[:3]
    return (f"built under Keras' float64 policy, model_fn's model still holds or computes in another dtype "
            f"({', '.join(named)}{', ...' if len(variables + layers) > 3 else ''}): its layers fix their "
            "dtype (dtype=\"float32\" in their code or config, or a model cloned from a float32 model); "
            "build the model in model_fn without a fixed dtype for the arbiter to run")


def _float64_runs(runs, initial, progress, earlier=()):
    """([Keras' large batch, the accumulated run], None) trained in float64 as `runs` (a
    `_Runs`) says, or (None, why not)."""
    initial64, arrays64 = [to_float64(w) for w in initial], to_float64(runs.arrays)
    trained = []
    with float64_policy():
        try:
            loss = float64_loss(runs.compile_kwargs["loss"])
        except ValueError as err:
            return None, f"{err}: pass `loss=` as a name, a function or a Keras loss"
        for accumulate in (False, True):
            try:
                model = runs.model_fn()
                if any(model is seen for seen in earlier):
                    return None, ("model_fn returned a model it had returned before, not a fresh one: "
                                  "a model built once in float32 cannot be rebuilt in float64")
                if _is_model(model) and not model.weights:
                    model(_take(arrays64[0], slice(0, runs.batch_size)))
                why = _not_float64(model)
                if why:
                    return None, why
                progress(f"GradientAccumulator(accum_steps={runs.accum_steps}) at batch {runs.batch_size} in "
                         "float64" if accumulate else f"Keras' fit at batch {runs.large} in float64 (the arbiter)")
                optimizer = runs.new_optimizer()
                if accumulate:
                    optimizer = GradientAccumulator(optimizer, options=runs.options)
                trained.append(_train(runs.model_fn, initial64, optimizer, dict(runs.compile_kwargs, loss=loss),
                                      arrays64, runs.batch_size if accumulate else runs.large, runs.seed, model))
            except Exception as err:                  # noqa: BLE001 (any failure is the arbiter's answer)
                return None, f"training in float64 failed: {type(err).__name__}: {err}"
    return trained, None


def _judge(variables, indices, reference, accumulated, float64_runs, factor, tolerance):
    """The variables with the arbiter's distances, cleared where its rule holds; and its finding."""
    exact64 = float64_runs[0].get_weights()
    keras_to = _distances(reference.get_weights(), exact64)
    accumulated_to = _distances(accumulated.get_weights(), exact64)
    in_float64 = _distances(float64_runs[1].get_weights(), exact64)
    judged = []
    for v, i in zip(variables, indices):
        cleared = v.over_limit and as_close_as_keras(accumulated_to[i], keras_to[i], factor) and \
            in_float64[i] <= tolerance
        judged.append(dataclasses.replace(v, keras_to_float64=keras_to[i], accumulated_to_float64=accumulated_to[i],
                                          float64_delta=in_float64[i], cleared=cleared,
                                          differs=v.over_limit and not cleared))
    worst64 = max((v.float64_delta for v in judged), default=0.0)
    rule = (f"over its limit, a variable is cleared when its float32 accumulated run is at most {factor:g} x "
            f"as far from the float64 large batch as Keras' float32 large batch, + {ARBITER_SLACK:g}, and "
            f"in float64 the two runs agree within {tolerance:g}")
    real = [v for v in judged if v.differs]
    if not real:
        cleared = [v for v in judged if v.cleared]
        if not cleared:
            return judged, "as close as Keras", (
                f"every variable is within its limit; in float64 the accumulated run lands {worst64:.2e} "
                "from Keras' large batch")
        top = max(cleared, key=lambda v: v.accumulated_to_float64)
        return judged, "as close as Keras", (
            f"differs from Keras' rounding, but as close to exact arithmetic as Keras is: {len(cleared)} "
            f"variable(s) over their limit land within {factor:g} x Keras' own float32 distance from the "
            f"float64 large batch, + {ARBITER_SLACK:g} (farthest: {top.path} {top.accumulated_to_float64:.2e}, "
            f"Keras' {top.keras_to_float64:.2e}); in float64 the accumulated run lands {worst64:.2e} from "
            f"Keras' large batch ({rule})")
    named = []
    for v in real[:3]:
        if v.float64_delta > tolerance:
            named.append(f"{v.path}: {v.float64_delta:.2e} off in float64 too")
        else:
            named.append(f"{v.path}: {v.accumulated_to_float64:.2e} from float64, Keras' float32 "
                         f"{v.keras_to_float64:.2e}")
    return judged, "real difference", (
        f"a real difference, not rounding: {'; '.join(named)}{'; ...' if len(real) > 3 else ''} ({rule})")


def _arbitrate(arbiter, factor, tolerance, variables, indices, rule, random_layers, trained, progress, runs):
    """(variables, the arbiter's finding, its reason, the rule) after the float64 arbiter
    ran where `arbiter` asks for it; the float32 variables where it did not."""
    first, reference, accumulated, initial = trained
    over = any(v.over_limit for v in variables)
    if not (arbiter is True or (arbiter == "auto" and over and not random_layers)):
        if arbiter == "auto" and over:
            return variables, "not run", (
                "the random layers' draws differ between the large batch and its micro-batches by design, "
                "in float64 too (arbiter=True runs it anyway)"), rule
        return variables, "not run", "", rule
    progress.total = 5
    why = _float64_unavailable(first)
    in_float64 = None
    if why is None:
        in_float64, why = _float64_runs(runs, initial, progress, (first, reference, accumulated))
    if in_float64 is None:
        return variables, "unavailable", f"float64 cannot be had for this model: {why}", rule
    variables, finding, why = _judge(variables, indices, reference, accumulated, in_float64, factor, tolerance)
    return variables, finding, why, rule + f"; over it, the float64 arbiter (factor {factor:g})"


# ------------------------------------------------------------------- entry
def check_exact(model_fn: Callable[[], Any], data, optimizer_fn: Optional[Callable[[], Any]] = None,
                accum_steps: int = 4, *, batch_size: Optional[int] = None, updates: int = DEFAULT_UPDATES,
                loss=None, compile_kwargs: Optional[Dict[str, Any]] = None,
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
            `jit_compile`, ...). Default `jit_compile=False` (a sparse gradient needs
            `merge_duplicate_rows=True` under XLA).
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
        ValueError: a count, tolerance, `arbiter` or option out of range; too few samples.
    """
    accum_steps, updates, batch_size = _validate_numbers(accum_steps, updates, batch_size, tolerance, floor_factor)
    arbiter, arbiter_factor = _validate_arbiter(arbiter, arbiter_factor)
    accumulator_options = dict(accumulator_options or {})
    options = WindowOptions(accum_steps=accum_steps, **accumulator_options)       # checked before training
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
    large = accum_steps * batch_size
    runs = _Runs(model_fn, new_optimizer, compile_kwargs, arrays, large, batch_size, seed, accum_steps, options)
    progress = _Progress(verbose, 5 if arbiter is True else 3)

    progress(f"Keras' fit at batch {large}, {updates} updates (the reference)")
    reference = _train(model_fn, initial, new_optimizer(), compile_kwargs, arrays, large, seed, first)
    progress(f"Keras' fit at batch {large}, samples permuted inside each batch (the noise floor)")
    floor_model = _train(model_fn, initial, new_optimizer(), compile_kwargs, _permuted(arrays, large, seed),
                         large, seed)
    progress(f"GradientAccumulator(accum_steps={accum_steps}) at batch {batch_size}")
    inner = new_optimizer()
    optimizer = GradientAccumulator(inner, options=options)
    accumulated = _train(model_fn, initial, optimizer, compile_kwargs, arrays, batch_size, seed)

    random_layers = _random_layers(reference)
    norm_layers = [f"{layer.name} ({type(layer).__name__})" for layer in _norm_layers(reference)]
    variables, floor, rule, indices = _compare(reference, floor_model, accumulated, initial, optimizer,
                                               tolerance, floor_factor, random_layers)
    trained = (first, reference, accumulated, initial)
    variables, finding, why, rule = _arbitrate(arbiter, arbiter_factor, tolerance, variables, indices, rule,
                                               random_layers, trained, progress, runs)
    differing = [v for v in variables if v.differs]
    cleared = any(v.cleared for v in variables)
    verdict = "differs" if differing else "exact-by-arbiter" if cleared else "exact"
    settings = {"accum_steps": accum_steps, "batch_size": batch_size, "large_batch": large, "updates": updates,
                "samples": samples, "optimizer": type(inner).__name__, "keras": _keras_version(reference),
                "tolerance": float(tolerance), "floor_factor": float(floor_factor), "arbiter": arbiter,
                "arbiter_factor": arbiter_factor, **accumulator_options}
    report = ExactnessReport(
        exact=not differing, verdict=verdict, variables=variables, floor=floor,
        rule=rule, kinds=sorted({v.kind for v in differing}, key=lambda k: (KINDS + (k,)).index(k)),
        random_layers=random_layers, causes=_causes(differing, random_layers, norm_layers,
                                                     bool(accumulator_options.get("merge_duplicate_rows"))),
        settings=settings, arbiter=finding, arbiter_reason=why, arbiter_factor=arbiter_factor)
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


def main(argv=None):
    """`python -m tfx_gradient_accumulator.accumulator.check module:function [--accum_steps N ...] [--arbiter]`.

    Prints the report.

    Args:
        argv: the command line's arguments (None: `sys.argv[1:]`).

    Returns:
        The exit status: 0 when exact (or exact by the float64 arbiter), 1 when not
        (2: bad arguments).
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
    parser.add_argument("--arbiter", dest="arbiter", action="store_const", const=True,
                        help="always run the float64 arbiter (default: when some variable is over its limit)")
    parser.add_argument("--no_arbiter", dest="arbiter", action="store_const", const=False,
                        help="never run the float64 arbiter: the float32 verdict alone")
    parser.add_argument("--arbiter_factor", type=float,
                        help=f"the arbiter's factor over Keras' own distance from float64 "
                             f"(default {DEFAULT_ARBITER_FACTOR:g})")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--quiet", action="store_true", help="no progress lines")
    args = parser.parse_args(argv)
    try:
        target = load_target(args.target)
    except (ValueError, ImportError) as err:
        parser.error(str(err))
    flags = {name: getattr(args, name) for name in
             ("accum_steps", "batch_size", "updates", "tolerance", "floor_factor", "arbiter", "arbiter_factor",
              "seed")}
    target.update({name: value for name, value in flags.items() if value is not None})
    if args.quiet:
        target["verbose"] = False
    report = check_exact(**target)
    print(report)
    return 0 if report.exact else 1


if __name__ == "__main__":
    sys.exit(main())
