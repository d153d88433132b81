"""What an `AccumulationWindow` shows: its options, its state's readings, its listeners.

`WindowReadings`, mixed into `AccumulationWindow`: the options as read-only properties
(fixed at construction: a traced train step cannot switch paths later) and what the
window's state (`self._state`, a `window.state.WindowState`) holds, read eagerly.
"""

from __future__ import annotations

import tensorflow as tf


class WindowReadings:
    """What an `AccumulationWindow` shows of its options and its state (`self._state`, a `WindowState`)."""

    def _untracked(self, **attributes):
        """Sets plain Python attributes past TensorFlow's tracking."""
        # Plain Python state, set past TensorFlow's attribute tracking: the
        # variables are tracked by `add_variable`, the listening layers are
        # saved with their model, not with the optimizer.
        for name, value in attributes.items():
            object.__setattr__(self, name, value)

    # The options, read from `self.options` (fixed at construction: a traced train
    # step cannot switch paths later).
    @property
    def is_passthrough(self):
        """True for `accum_steps=1` without `schedulable`: no buffers, no windows."""
        return self.options.is_passthrough

    @property
    def auto(self):
        """With accum_steps="auto": {"max_effective_batch_size", "lr_scaling"}; else None."""
        return self.options.auto_settings

    @property
    def partial_window(self):
        """What an epoch's end does with an open window: "apply", "carry" or "drop"."""
        return self.options.partial_window

    @property
    def schedulable(self):
        """Whether the window keeps its buffers so that `accum_steps` can change."""
        return self.options.schedulable

    @property
    def measure_noise_scale(self):
        """Whether the windows measure the gradient noise scale."""
        return self.options.measure_noise_scale

    @property
    def noise_scale_smoothing(self):
        """The decay of the noise scale's moving averages over windows."""
        return self.options.noise_scale_smoothing

    @property
    def merge_duplicate_rows(self):
        """Whether a sparse gradient's rows are summed per index before the inner update."""
        return self.options.merge_duplicate_rows

    @property
    def loss_reduction(self):
        """How the loss reduces over its samples: "auto", "mean" or "sum"."""
        return self.options.loss_reduction

    @property
    def accum_steps(self):
        """Micro-batches per window. Once built, the variable's value: what a
        schedule set, and what a restored checkpoint or loaded model holds."""
        if self._window_built() and tf.executing_eagerly():
            return int(self._state.saved.accum_steps.numpy())
        return self._accum_steps

    def _window_built(self):
        """Whether the window's state exists (built on the first micro-batch)."""
        state = getattr(self, "_state", None)
        return state is not None and state.built()

    @property
    def micro_step(self):
        """Micro-batches in the open window (0 right after an update); None before the window is built."""
        return self._state.saved.micro_step if self._window_built() else None

    @property
    def accumulators(self):
        """The dense gradient buffers, one per variable (a one-row stand-in until a dense
        gradient comes; each one's `shape` says what it holds)."""
        return list(self._state.saved.accumulators) if self._window_built() else []

    @property
    def window_rows(self):
        """Per variable, the `WindowRows` of its sparse gradients (None for scalars)."""
        return list(self._state.saved.rows) if self._window_built() else []

    @property
    def gradient_kinds(self):
        """{variable path: how the window holds its gradients}, for the variables that
        got one in a step so far: "dense" (a sum), "rows" (a sparse gradient's rows,
        kept apart as the large batch keeps them), "once-per-batch rows" (a lookup
        whose ids do not depend on the sample: one row per id position, the
        micro-batches summed into it; see `accumulator.rows.lookups`), "dense + rows",
        or "maximum" (`overwrite_with_gradient` variables)."""
        return self._state.gradient_kinds()

    @property
    def held_micro_batches(self):
        """Micro-batches in the open window, as an int (0 before the optimizer is built)."""
        if not self._window_built() or self.is_passthrough:
            return 0
        return int(self._state.saved.micro_step.numpy())

    @property
    def noise_scale_estimate(self):
        """The `NoiseScaleEstimate` (smoothed |G|^2, tr Sigma, B_simple as tensors);
        None before the optimizer is built. Needs `measure_noise_scale=True`."""
        self._check_measures_noise_scale()
        noise = self._noise_scale_variables()
        return None if noise is None else noise.estimate

    @property
    def noise_scale(self):
        """B_simple, the gradient noise scale, as a Python float, in samples in `fit`
        (also for sequence outputs, whose loss weighs tokens), in units of
        `micro_batch_weight` in a custom loop; NaN before the first window of at
        least two micro-batches. Needs `measure_noise_scale=True`."""
        estimate = self.noise_scale_estimate
        return float("nan") if estimate is None else estimate.noise_scale_value()

    @property
    def preconditioned_noise_scale_estimate(self):
        """The `NoiseScaleEstimate` of the preconditioned gradient P g (P the inner
        optimizer's 1 / (sqrt(v_hat) + eps) for Adam); None for optimizers without a
        second moment, or before the optimizer is built. Needs `measure_noise_scale=True`."""
        self._check_measures_noise_scale()
        noise = self._noise_scale_variables()
        return None if noise is None else noise.preconditioned_estimate

    @property
    def preconditioned_noise_scale(self):
        """B_simple of the preconditioned gradient, in samples as `noise_scale`; NaN
        without a second moment or before the first window. Needs `measure_noise_scale=True`."""
        estimate = self.preconditioned_noise_scale_estimate
        return float("nan") if estimate is None else estimate.noise_scale_value()

    def _noise_scale_variables(self):
        """The window's `NoiseScaleVariables`, or None (not built, or not measuring)."""
        return self._state.saved.noise if self._window_built() else None

    def _check_measures_noise_scale(self):
        """AttributeError unless the wrapper measures the noise scale."""
        if not self.measure_noise_scale:
            raise AttributeError(
                "This GradientAccumulator does not measure the gradient noise scale; "
                "construct it with `measure_noise_scale=True` (and accum_steps >= 2)."
            )

    def add_window_listener(self, layer) -> None:
        """Makes `layer` follow the windows: closed with partial windows, given every new `accum_steps`.

        Args:
            layer: an `AccumBatchNormalization` (added once however often it is given).
        """
        listeners = self._state.notes.listeners
        if not any(layer is known for known in listeners):
            listeners.append(layer)

