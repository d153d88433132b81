"""The optimizer's geometry for the gradient noise scale: the per-coordinate scale P of an adaptive optimizer.

An adaptive optimizer steps along P m (m its momentum, P = 1 / (sqrt(v_hat) + eps) for Adam),
so the noise scale that predicts its critical batch is that of P g (Pollux, Qiao et al.,
OSDI 2021; AdaptDL's `AdamGradientNoiseScale`). `preconditioner_of` reads P from the
optimizer's second moments; `preconditioned_squared_norm` is `noise_scale.squared_norm` of P g.
A window reads P once, at its close: `joined_squares` per micro-batch, `joined_scale` per window.
"""

from __future__ import annotations

import numbers

from typing import TYPE_CHECKING

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import seam

if TYPE_CHECKING:
    from collections.abc import Sequence

# Keras 3 and Keras 2 (tf_keras) optimizer classes, by name, and the kind of scale each applies.
KINDS = {"Adam": "adam", "AdamW": "adam", "Nadam": "adam", "Lamb": "adam",
         "Adamax": "adamax", "RMSprop": "rmsprop", "Adagrad": "adagrad"}
# Those dividing by sqrt(v_hat) + eps; Keras' Adam and AdamW divide by sqrt(v) + eps, i.e.
# by sqrt(v_hat) + eps / sqrt(1 - beta_2^t) ("epsilon hat", Kingma & Ba, before section 2.1).
_EPSILON_ON_CORRECTED = frozenset({"Nadam", "Lamb"})


def _keras_class_name(optimizer) -> str | None:
    """The name of the first class of `KINDS` in `optimizer`'s class hierarchy that Keras 3
    or Keras 2 defines (a user's subclass counts as its base), or None; Keras 2's
    `optimizers.legacy` classes, whose moments live elsewhere, are None."""
    for klass in type(optimizer).__mro__:
        module = klass.__module__ + "."
        if module.split(".")[0] in ("keras", "tf_keras") and ".legacy." not in module and klass.__name__ in KINDS:
            return klass.__name__
    return None


def _hyperparameter(optimizer, name: str, dtype: tf.DType = tf.float32) -> tf.Tensor:
    """`optimizer.<name>` (a number, a tensor, or a callable returning one) as `dtype`."""
    value = getattr(optimizer, name)
    if callable(value):
        value = value()
    if isinstance(value, numbers.Real):
        return tf.constant(float(value), dtype)
    return tf.cast(tf.convert_to_tensor(value), dtype)


def _read(slots, index: int) -> tf.Tensor | None:
    """`slots[index]` read as float32 (the local copy in a replica context), or None."""
    if slots is None or index >= len(slots) or slots[index] is None:
        return None
    return tf.cast(tf.convert_to_tensor(slots[index]), tf.float32)


