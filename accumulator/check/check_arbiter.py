"""The float64 arbiter: where a variable lands outside its limit, float32 alone cannot say
which side is right, so Keras' large batch and the accumulator train again in float64 and
a variable is cleared when the accumulator is about as close to exact arithmetic as
Keras' own float32 (`as_close_as_keras`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING

import keras
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import flavours, seam
from tfx_gradient_accumulator.accumulator.check.check_compare import distances, paths
from tfx_gradient_accumulator.accumulator.check.check_report import ARBITER_SLACK, DEFAULT_ARBITER_FACTOR
from tfx_gradient_accumulator.accumulator.check.check_runs import GradientAccumulator, is_model, take, train

if TYPE_CHECKING:
    from collections.abc import Iterator


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
    if not is_model(model):
        return f"model_fn returned {type(model).__name__} under the float64 policy, not a Keras model"
    variables = [f"{path} ({v.dtype})" for v, path in zip(model.weights, paths(model))
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
    `Runs`) says, or (None, why not)."""
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
                if is_model(model) and not model.weights:
                    model(take(arrays64[0], slice(0, runs.batch_size)))
                why = _not_float64(model)
                if why:
                    return None, why
                progress(f"GradientAccumulator(accum_steps={runs.accum_steps}) at batch {runs.batch_size} in "
                         "float64" if accumulate else f"Keras' fit at batch {runs.large} in float64 (the arbiter)")
                optimizer = runs.new_optimizer()
                if accumulate:
                    optimizer = GradientAccumulator(optimizer, options=runs.options)
                trained.append(train(runs.model_fn, initial64, optimizer, dict(runs.compile_kwargs, loss=loss),
                                      arrays64, runs.batch_size if accumulate else runs.large, runs.seed, model))
            except Exception as err:                  # noqa: BLE001 (any failure is the arbiter's answer)
                return None, f"training in float64 failed: {type(err).__name__}: {err}"
    return trained, None


def _judge(variables, indices, reference, accumulated, float64_runs, factor, tolerance):
    """The variables with the arbiter's distances, cleared where its rule holds; and its finding."""
    exact64 = float64_runs[0].get_weights()
    keras_to = distances(reference.get_weights(), exact64)
    accumulated_to = distances(accumulated.get_weights(), exact64)
    in_float64 = distances(float64_runs[1].get_weights(), exact64)
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


def arbitrate(arbiter, factor, tolerance, variables, indices, rule, random_layers, trained, progress, runs):
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

