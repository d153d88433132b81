"""What `check_exact` reports: `VariableDelta` per variable, `ExactnessReport` (its table),
and the defaults and constants its rule is written in.

Plain Python (no TensorFlow): the report is read by code (`components/exactness.py`
records it) and printed by the command line.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional

DEFAULT_ACCUM_STEPS = 4
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