class Preconditioner:
    """Reads an optimizer's per-variable scale P at call time (graph-safe).

    P is the factor the optimizer's own update multiplies its (bias-corrected)
    momentum or gradient by, per coordinate, as its `update_step` computes it:

    - "adam" (Adam, AdamW, Nadam, Lamb; AMSGrad reads the running maxima):
      P = 1 / (sqrt(v_hat) + eps) with v_hat = v / (1 - beta_2^t) for Nadam,
      Lamb and Keras 2's Adam(adaptive_epsilon=True); Keras' Adam and AdamW add
      eps to sqrt(v), which makes P = sqrt(1 - beta_2^t) / (sqrt(v) + eps).
    - "adamax": P = 1 / (u + eps), u its infinity norm (no bias correction).
    - "rmsprop": P = 1 / sqrt(v + eps); centered: 1 / sqrt(v - mean_g^2 + eps).
    - "adagrad": P = 1 / sqrt(accumulator + eps).

    t is the optimizer's `iterations`, the updates applied so far: Keras'
    `update_step` folds the coming gradient into v and then corrects with
    `iterations + 1`, so between updates the stored v goes with t =
    `iterations`, and P is exactly the one the last update applied (the coming
    one's v holds the gradient being measured). While t < `min_updates` (t = 0:
    v = 0, no scale yet) every scale is ones: a uniform P leaves the noise
    scale tr(P Sigma P) / |P G|^2 unchanged, so the raw estimate stands in.
    After, a coordinate whose moment is still 0 gets P = 0 (left out), not 1 / eps.

    Attributes:
        optimizer: the optimizer whose moments are read (wrappers removed).
        kind: "adam", "adamax", "rmsprop" or "adagrad".
        epsilon_on_corrected: "adam" only: eps added to sqrt(v_hat), not to sqrt(v).
        min_updates: the updates before which the scales are ones.
    """

    def __init__(self, optimizer, kind: str, epsilon_on_corrected: bool = False, min_updates: int = 1):
        self.optimizer = optimizer
        self.kind = kind
        self.epsilon_on_corrected = epsilon_on_corrected
        self.min_updates = min_updates

    def scales(self, variables: Sequence) -> list:
        """P per variable, from the optimizer's state now.

        Args:
            variables: the model variables (as given to the optimizer; under a
                strategy, the mirrored variables or their local copies).

        Returns:
            Per variable, a float32 tensor shaped like it (whatever the
            variable's dtype), or None: a variable unknown to the optimizer, or
            the optimizer not built yet. Each costs a few passes over the
            moment; P changes only when the optimizer updates.
        """
        ready, correction, epsilon = self._constants()
        found = []
        for variable in variables:
            moments = self.moments_of(variable)
            if moments is None:
                found.append(None)
                continue
            # A cond, not a where: before `min_updates` nothing is computed, after, no ones are made.
            found.append(tf.cond(ready, lambda m=moments: self._formula(m, correction, epsilon),
                                 lambda m=moments: tf.ones_like(m[0])))
        return found

    def _constants(self) -> tuple:
        """(whether the scales are past `min_updates`, 1 - beta_2^t or None, epsilon): what every
        variable's P shares, read once."""
        updates = tf.convert_to_tensor(self.optimizer.iterations)
        correction = self._bias_correction(updates) if self.kind == "adam" else None
        return updates >= self.min_updates, correction, _hyperparameter(self.optimizer, "epsilon")

    def moments_of(self, variable) -> tuple | None:
        """`variable`'s moments P is made of (float32, see `_moments`), or None: unknown to the
        optimizer, or the optimizer not built yet."""
        index = seam.optimizer_variable_index(self.optimizer, variable)
        return None if index is None else self._moments(index)

    def _bias_correction(self, updates: tf.Tensor) -> tf.Tensor:
        """1 - beta_2^t, in float64 (in float32, 1 - beta_2^t loses ~1e-5 of itself to rounding
        while t is small). At t = 0 it is 0, and P's formula may divide by it: those scales
        are never used (ones stand in before `min_updates`)."""
        beta_2 = _hyperparameter(self.optimizer, "beta_2", tf.float64)
        return tf.cast(1.0 - tf.pow(beta_2, tf.cast(updates, tf.float64)), tf.float32)

    def _moments(self, index: int) -> tuple | None:
        """The moments P is made of, for the variable at `index` of the slot lists, read as
        float32: `(v,)`, `(u,)`, `(v, mean gradient or None)` or `(accumulator,)`; None if absent."""
        if self.kind == "rmsprop":
            velocities, averages = seam.rmsprop_moments(self.optimizer)
            v = _read(velocities, index)
            return None if v is None else (v, _read(averages, index))
        slots = {"adam": seam.adam_second_moments, "adamax": seam.adamax_norms,
                 "adagrad": seam.adagrad_accumulators}[self.kind](self.optimizer)
        moment = _read(slots, index)
        return None if moment is None else (moment,)

    def _formula(self, moments: tuple, correction: tf.Tensor | None, epsilon: tf.Tensor) -> tf.Tensor:
        """P from `_moments`, as the optimizer's `update_step` computes its denominator;
        0 where the moment is still 0 (a coordinate no update has reached, such as an
        embedding row not looked up yet: 1 / eps there would swamp every other)."""
        scale = self._denominator_formula(moments, correction, epsilon)
        if self.kind == "adagrad":      # starts at `initial_accumulator_value`
            return scale
        return tf.where(moments[0] > 0.0, scale, tf.zeros_like(scale))

    def _denominator_formula(self, moments: tuple, correction: tf.Tensor | None, epsilon: tf.Tensor) -> tf.Tensor:
        """P as the optimizer's `update_step` computes its denominator."""
        if self.kind == "adam":
            (v,) = moments
            if self.epsilon_on_corrected:
                return 1.0 / (tf.sqrt(v / correction) + epsilon)
            return tf.sqrt(correction) / (tf.sqrt(v) + epsilon)
        if self.kind == "adamax":
            return 1.0 / (moments[0] + epsilon)
        if self.kind == "rmsprop":
            v, mean = moments
            return tf.math.rsqrt((v if mean is None else v - tf.square(mean)) + epsilon)
        return tf.math.rsqrt(moments[0] + epsilon)


