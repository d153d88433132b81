"""The gradient noise scale a run measured: read from its optimizers, recorded honestly.

With `measure_noise_scale=True` the Trainer records the final B_simple estimate
on the `model` and `model_run` artifacts and in TensorBoard, and only when it
means something: never a placeholder (`NoiseScaleReading` lists what is recorded).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Optional, Sequence

MEASURED = "measured"


@dataclasses.dataclass(frozen=True)
class NoiseScaleReading:
    """The final estimate of one run, as recorded.

    Attributes:
        status: "measured", or why there is no `noise_scale` (no window of two
            or more micro-batches; the smoothed |G|^2 not resolved from 0; the
            run_fn's own accumulator does not measure).
        noise_scale: B_simple in samples (the micro-batch weights of `fit`: a
            loss's denominator, or the batch's samples for a loss that returns
            one number per batch), the smoothed estimate when training ended;
            recorded only when measured (a finite, positive number).
        windows: the windows of two or more micro-batches it was estimated from
            (0: none closed, so no estimate).
        smoothing: the EMA decay over windows (None when not known).
        gradient_sq_norm: the smoothed |G|^2 (in the JSON reading only).
        trace: the smoothed tr(Sigma) (in the JSON reading only).
    """

    status: str
    noise_scale: float = float("nan")
    windows: int = 0
    smoothing: Optional[float] = None
    gradient_sq_norm: float = float("nan")
    trace: float = float("nan")

    @property
    def measured(self) -> bool:
        """True when `noise_scale` is a finite, positive estimate."""
        return self.status == MEASURED

    def as_dict(self) -> dict:
        """JSON-ready: NaN and infinities become None."""
        def clean(value):
            return value if isinstance(value, (int, str)) or value is None or math.isfinite(value) else None

        return {
            "noise_scale": clean(self.noise_scale) if self.measured else None,
            "noise_scale_windows": self.windows,
            "noise_scale_smoothing": self.smoothing,
            "noise_scale_status": self.status,
            "noise_scale_gradient_sq_norm": clean(self.gradient_sq_norm),
            "noise_scale_trace": clean(self.trace),
        }


def read(optimizers: Sequence, measure: bool) -> Optional[NoiseScaleReading]:
    """The estimate of the optimizer that measured the most windows.

    Args:
        optimizers: the `GradientAccumulator`s the run made (one per compiled
            model, usually one); on a tie the last one made wins (the model
            trained last).
        measure: whether the Trainer was asked to measure (`measure_noise_scale`).

    Returns:
        The reading (its `status` says why there is no estimate, if there is
        none), or None when not measuring.
    """
    if not measure:
        return None
    measuring = [o for o in optimizers if getattr(o, "measure_noise_scale", False)]
    if not measuring:
        return NoiseScaleReading(
            "not measured: the run_fn compiled its own GradientAccumulator without "
            "measure_noise_scale=True, which the component keeps as it is")
    best, best_windows = None, -1
    for optimizer in measuring:
        estimate = optimizer.noise_scale_estimate
        windows = 0 if estimate is None else int(estimate.window_count.numpy())
        if windows >= best_windows:
            best, best_windows = optimizer, windows
    smoothing = float(best.noise_scale_smoothing)
    if best_windows == 0:
        return NoiseScaleReading(
            "no estimate: no window of two or more micro-batches closed", smoothing=smoothing)
    estimate = best.noise_scale_estimate
    value = float(best.noise_scale)
    g2, trace = float(estimate.gradient_sq_norm.numpy()), float(estimate.trace.numpy())
    if math.isfinite(value) and value > 0:
        status = MEASURED
    else:
        status = (
            f"unresolved: after {best_windows} window(s) the smoothed |G|^2 ({g2:.3g}) and "
            f"tr(Sigma) ({trace:.3g}) give no positive ratio (windows far below the noise "
            "scale; train longer or raise noise_scale_smoothing)")
    return NoiseScaleReading(status, value, best_windows, smoothing, g2, trace)


def record(artifacts, reading: Optional[NoiseScaleReading]) -> None:
    """Sets the reading's custom properties on every artifact.

    `noise_scale_status` (string), `noise_scale_windows` (int),
    `noise_scale_smoothing` (float, when known) and `noise_scale` (float, only
    when measured).

    Args:
        artifacts: TFX artifacts (the `model` and `model_run` ones).
        reading: the run's reading; None: nothing is set.
    """
    if reading is None:
        return
    for artifact in artifacts:
        artifact.set_string_custom_property("noise_scale_status", reading.status)
        artifact.set_int_custom_property("noise_scale_windows", reading.windows)
        if reading.smoothing is not None:
            artifact.set_float_custom_property("noise_scale_smoothing", reading.smoothing)
        if reading.measured:
            artifact.set_float_custom_property("noise_scale", reading.noise_scale)


def write_summaries(reading: Optional[NoiseScaleReading], step: int) -> None:
    """Writes the reading to TensorBoard, inside the caller's default writer.

    `accumulation/noise_scale` (only when measured) and
    `accumulation/noise_scale_windows`, and the reading as JSON text
    (`accumulation/noise_scale_reading`).

    Args:
        reading: the run's reading; None: nothing is written.
        step: the summaries' step (the optimizer updates).
    """
    import tensorflow as tf

    if reading is None:
        return
    if reading.measured:
        tf.summary.scalar("accumulation/noise_scale", reading.noise_scale, step=step)
    tf.summary.scalar("accumulation/noise_scale_windows", reading.windows, step=step)
    tf.summary.text("accumulation/noise_scale_reading", json.dumps(reading.as_dict(), indent=1, sort_keys=True),
                    step=step)


def describe(reading: Optional[NoiseScaleReading], effective_batch_size: int | None = None) -> Optional[str]:
    """One log line for the reading.

    Args:
        reading: the run's reading (None when not measuring).
        effective_batch_size: the run's effective batch, shown beside the
            estimate when given.

    Returns:
        The line, or None when not measuring.
    """
    if reading is None:
        return None
    if not reading.measured:
        return f"Gradient noise scale: {reading.status}."
    line = (f"Gradient noise scale B_simple = {reading.noise_scale:.4g} samples, from "
            f"{reading.windows} window(s) (smoothing {reading.smoothing})")
    if effective_batch_size:
        line += f"; the effective batch was {effective_batch_size}"
    return line + "."
