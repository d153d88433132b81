"""`AccumBatchNormalization`: moving statistics of the effective batch, not the micro-batch.

Each micro-batch is still normalized with its own statistics; only the moving
statistics, the ones inference uses, are those of the whole effective batch
(every micro-batch of the window, on every replica), updated once per window.
"""

from __future__ import annotations

import logging

import keras
from keras import ops

from tfx_gradient_accumulator.accumulator.core import replicas, seam
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
        mean, variance = seam.batch_norm_moments(self, inputs, mask)
        self._accumulate(inputs, mask, mean, variance)
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
        # Chan et al.: combine (n_a, mean_a, M2_a) with this micro-batch's.
        n_a, mean_a, m2_a = self._window_count, self._window_mean, self._window_m2
        n = n_a + count
        delta = mean - mean_a
        share = ops.divide_no_nan(count, n)
        pooled_mean = mean_a + delta * share
        pooled_m2 = m2_a + variance * count + delta * delta * n_a * share
        calls = self._window_calls + 1
        close = calls >= self._window_accum_steps
        self._update_moving(close, pooled_mean, ops.divide_no_nan(pooled_m2, n))
        zero = ops.zeros_like(pooled_mean)
        self._window_count.assign(ops.where(close, 0.0, n))
        self._window_mean.assign(ops.where(close, zero, pooled_mean))
        self._window_m2.assign(ops.where(close, zero, pooled_m2))
        self._window_calls.assign(ops.where(close, 0, calls))

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
    counts, means, m2s = rows[:, :1], rows[:, 1:1 + channels], rows[:, 1 + channels:]
    total = ops.sum(counts)
    pooled_mean = ops.divide_no_nan(ops.sum(counts * means, axis=0), total)
    pooled_m2 = ops.sum(m2s + counts * ops.square(means - pooled_mean), axis=0)
    return total, pooled_mean, ops.divide_no_nan(pooled_m2, total)


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