def preconditioner_of(optimizer, min_updates: int = 1) -> Preconditioner | None:
    """The optimizer's preconditioner, or None for optimizers without a second moment.

    None for SGD, Lion, Adafactor (factored moments), Adadelta, Ftrl, Muon,
    Keras 2's `optimizers.legacy` and any other class. Wrappers are removed
    first: a LossScaleOptimizer (Keras 3 and Keras 2) and anything else with an
    `inner_optimizer` (a `GradientAccumulator`). Works for Keras 3 and Keras 2.

    Args:
        optimizer: a Keras optimizer.
        min_updates: the scales are ones until the optimizer has applied this
            many updates, an int >= 1 (1: only before the first, where v = 0;
            AdaptDL waits 5, the moments of the first updates being noisy).

    Returns:
        A `Preconditioner`, or None.

    Raises:
        ValueError: `min_updates` is not an int >= 1.
    """
    if isinstance(min_updates, bool) or not isinstance(min_updates, numbers.Integral) or min_updates < 1:
        raise ValueError(f"`min_updates` must be an int >= 1; received {min_updates!r}.")
    while seam.inner_optimizer(optimizer) is not None:
        optimizer = seam.inner_optimizer(optimizer)
    name = _keras_class_name(optimizer)
    if name is None:
        return None
    on_corrected = name in _EPSILON_ON_CORRECTED or bool(getattr(optimizer, "adaptive_epsilon", False))
    return Preconditioner(optimizer, KINDS[name], epsilon_on_corrected=on_corrected, min_updates=int(min_updates))


def _scaled_sq_norm(grad, scale: tf.Tensor) -> tf.Tensor:
    """|P g|^2 of one gradient, float32; an IndexedSlices' repeated rows summed first."""
    if isinstance(grad, tf.IndexedSlices):
        unique, positions = tf.unique(tf.reshape(grad.indices, [-1]))
        summed = tf.math.unsorted_segment_sum(tf.cast(grad.values, tf.float32), positions, tf.size(unique))
        return tf.reduce_sum(tf.square(summed * tf.gather(scale, unique)))
    return tf.reduce_sum(tf.square(tf.cast(tf.convert_to_tensor(grad), tf.float32) * scale))


def _described(value) -> str:
    """`value`'s type, and its length if it is a list or a tuple."""
    return f"a {type(value).__name__} of {len(value)}" if isinstance(value, (list, tuple)) else type(value).__name__


def preconditioned_squared_norm(grads: Sequence, scales: Sequence) -> tf.Tensor:
    """float32 sum over variables of |P_i g_i|^2: `noise_scale.squared_norm` of P g.

    A `tf.IndexedSlices` counts as the dense tensor it stands for: rows with
    repeated indices are summed, then multiplied by the gathered rows of its
    scale. A gradient or a scale of None counts 0: a variable without a
    gradient, or one the optimizer does not update (so its geometry has none).

    Args:
        grads: the gradients, a list.
        scales: `Preconditioner.scales(variables)` of the same variables, a list
            as long (float32 tensors shaped like the gradients, or None).

    Returns:
        A float32 scalar tensor.

    Raises:
        ValueError: `grads` and `scales` are not lists of one length.
    """
    if not isinstance(grads, (list, tuple)) or not isinstance(scales, (list, tuple)) or len(grads) != len(scales):
        raise ValueError("`grads` and `scales` must be lists of one length (a scale per gradient); received "
                         f"{_described(grads)} and {_described(scales)}.")
    total = tf.constant(0.0, tf.float32)
    for grad, scale in zip(grads, scales):
        if grad is not None and scale is not None:
            total += _scaled_sq_norm(grad, tf.cast(scale, tf.float32))
    return total


