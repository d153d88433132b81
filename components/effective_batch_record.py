"""`micro_batch_size`: what the run's micro-batches were, recorded on the model run.

With `AccumulatingTrainer(micro_batch_size=b)` every `fit` step trains one batch of the
effective batch E as micro-batches of b inside the step. b is the device's concern: with
an int it is the one given (at most E); with "auto" the run finds it, and changes it when a
step runs out of memory (`GradientAccumulator.micro_batch_changes`). Both are recorded where
the rest of the run's record is (ML Metadata on the `model` and `model_run` artifacts,
`record.json`, TensorBoard under `model_run/accumulation`), so a run shows the b it trained
with and every change, with the update it happened at.

Read from the run's wrappers after training, through their public properties
(`micro_batch_size`: the b in use, None before the first batch; `micro_batch_changes`:
the changes, each with `as_record()`), so a wrapper without changes records none.
"""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Optional, Sequence

import tensorflow as tf
from absl import logging

TAG = "accumulation/micro_batch_size_taken"


def _splitting_wrapper(optimizers: Iterable[Any]) -> Optional[Any]:
    """The first wrapper whose `fit` splits its batch (`micro_batch_size` set), or None."""
    for optimizer in optimizers:
        options = getattr(optimizer, "options", None)
        if getattr(options, "micro_batch_size", None) is not None:
            return optimizer
    return None


def changes(optimizers: Iterable[Any]) -> list:
    """Every change of b the run made ("auto"), in order: the first splitting wrapper's
    `micro_batch_changes` (none for an int b, or for a library without them)."""
    wrapper = _splitting_wrapper(optimizers)
    return list(getattr(wrapper, "micro_batch_changes", None) or []) if wrapper is not None else []


def micro_batch_in_use(settings, optimizers: Iterable[Any]) -> Optional[int]:
    """The b the run ended with: the wrapper's `micro_batch_size` where it reads an int (with
    "auto", None until a batch was trained), else the int the settings gave."""
    wrapper = _splitting_wrapper(optimizers)
    in_use = getattr(wrapper, "micro_batch_size", None) if wrapper is not None else None
    if isinstance(in_use, int) and not isinstance(in_use, bool):
        return in_use
    return settings.micro_batch if wrapper is not None else None


def first_micro_batch(settings, optimizers: Sequence[Any]) -> Optional[int]:
    """The b the run started with: the first change's previous one, or the b in use."""
    made = changes(optimizers)
    return made[0].previous_micro_batch if made else micro_batch_in_use(settings, optimizers)


def properties(settings, optimizers: Sequence[Any]) -> tuple[dict, dict]:
    """What is recorded (ML Metadata, TensorBoard) of the run's micro-batches.

    Args:
        settings: the run's `AccumulationSettings`.
        optimizers: the wrappers the run made.

    Returns:
        `(integers, strings)`, both empty without `micro_batch_size`: `micro_batch_size`
        (the b in use when training ended; 0 where no wrapper split its batch: the run_fn
        compiled its own accumulator), `micro_batches_per_update` (ceil(E / b)),
        `micro_batch_out_of_memory_errors` (summed over the changes); the string
        `micro_batch_changes`, a JSON list of each change's `as_record()` (`update`,
        `micro_batch`, `previous_micro_batch`, `effective_batch`, `out_of_memory_errors`,
        `seconds_lost`, `epoch`).
    """
    if not settings.splits_in_step:
        return {}, {}
    in_use = micro_batch_in_use(settings, optimizers)
    made = changes(optimizers)
    if _splitting_wrapper(optimizers) is None:
        logging.warning("micro_batch_size=%r: no optimizer the run_fn compiled splits its batch (it compiled "
                        "its own GradientAccumulator, which was kept); micro_batch_size is recorded as 0.",
                        settings.micro_batch_size)
    integers = {
        "micro_batch_size": in_use or 0,
        "micro_batches_per_update": math.ceil(settings.effective_batch_size / in_use) if in_use else 0,
        "micro_batch_out_of_memory_errors": sum(int(getattr(c, "out_of_memory_errors", 0)) for c in made),
    }
    return integers, {"micro_batch_changes": json.dumps([c.as_record() for c in made])}


def write_summaries(settings, optimizers: Sequence[Any]) -> None:
    """Writes `TAG` into the current TensorBoard writer: the first b at step 0, then each
    change's b at its update (nothing without `micro_batch_size`)."""
    if not settings.splits_in_step:
        return
    first = first_micro_batch(settings, optimizers)
    if first:
        tf.summary.scalar(TAG, first, step=0)
    for change in changes(optimizers):
        tf.summary.scalar(TAG, change.micro_batch, step=int(change.update))


def describe(settings, optimizers: Sequence[Any]) -> str:
    """One log line of the run's micro-batches ("" without `micro_batch_size`)."""
    if not settings.splits_in_step:
        return ""
    in_use, made = micro_batch_in_use(settings, optimizers), changes(optimizers)
    said = "; ".join(f"at update {c.update}: {c.previous_micro_batch} -> {c.micro_batch}" for c in made)
    return (f"Micro-batches of {in_use} inside each step (micro_batch_size={settings.micro_batch_size!r}, "
            f"effective batch {settings.effective_batch_size}); {len(made)} change(s){': ' if said else ''}{said}.")
