"""`AccumBatchNormalization`: moving statistics of the effective batch, not the micro-batch.

Each micro-batch is still normalized with its own statistics; only the moving
statistics, the ones inference uses, are those of the whole effective batch
(every micro-batch of the window, on every replica), updated once per window.

Under `GradientAccumulator(inner, micro_batch_size=b)` the window is `fit`'s step: the
step notes each micro-batch's real rows (`core.micro_batch_notes`), the layer leaves the
padding out of the micro-batch's moments and pools them on its replica alone (no
collective inside the step's loop), and the step's close pools every replica's, in one
all-reduce for all the model's layers, and updates the moving statistics once per step.
The window's variables are replica-local (`ON_READ`, replica 0's read across replicas):
every replica holds the same values between steps, its own share inside one.
"""

from __future__ import annotations

import logging
import math

import keras
import tensorflow as tf
from keras import ops

from tfx_gradient_accumulator.accumulator.core import micro_batch_notes, replicas, seam
from tfx_gradient_accumulator.accumulator.core.options import validate_accum_steps

logger = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="accumulator")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """Drop-in `keras.layers.BatchNormalization` with one moving-statistics update per window.

    A stock `BatchNormalization` under accumulation updates its moving mean and
    variance after every micro-batch, from that micro-batch's statistics: more
    updates, of noisier statistics, than the large batch makes. This layer
    pools the window's micro-batches exactly (count, mean and sum of squared
    deviations, combined with Chan's parallel formula) and updates the moving
    statistics once per window with the mean and (biased) variance of the
    effective batch. Under several replicas it pools them all, whether or not
    the layer is `synchronized` (which still decides, as in Keras, what a
    micro-batch is normalized with).

    Under `GradientAccumulator(inner, micro_batch_size=b)` the window is the
    training step: each micro-batch is normalized with its own real rows (the
    last one's padding left out), and the moving statistics are updated once
    per step with the mean and variance of all the batch's real rows, on every
    replica. `accum_steps` plays no part there.

    Args:
        *args: those of `keras.layers.BatchNormalization`, by position.
        accum_steps: micro-batches per window; must match the optimizer's
            `GradientAccumulator`. `None` (the default) leaves it to
            `accumulating_compile` / `use_accumulated_batch_norm`, which set it,
            and behaves as 1 until then.
        **kwargs: those of `keras.layers.BatchNormalization` (`renorm` is not
            supported).

    Raises:
        ValueError: `renorm=True`, or `accum_steps` < 1.
        TypeError: `accum_steps` is not an integer.
        NotImplementedError: at the first step under `micro_batch_size`,
            `synchronized=True` with several replicas, or inputs whose first
            axis is not the micro-batch's samples.
    """

    def __init__(self, *args, accum_steps: int | None = None, **kwargs):
        if kwargs.get("renorm"):
            raise ValueError("AccumBatchNormalization does not support `renorm=True`.")
        super().__init__(*args, **kwargs)
        self._initial_accum_steps = None if accum_steps is None else validate_accum_steps(accum_steps)

    def build(self, input_shape) -> None:
        """Creates Keras' weights and the window's (accum_steps, calls, count, mean, M2).

        Args:
            input_shape: the inputs' shape, as Keras gives it.
        """
        super().build(input_shape)
        channels = self.moving_mean.shape

        def state(name, shape, dtype="float32", value=0):
            # Replica-local: a micro-batch step writes each replica's share inside its loop,
            # where no collective may run (a mirrored write is one).
            with seam.variables_created_as(synchronization=tf.VariableSynchronization.ON_READ,
                                           aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA):
                return self.add_weight(
                    name=name, shape=shape, dtype=dtype, trainable=False,
                    initializer=keras.initializers.Constant(value), autocast=False,
                )

        self._window_accum_steps = state("accum_steps", (), "int32", self._initial_accum_steps or 1)
        self._window_calls = state("window_calls", (), "int32")
        self._window_count = state("window_count", ())
        self._window_mean = state("window_mean", channels)
        self._window_m2 = state("window_m2", channels)

    @property
    def accum_steps(self) -> int | None:
        """Micro-batches per window (None before it is set on an unbuilt layer)."""
        return int(self._window_accum_steps.numpy()) if self.built else self._initial_accum_steps

    def set_accum_steps(self, accum_steps: int) -> None:
        """Changes the window's length; a schedule calls it with the optimizer's.

        Args:
            accum_steps: micro-batches per window, an integer >= 1.

        Raises:
            ValueError: `accum_steps` < 1.
            TypeError: `accum_steps` is not an integer.
        """
        accum_steps = validate_accum_steps(accum_steps)
        self._initial_accum_steps = accum_steps
        if self.built:
            self._window_accum_steps.assign(accum_steps)

    def call(self, inputs, training=None, mask=None):
        """Normalizes `inputs`; in training, also adds their statistics to the window.

        Args:
            inputs: the layer's input tensor.
            training: Keras' training flag; outside training (or when the layer
                is not trainable) it is Keras' own `BatchNormalization`.
            mask: an optional mask of the samples (or positions) that count.

        Returns:
            The normalized tensor, in the layer's compute dtype.
        """
        if not (training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        real = micro_batch_notes.real_rows()
        if real is None:
            mean, variance = seam.batch_norm_moments(self, inputs, mask)
            self._accumulate(inputs, mask, mean, variance)
        else:
            mean, variance = self._pool_micro_batch(inputs, mask, real)
        outputs = ops.batch_normalization(
            x=inputs, mean=mean, variance=variance, axis=self.axis,
            offset=ops.cast(self.beta, inputs.dtype) if self.center else None,
            scale=ops.cast(self.gamma, inputs.dtype) if self.scale else None,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _accumulate(self, inputs, mask, mean, variance):
        """Pools this micro-batch's (count, mean, variance) into the window; closes it when full."""
        if mask is None:
            shape = ops.shape(inputs)
            count = ops.cast(1, "float32")
            rank = len(inputs.shape)
            channels = {a % rank for a in (self.axis if isinstance(self.axis, (list, tuple)) else [self.axis])}
            for axis in range(rank):
                if axis not in channels:    # the axes the moments reduce over
                    count = count * ops.cast(shape[axis], "float32")
        else:
            count = ops.sum(ops.cast(mask, "float32"))
        mean = ops.reshape(ops.cast(mean, "float32"), (-1,))
        variance = ops.reshape(ops.cast(variance, "float32"), (-1,))
        count, mean, variance = _pool_over_replicas(count, mean, variance)
        n, pooled_mean, pooled_m2 = self._pooled_with_window(count, mean, variance)
        calls = self._window_calls + 1
        close = calls >= self._window_accum_steps
        self._update_moving(close, pooled_mean, ops.divide_no_nan(pooled_m2, n))
        zero = ops.zeros_like(pooled_mean)
        self._window_count.assign(ops.where(close, 0.0, n))
        self._window_mean.assign(ops.where(close, zero, pooled_mean))
        self._window_m2.assign(ops.where(close, zero, pooled_m2))
        self._window_calls.assign(ops.where(close, 0, calls))

    def _pooled_with_window(self, count, mean, variance):
        """(n, mean, M2) of the window's rows and a micro-batch's (`count` rows, `mean`,
        biased `variance`), by Chan et al.'s parallel formula."""
        n_a, mean_a, m2_a = self._window_count, self._window_mean, self._window_m2
        n = n_a + count
        delta = mean - mean_a
        share = ops.divide_no_nan(count, n)
        return n, mean_a + delta * share, m2_a + variance * count + delta * delta * n_a * share

    def _pool_micro_batch(self, inputs, mask, real):
        """Under `micro_batch_size`: this micro-batch's moments over its real rows (the
        padding left out), pooled into this replica's share of the step; the step's close
        (`close_micro_batches`) pools the replicas and updates the moving statistics."""
        self._refuse_synchronized_replicas()
        self._refuse_other_rows(inputs, real)
        self._warn_accum_steps_ignored()
        count, mean, variance = self._real_row_moments(inputs, mask, real)
        n, pooled_mean, pooled_m2 = self._pooled_with_window(count, mean, variance)
        self._window_count.assign(n)
        self._window_mean.assign(pooled_mean)
        self._window_m2.assign(pooled_m2)
        return mean, variance

    def _real_row_moments(self, inputs, mask, real):
        """(count, mean, biased variance) over the rows `real` marks (and `mask`, as Keras
        applies one: one dimension less than `inputs`), shaped as the moving statistics."""
        rank = len(inputs.shape)
        weight = ops.reshape(ops.cast(real, inputs.dtype), (-1,) + (1,) * (rank - 1))
        if mask is not None:
            weight = weight * ops.expand_dims(ops.cast(mask, inputs.dtype), -1)
        weight = ops.broadcast_to(weight, ops.shape(inputs))
        axes, counted = [i for i in range(rank) if i != self.axis % rank], weight > 0
        counts = ops.sum(weight, axis=axes, keepdims=True)
        mean = ops.divide_no_nan(ops.sum(ops.where(counted, inputs, 0.0), axis=axes, keepdims=True), counts)
        squares = ops.where(counted, ops.square(inputs - mean), 0.0)
        variance = ops.divide_no_nan(ops.sum(squares, axis=axes, keepdims=True), counts)
        shape = self.moving_mean.shape
        return ops.reshape(counts, (-1,))[0], ops.reshape(mean, shape), ops.reshape(variance, shape)

    def _refuse_synchronized_replicas(self):
        """A synchronized micro-batch's moments need a collective inside the step's loop:
        a strategy's replica context cannot run one there (a nested graph's merge_call)."""
        if self.synchronized and replicas.replicas_in_sync() > 1:
            raise NotImplementedError(
                f"{self.name}: synchronized=True under micro_batch_size with "
                f"{replicas.replicas_in_sync()} replicas would all-reduce each micro-batch's moments "
                "inside the step's loop, which a strategy's replica context cannot do. Pass "
                "synchronized=False (each replica's micro-batch is normalized with its own rows; the "
                "moving statistics still pool every replica's), or train with accum_steps.")

    def _refuse_other_rows(self, inputs, real):
        """`real` marks the samples: on rows of another count (time steps folded into the
        samples' axis) which rows are padding cannot be told."""
        rows, samples = inputs.shape[0], real.shape[0]
        if rows is not None and samples is not None and rows != samples:
            raise NotImplementedError(
                f"{self.name} is called on {rows} rows in a micro-batch of {samples} samples (after a "
                "reshape that folds another axis into the samples'?): under micro_batch_size it leaves the last "
                "micro-batch's padding out by the first axis, which must be the samples'. Train with "
                "accum_steps (fit at the micro-batch) instead.")

    def _warn_accum_steps_ignored(self):
        """Once per layer: an `accum_steps` the user gave has no effect under micro_batch_size."""
        if self._initial_accum_steps not in (None, 1) and not getattr(self, "_warned_accum_steps", False):
            self._warned_accum_steps = True
            logger.warning(
                "%s was given accum_steps=%d, which micro_batch_size ignores: the layer pools the "
                "micro-batches of each training step and updates its moving statistics once per step.",
                self.name, self._initial_accum_steps)

    def close_micro_batches(self, rows):
        """Closes the step's pooled statistics: `rows` ([replicas, 1 + 2 channels], or [1, ...]
        on one replica) are each replica's (count, mean, M2). The moving statistics take
        their pooled mean and variance, where any row was counted; the window starts empty.

        Args:
            rows: each replica's (count, mean, M2), as `micro_batch_share` gives them.
        """
        shape = self._window_mean.shape
        total, mean, variance = _pooled_rows(rows, math.prod(shape))
        self._update_moving(total > 0, ops.reshape(mean, shape), ops.reshape(variance, shape))
        self._window_count.assign(0.0)
        self._window_mean.assign(ops.zeros(shape))
        self._window_m2.assign(ops.zeros(shape))
        self._window_calls.assign(0)

    def micro_batch_share(self):
        """This replica's (count, mean, M2) of the step, one vector: what the close pools."""
        return ops.concatenate([ops.reshape(self._window_count, (1,)), ops.reshape(self._window_mean, (-1,)),
                                ops.reshape(self._window_m2, (-1,))])

    def _update_moving(self, close, mean, variance):
        # Branch-free: a `cond` holding the (cross-replica) assignment would
        # need a merge_call inside it under MirroredStrategy.
        momentum = self.momentum
        moving_mean, moving_variance = self.moving_mean, self.moving_variance
        new_mean = moving_mean * momentum + ops.cast(mean, moving_mean.dtype) * (1.0 - momentum)
        new_variance = moving_variance * momentum + ops.cast(variance, moving_variance.dtype) * (1.0 - momentum)
        moving_mean.assign(ops.where(close, new_mean, moving_mean))
        moving_variance.assign(ops.where(close, new_variance, moving_variance))

    def close_window(self, apply: bool = True) -> int:
        """Closes a partly filled window (the optimizer's partial window closes it).

        Args:
            apply: True: the moving statistics take the window's pooled ones;
                False: the window's statistics are discarded.

        Returns:
            The micro-batches the window held (0: nothing to close).
        """
        if not self.built or int(self._window_calls.numpy()) == 0:
            return 0
        held = int(self._window_calls.numpy())
        if apply:
            self._update_moving(True, self._window_mean.value,
                                ops.divide_no_nan(self._window_m2.value, self._window_count.value))
        self._window_count.assign(0.0)
        self._window_mean.assign(ops.zeros_like(self._window_mean))
        self._window_m2.assign(ops.zeros_like(self._window_m2))
        self._window_calls.assign(0)
        return held

    def get_config(self) -> dict:
        """Keras' config of the layer, with `accum_steps`."""
        return {**super().get_config(), "accum_steps": self.accum_steps}


def _pool_over_replicas(count, mean, variance):
    """The (count, mean, variance) of all replicas' micro-batches together."""
    channels = mean.shape[0]
    rows = replicas.stack_over_replicas(ops.concatenate([ops.reshape(count, (1,)), mean, variance * count]))
    if rows is None:
        return count, mean, variance
    return _pooled_rows(rows, channels)


def _pooled_rows(rows, channels):
    """(count, mean, biased variance) of the rows' parts together: each row of `rows` is one
    part's (count, mean, M2), `channels` wide each."""
    counts, means, m2s = rows[:, :1], rows[:, 1:1 + channels], rows[:, 1 + channels:]
    total = ops.sum(counts)
    pooled_mean = ops.divide_no_nan(ops.sum(counts * means, axis=0), total)
    pooled_m2 = ops.sum(m2s + counts * ops.square(means - pooled_mean), axis=0)
    return total, pooled_mean, ops.divide_no_nan(pooled_m2, total)


def _close_micro_batches(model):
    """After a `micro_batch_size` step's loop, in replica context: every trainable, built
    `AccumBatchNormalization` of `model` closes the step, its replicas pooled in one
    all-reduce for all the layers."""
    layers = [layer for layer in _batch_norm_layers(model) if layer.built and layer.trainable]
    if not layers:
        return
    shares = [layer.micro_batch_share() for layer in layers]
    rows = replicas.stack_over_replicas(ops.concatenate(shares))
    start = 0
    for layer, share in zip(layers, shares):
        width = share.shape[0]
        layer.close_micro_batches(ops.reshape(share, (1, width)) if rows is None else rows[:, start:start + width])
        start += width


micro_batch_notes.closes_after_micro_batches(__name__, _close_micro_batches)


def _batch_norm_layers(model):
    """The model's `AccumBatchNormalization` layers, nested ones included."""
    return [layer for layer in seam.flatten_layers(model) if isinstance(layer, AccumBatchNormalization)]


def configure_batch_norm(model: keras.Model, accum_steps: int, optimizer=None) -> list:
    """Sets `accum_steps` on the model's `AccumBatchNormalization` layers.

    `fit` does this for a model compiled with a `GradientAccumulator`. A layer
    built with another `accum_steps` follows the optimizer (with a warning).

    Args:
        model: the model whose layers (nested ones included) are set.
        accum_steps: micro-batches per window, the optimizer's.
        optimizer: a `GradientAccumulator` the layers then follow: its partial
            windows close theirs, and its `set_accum_steps` (a schedule)
            changes theirs. None: set once.

    Returns:
        The model's `AccumBatchNormalization` layers.

    Raises:
        ValueError: `accum_steps` < 1.
        TypeError: `accum_steps` is not an integer.
    """
    layers = _batch_norm_layers(model)
    for layer in layers:
        if layer._initial_accum_steps not in (None, accum_steps):
            logger.warning(
                "%s was given accum_steps=%d but trains with an optimizer that "
                "accumulates %d micro-batches; it follows the optimizer.",
                layer.name, layer._initial_accum_steps, accum_steps,
            )
        layer.set_accum_steps(accum_steps)
    if optimizer is not None:
        for layer in layers:
            optimizer.add_window_listener(layer)
    return layers


def use_accumulated_batch_norm(model: keras.Model, accum_steps: int) -> keras.Model:
    """A copy of `model` whose `BatchNormalization` layers are `AccumBatchNormalization`.

    Weights (gamma, beta, moving statistics, all other layers') are kept, so a
    pretrained model can be fine-tuned with accumulation.

    Args:
        model: a Sequential or functional Keras 3 model (it is copied with
            `keras.models.clone_model`).
        accum_steps: micro-batches per window, the optimizer's.

    Returns:
        The copy; `model` is unchanged.

    Raises:
        ValueError: `accum_steps` < 1.
        TypeError: `accum_steps` is not an integer.
    """
    accum_steps = validate_accum_steps(accum_steps)

    def clone(layer):
        config = layer.get_config()
        if type(layer) is keras.layers.BatchNormalization:
            return AccumBatchNormalization.from_config({**config, "accum_steps": accum_steps})
        return layer.__class__.from_config(config)

    copy = keras.models.clone_model(model, clone_function=clone)
    old_layers = seam.flatten_layers(model)
    new_layers = seam.flatten_layers(copy)
    for old, new in zip(old_layers, new_layers):
        if isinstance(new, AccumBatchNormalization):
            for name in ("gamma", "beta", "moving_mean", "moving_variance"):
                if getattr(old, name, None) is not None:
                    getattr(new, name).assign(getattr(old, name))
        elif old.weights and not any(isinstance(x, AccumBatchNormalization) for x in [new, *seam.flatten_layers(new)]):
            new.set_weights(old.get_weights())
    return copy
