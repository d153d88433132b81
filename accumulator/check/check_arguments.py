"""`check_exact`'s arguments checked, and its samples taken, before any training.

Every check names the parameter and the values allowed; the command line runs the same
checks on its flags (`check_argument`) and on its target's arguments (`check_arguments`)
before it builds a model, so a bad argument is one line and exit status 2.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any, Callable, Dict, Optional

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core.options import WindowOptions, integer_at_least

# The integer arguments and the smallest value each allows.
_LEAST = {"accum_steps": 2, "updates": 1, "batch_size": 1}
_SEEDS = 2 ** 32 - 1                  # numpy's seeds, and the permutation's seed + 1, stay below 2**32


def check_argument(name: str, value):
    """One of `check_exact`'s numbers, or `arbiter`, checked by its name.

    The one place each is checked: `check_arguments` calls it for a call of
    `check_exact`, the command line for each flag as it parses it.

    Args:
        name: "accum_steps", "updates", "batch_size", "tolerance", "floor_factor",
            "arbiter", "arbiter_factor" or "seed".
        value: the value given.

    Returns:
        The value as the check uses it (an int, a float, or `arbiter` as given).

    Raises:
        TypeError, ValueError: the value is not allowed; the message names the parameter
            and what it allows.
    """
    if name in _LEAST:
        return integer_at_least(value, name, minimum=_LEAST[name])
    if name == "seed":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value < _SEEDS:
            raise ValueError(f"`seed` must be an integer from 0 to {_SEEDS - 1}; received {value!r}.")
        return int(value)
    if name == "arbiter":
        if not (value is True or value is False or (isinstance(value, str) and value == "auto")):
            raise ValueError(
                "`arbiter` must be \"auto\" (run the float64 arbiter when some variable is over its limit), "
                f"True (always) or False (never); received {value!r}.")
        return value
    allowed = {"tolerance": "a positive number (1e-5, ...)", "floor_factor": "a number >= 1 (10, ...)",
               "arbiter_factor": "a finite number >= 1 (2, ...)"}[name]
    real = not isinstance(value, bool) and isinstance(value, numbers.Real)
    if not real or not value >= (0 if name == "tolerance" else 1) or (name == "tolerance" and not value > 0) or \
            (name == "arbiter_factor" and not np.isfinite(value)):
        raise ValueError(f"`{name}` must be {allowed}; received {value!r}.")
    return float(value)


@dataclasses.dataclass(frozen=True)
class CheckArguments:
    """`check_exact`'s arguments after `check_arguments`: every number checked, the
    accumulator's options made `options`, the micro-batch settled, and `arrays`, the
    `(x, y, sample_weight)` of the `updates * accum_steps * batch_size` samples trained on."""

    model_fn: Callable[[], Any]
    arrays: tuple
    optimizer_fn: Optional[Callable[[], Any]]
    accum_steps: int
    batch_size: int
    updates: int
    loss: Any
    compile_kwargs: Dict[str, Any]
    accumulator_options: Dict[str, Any]
    options: WindowOptions
    tolerance: float
    floor_factor: float
    arbiter: Any
    arbiter_factor: float
    seed: int
    verbose: bool


def check_arguments(model_fn, data, optimizer_fn, accum_steps, *, batch_size, updates, loss, compile_kwargs,
                    accumulator_options, tolerance, floor_factor, arbiter, arbiter_factor, seed,
                    verbose) -> CheckArguments:
    """`check_exact`'s arguments (the same names) checked before any model is built.

    Returns:
        A `CheckArguments`.

    Raises:
        TypeError, ValueError: the first argument that is not allowed, by name (the
            message says what is), or too few samples in `data`.
    """
    given = {"accum_steps": accum_steps, "updates": updates, "tolerance": tolerance, "floor_factor": floor_factor,
             "arbiter": arbiter, "arbiter_factor": arbiter_factor, "seed": seed,
             **({} if batch_size is None else {"batch_size": batch_size})}
    checked = {name: check_argument(name, value) for name, value in given.items()}
    accumulator_options = dict(accumulator_options or {})
    options = WindowOptions(accum_steps=checked["accum_steps"], **accumulator_options)
    if not callable(model_fn):
        raise TypeError(f"`model_fn` must be a function returning a Keras model; received {model_fn!r}.")
    if optimizer_fn is not None and not callable(optimizer_fn):
        raise TypeError("`optimizer_fn` must be a function that returns a fresh optimizer "
                        f"(e.g. `lambda: keras.optimizers.Adam(1e-3)`); received {optimizer_fn!r}.")
    x, y, weights, dataset_batch = split_data(data, batch_size, checked["accum_steps"], checked["updates"])
    checked["batch_size"] = resolve_batch(batch_size, dataset_batch, sample_count(x), checked["accum_steps"],
                                          checked["updates"])
    samples = checked["updates"] * checked["accum_steps"] * checked["batch_size"]
    arrays = tuple(take(a, slice(0, samples)) for a in (x, y, weights))
    return CheckArguments(model_fn=model_fn, arrays=arrays, optimizer_fn=optimizer_fn, loss=loss,
                          compile_kwargs=dict(compile_kwargs or {}), accumulator_options=accumulator_options,
                          options=options, verbose=bool(verbose), **checked)


def split_data(data, batch_size, accum_steps, updates):
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


def sample_count(x):
    """The number of samples in `x`'s first array."""
    return len(tf.nest.flatten(x)[0])


def take(structure, index):
    """`structure`'s arrays indexed by `index` (None stays None)."""
    return None if structure is None else tf.nest.map_structure(lambda a: np.asarray(a)[index], structure)


def resolve_batch(batch_size, dataset_batch, samples, accum_steps, updates):
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