def _joined(parts: list) -> tf.Tensor:
    """`parts` (flat tensors) as one flat tensor: one `concat` for the lot."""
    return parts[0] if len(parts) == 1 else tf.concat(parts, axis=0)


def _size(variable) -> int:
    """How many numbers `variable` holds."""
    return int(np.prod(tuple(variable.shape)))


def _filled(size: int, value: float) -> tf.Tensor:
    """A float32 vector of `size` holding `value`, made at run time: `Empty` is stateful,
    so Grappler never folds it into a graph constant the traced function would hold."""
    zeros = tf.raw_ops.Empty(shape=[size], dtype=tf.float32, init=True)
    return zeros if value == 0 else zeros + value


def _flat_dense(grad, variable) -> tf.Tensor:
    """The dense gradient `grad` stands for, float32 and flat, shaped like `variable`: an
    `IndexedSlices`' rows summed into the table (repeated rows summed: one kernel), None zeros."""
    size = _size(variable)
    if grad is None:
        return _filled(size, 0.0)
    if isinstance(grad, tf.IndexedSlices):
        rows = int(variable.shape[0])
        grad = tf.math.unsorted_segment_sum(tf.cast(grad.values, tf.float32), grad.indices, rows)
    return tf.reshape(tf.cast(tf.convert_to_tensor(grad), tf.float32), [size])


def joined_squares(grads: Sequence, variables: Sequence) -> tf.Tensor:
    """g^2 per coordinate of `variables`, joined in their order: one flat float32 vector.

    What a window adds up per micro-batch so that P, which only the window's update
    changes, is read once, at the close: sum_k |P g_k|^2 = sum_i P_i^2 sum_k g_ki^2
    (`joined_scale`). A sparse gradient counts as the dense one it stands for (its
    repeated rows summed before squaring, as `noise_scale.squared_norm` counts them);
    a variable without a gradient (None) counts zeros.

    Args:
        grads: the gradients, as long as `variables` (None: none).
        variables: the variables, in the layout's order.

    Returns:
        A float32 vector of their summed sizes.
    """
    return tf.square(_joined([_flat_dense(g, v) for g, v in zip(grads, variables)]))


def joined_scale(preconditioner: Preconditioner, variables: Sequence) -> tf.Tensor:
    """P per coordinate of `variables`, joined in their order: one flat float32 vector.

    `Preconditioner.scales` in one pass: the moments joined, P's formula once over them,
    and no `cond` per variable (before `min_updates` P is ones: a `where`). A variable
    the optimizer does not know (or an optimizer not built yet) gets zeros: it has no
    geometry, as in `preconditioned_squared_norm`.

    Args:
        preconditioner: the optimizer's `Preconditioner`.
        variables: the variables, in the layout's order.

    Returns:
        A float32 vector of their summed sizes.
    """
    found = [preconditioner.moments_of(v) for v in variables]
    known = [m for m in found if m is not None]
    if not known:
        return _filled(sum(_size(v) for v in variables), 0.0)
    ready, correction, epsilon = preconditioner._constants()
    width = len(known[0])
    pieces = [m if m is not None else (None,) * width for m in found]
    joined = []
    for part in range(width):
        if known[0][part] is None:
            joined.append(None)
            continue
        joined.append(_joined([tf.reshape(m[part], [-1]) if m[part] is not None else _filled(_size(v), 0.0)
                               for m, v in zip(pieces, variables)]))
    scale = tf.where(ready, preconditioner._formula(tuple(joined), correction, epsilon), 1.0)
    if len(known) < len(found):
        # Unknown variables' coordinates: zeros, whatever the formula made of their zero moments.
        mask = _joined([_filled(_size(v), float(m is not None)) for m, v in zip(found, variables)])
        scale = scale * mask
    return scale
