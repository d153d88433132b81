"""`micro_batch_size="auto"`'s record and rule, plain Python: what a change of the micro-batch
holds (`MicroBatchChange`), what the optimizer keeps across `fit`s (`AutoMicroBatch`), and
the next micro-batch after an out-of-memory error (`next_micro_batch`). The training that
uses them is `accumulator.batch.fit_auto_micro_batch` (its docstring gives the rule's reasons);
here so that the optimizer can read them without importing the training.
"""

from __future__ import annotations

import dataclasses
import math
from typing import List, Optional

AUTO = "auto"

__all__ = ["AUTO", "AutoMicroBatch", "MicroBatchChange", "next_micro_batch", "state_of"]


@dataclasses.dataclass(frozen=True)
class MicroBatchChange:
    """One change of `micro_batch_size="auto"`'s b: a batch whose step ran out of memory at
    the b in use, trained again at smaller ones until one fit.

    Attributes:
        update: the updates made before it (the optimizer's `iterations`): the batch trained
            at the new b is update `update`, counted from 0.
        micro_batch: b from here on.
        previous_micro_batch: b before it.
        effective_batch: E, the effective batch the splits are of (b = ceil(E / N)).
        out_of_memory_errors: the out-of-memory errors the batch took before it fit.
        seconds_lost: the seconds those failed steps took (the allocator's retries included).
        epoch: the epoch it happened in.
    """

    update: int
    micro_batch: int
    previous_micro_batch: int
    effective_batch: int
    out_of_memory_errors: int
    seconds_lost: float
    epoch: int

    def as_record(self) -> dict:
        """Every field, by name: what a run records of it (ML Metadata, TensorBoard)."""
        return dataclasses.asdict(self)


def next_micro_batch(failed: int, effective_batch: int, elements_per_sample: int,
                     elements_fit: Optional[int], replicas: int = 1) -> int:
    """The b to try after a step ran out of memory at b = `failed` (the module's rule, 3).

    Args:
        failed: the micro-batch that ran out of memory (>= 2).
        effective_batch: E; the result is ceil(E / N) for some N.
        elements_per_sample: s, the input elements of one sample of the batch that failed.
        elements_fit: the most input elements a micro-batch has trained in so far, or None
            (no step has fit yet: N doubles).
        replicas: R, the replicas in sync: `failed` and the result are global, multiples
            of R, each replica training b / R of its share ceil(E / R) (the rule applies
            to that share, and to `elements_fit` / R).

    Returns:
        The largest ceil(E / N) below `failed` whose micro-batch holds at most
        `elements_fit` elements (1 where none does); without `elements_fit`,
        ceil(E / 2N) for the N of `failed`. With `replicas` R, R times that of the
        replicas' share (R where nothing smaller fits).
    """
    if replicas > 1:
        share_fit = None if elements_fit is None else elements_fit // replicas
        return replicas * next_micro_batch(failed // replicas, -(-effective_batch // replicas),
                                           elements_per_sample, share_fit)
    splits = math.ceil(effective_batch / failed)
    if elements_fit is None:
        return max(1, math.ceil(effective_batch / (2 * splits)))
    for n in range(splits + 1, effective_batch + 1):
        candidate = math.ceil(effective_batch / n)
        if candidate < failed and candidate * elements_per_sample <= elements_fit:
            return candidate
    return 1


class AutoMicroBatch:
    """What "auto" knows across `fit`s (held by the optimizer): the b in use, the most input
    elements a step has fit in, the changes made, and the epoch `fit` is in."""

    def __init__(self):
        self.current: Optional[int] = None
        self.effective_batch: Optional[int] = None
        self.elements_fit: Optional[int] = None
        self.changes: List[MicroBatchChange] = []
        self.epoch = 0


def state_of(optimizer) -> AutoMicroBatch:
    """`optimizer`'s `AutoMicroBatch` (made on first use)."""
    state = getattr(optimizer, "_auto_micro_batch", None)
    if state is None:
        state = AutoMicroBatch()
        optimizer._untracked(_auto_micro_batch=state)
    return state
