"""`accum_steps="fit"`: the Trainer's training survives an out-of-memory error, exactly.

`micro_batch_fit.settle` finds the micro-batch b on one batch of the run_fn's data; later
data can need more (longer sequences, larger images, a fragmented allocator). Here the
run_fn's own `model.fit(...)` goes through `accumulator.fit_with_out_of_memory_recovery`
(`run_fn_swaps.fits_routed`): on a `ResourceExhaustedError` in a training step the open
window is dropped, b halves and N doubles, the window is trained again from its first
sample, and the weights are those of the run without the error. The run_fn is unchanged:
its dataset of micro-batches is read again as batches of the effective batch E
(`dataset.unbatch().batch(E)`: the same samples in the same order) and its
`steps_per_epoch` (micro-steps) becomes windows (`steps_per_epoch / N`).

Where it cannot be exact the run trains at the found b as before, and the record says why
(`out_of_memory_recovery`: "off: ..."): a cluster (every worker would have to switch at the
same update, which needs a collective the driver does not make), several replicas (the
driver trains on one device), `backup_dir` (a `TrainingBackup` resumes by fit steps, which
a switch changes), and a `fit` the driver cannot read as windows of E (arrays, a
`class_weight`, `steps_per_epoch` that is not a multiple of N, examples of varying shapes).
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any, List, Optional

import tensorflow as tf
from absl import logging

from tfx_gradient_accumulator.accumulator.batch.out_of_memory import fit_with_out_of_memory_recovery

ON = "on"
# `fit`'s arguments the driver takes as they are; those not here must keep their defaults.
_PASSED_ON = ("epochs", "verbose", "callbacks", "validation_data", "validation_freq", "initial_epoch",
              "validation_steps")
_IGNORED_FOR_DATASETS = ("shuffle", "validation_batch_size")     # Keras ignores them for a dataset
_LEFT_UNSET = ("y", "batch_size", "validation_split", "class_weight", "sample_weight")   # None, or 0.0


@dataclasses.dataclass
class Recovery:
    """The run's recovery: what the next `fit` starts from, and what every `fit` switched.

    Attributes:
        found: the `MicroBatchFit` the next `fit` trains at (after a switch: the smaller one).
        switches: every `MicroBatchSwitch`, in order, over all the run_fn's `fit`s.
        off: None while the recovery is on; else why a `fit` trained without it.
    """

    found: Any
    switches: List[Any] = dataclasses.field(default_factory=list)
    off: Optional[str] = None

    def fit(self, original, model, arguments: dict):
        """The run_fn's `model.fit(**arguments)`, through the recovery driver, or through
        `original` (the `fit` it replaced) when it cannot be exact, logged and recorded.

        Returns:
            What `fit` returns: a `keras.callbacks.History`.
        """
        steps_per_epoch, reason = _windows_per_epoch(arguments, self.found.accum_steps)
        reason = reason or _not_windows_of_e(arguments)
        if reason is not None:
            self._turn_off(f"off: this fit {reason}")
            return original(model, **arguments)
        data = arguments["x"].unbatch().batch(self.found.effective_batch_size)
        passed = {k: arguments[k] for k in _PASSED_ON}
        if isinstance(passed["verbose"], bool):       # `fit` takes True and False as 1 and 0
            passed["verbose"] = int(passed["verbose"])
        run = fit_with_out_of_memory_recovery(model, data, self.found, steps_per_epoch=steps_per_epoch, **passed)
        self.switches += run.switches
        if run.switches:
            self.found = dataclasses.replace(self.found, micro_batch=run.micro_batch, accum_steps=run.accum_steps)
        return run.history

    def _turn_off(self, reason):
        logging.warning("accum_steps='fit': the out-of-memory recovery is %s; it trains at the found "
                        "micro-batch %d x %d without it.", reason, self.found.micro_batch, self.found.accum_steps)
        self.off = self.off or reason


def recovery_for(settings, strategy, workers: int, backup) -> Optional[Recovery]:
    """The run's `Recovery` with `accum_steps="fit"`; None without it.

    Args:
        settings: the settled `AccumulationSettings` (`fitted`: what the probe found).
        strategy: the executor's strategy.
        workers: the processes that train.
        backup: the run's `TrainingBackup`, or None.

    Returns:
        A `Recovery`, off (with its reason, logged) where it could not be exact.
    """
    if not settings.fit_to_device:
        return None
    recovery = Recovery(settings.fitted)
    if workers > 1:
        recovery._turn_off(f"off: a cluster of {workers} workers (every worker would have to switch at the "
                           "same update)")
    elif strategy.num_replicas_in_sync > 1:
        recovery._turn_off(f"off: {strategy.num_replicas_in_sync} replicas (it trains on one device)")
    elif backup is not None:
        recovery._turn_off("off: backup_dir is set (a backup resumes by fit steps, which a switch changes)")
    return recovery


def route(recovery: Optional[Recovery]):
    """What `run_fn_swaps.fits_routed` routes the run_fn's `fit`s to: `recovery.fit`, or
    None (no change) without a recovery or with one that is off."""
    return None if recovery is None or recovery.off else recovery.fit


def properties(recovery: Optional[Recovery]) -> tuple[dict, dict]:
    """What is recorded (ML Metadata, TensorBoard) of the recovery.

    Args:
        recovery: the run's `Recovery` after training, or None.

    Returns:
        `(integers, strings)`: `out_of_memory_recovery` ("on", or "off: why");
        `micro_batch_switches`, a JSON list of `{"update", "micro_batch", "accum_steps",
        "previous_micro_batch", "previous_accum_steps", "epoch", "dropped"}` (`update`:
        the first update trained at the new micro-batch, counted from 0); and after a
        switch `final_micro_batch_size`, `final_accum_steps`. Both empty without "fit".
    """
    if recovery is None:
        return {}, {}
    strings = {"out_of_memory_recovery": recovery.off or ON,
               "micro_batch_switches": json.dumps([dataclasses.asdict(s) for s in recovery.switches])}
    integers = {}
    if recovery.switches:
        integers = {"final_micro_batch_size": recovery.found.micro_batch,
                    "final_accum_steps": recovery.found.accum_steps}
    return integers, strings


def describe(recovery: Optional[Recovery]) -> str:
    """One log line of what the recovery did ("" without "fit")."""
    if recovery is None:
        return ""
    if recovery.off:
        return f"Out-of-memory recovery {recovery.off}."
    switched = "; ".join(f"at update {s.update}: micro-batch {s.previous_micro_batch} x {s.previous_accum_steps} "
                         f"-> {s.micro_batch} x {s.accum_steps}" for s in recovery.switches)
    return f"Out-of-memory recovery on: {len(recovery.switches)} switch(es){': ' if switched else ''}{switched}."


def _windows_per_epoch(arguments, accum_steps):
    """`(steps_per_epoch in windows of E, None)`, or `(None, why not)`."""
    steps = arguments.get("steps_per_epoch")
    if steps is None:
        return None, None
    if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps % accum_steps:
        return None, (f"has steps_per_epoch={steps!r}, not a multiple of the {accum_steps} micro-steps of an "
                      "update (whole windows of the effective batch)")
    return int(steps) // accum_steps, None


def _not_windows_of_e(arguments) -> Optional[str]:
    """Why `fit`'s data cannot be read again as batches of E; None when it can."""
    x = arguments.get("x")
    if not isinstance(x, tf.data.Dataset):
        return f"trains on {type(x).__name__}, not a tf.data.Dataset of micro-batches"
    changed = sorted(k for k in _LEFT_UNSET if not _unset(arguments.get(k)))
    if changed:
        return f"sets {', '.join(changed)}"
    unknown = sorted(set(arguments) - set(_PASSED_ON) - set(_IGNORED_FOR_DATASETS) - set(_LEFT_UNSET)
                     - {"x", "steps_per_epoch"})
    if unknown:
        return f"sets arguments the recovery does not know ({', '.join(unknown)})"
    shapes = [spec.shape[1:] for spec in tf.nest.flatten(x.element_spec) if isinstance(spec, tf.TensorSpec)]
    if any(not shape.is_fully_defined() for shape in shapes):
        return "has examples of varying shapes (they cannot be batched again at the effective batch)"
    return None


def _unset(value) -> bool:
    """Whether a `fit` argument is left at its default (None, or 0.0 for `validation_split`)."""
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0)
