"""How `check_exact` compares the runs: max |Δw| per variable against its noise floor, each
variable's kind, the layers that draw random numbers, and the causes it can name.
"""

from __future__ import annotations

import numbers

import keras
import numpy as np

from tfx_gradient_accumulator.accumulator.core import flavours, seam
from tfx_gradient_accumulator.accumulator.check.check_report import VariableDelta

# What makes a layer draw: a rate above 0 under one of these names (`stddev`: GaussianNoise only),
# or being an augmentation layer (Keras' preprocessing classes named Random..., and these).
_RATE_NAMES = ("rate", "dropout", "recurrent_dropout", "attention_dropout", "dropout_rate")
_AUGMENTATION_NAMES = ("RandAugment", "AugMix", "CutMix", "MixUp")


def paths(model):
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


def layers_that_draw(model):
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


def batch_norm_layers(model):
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
    statistics = {id(getattr(layer, name, None)) for layer in batch_norm_layers(model)
                  for name in ("moving_mean", "moving_variance")}
    kinds = []
    for variable, path in zip(model.weights, paths(model)):
        layer = owners.get(id(variable))
        if id(variable) in statistics:
            kinds.append("batch-norm statistics")
        elif id(variable) not in trainable:
            kinds.append(None if layer in batch_norm_layers(model) else "non-trainable state")
        else:
            table = embedding is not None and isinstance(layer, embedding)
            kind = gradient_kinds.get(path, "dense")
            # A table whose rows the window merged (merge_duplicate_rows) is still a table of rows.
            kinds.append("rows" if table and kind == "dense" else kind)
    return kinds


def causes_of(differing, random_layers, norm_layers, merged):
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


def distances(weights_a, weights_b):
    """max |a - b| per variable (float64 arithmetic, so a float32 and a float64 run compare)."""
    return [float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)), initial=0.0))
            for a, b in zip(weights_a, weights_b)]


def compare(reference, floor_model, accumulated, initial, optimizer, tolerance, floor_factor, random_layers):
    """(the `VariableDelta`s, the floor, the rule, their positions in `model.weights`)."""
    ref = reference.get_weights()
    deltas = distances(accumulated.get_weights(), ref)
    floors = distances(floor_model.get_weights(), ref)
    moved = distances(ref, initial)
    limits = [float(tolerance) if random_layers else max(float(tolerance), floor_factor * f) for f in floors]
    kinds = _kinds(accumulated, optimizer)
    rows = [(i, VariableDelta(path, kind, d, f, m, limit, d > limit)) for i, (path, kind, d, f, m, limit)
            in enumerate(zip(paths(reference), kinds, deltas, floors, moved, limits)) if kind is not None]
    rule = f"{tolerance:g} (random layers)" if random_layers else f"max({tolerance:g}, {floor_factor:g} x floor)"
    return [v for _, v in rows], max(floors, default=0.0), rule, [i for i, _ in rows]

