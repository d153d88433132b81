"""`AccumBatchNormalization`: moving statistics of the effective batch, not the micro-batch.

With accumulation, a stock `BatchNormalization` updates its moving mean and
variance after every micro-batch, from the micro-batch's statistics: more
updates, of noisier statistics, than the large batch makes, so inference
statistics drift from those of large-batch training. This layer pools the
statistics of a window's micro-batches (count, mean and sum of squared
deviations, combined exactly with Chan's parallel formula, so the spread between
micro-batch means counts) and updates the moving statistics once per window,
with the mean and (biased) variance of the whole effective batch: what the
large batch would have used.

In training, each micro-batch is still *normalized* with its own statistics (a
forward pass only sees its micro-batch); only the moving statistics, the ones
inference uses, are those of the effective batch.

Under a strategy with several replicas the effective batch spans them all: each
micro-step gathers the replicas' (count, mean, M2) in one small all-reduce
(2 x channels + 1 floats per replica) and pools them exactly, whether or not
the layer is `synchronized`. (Stock Keras' unsynchronized layer keeps the
statistics of one replica's share of the batch.) `synchronized` still decides
what a micro-batch is normalized with, as in Keras.
"""

import logging

import keras
from keras import ops

from tfx_gradient_accumulator.accumulator import replicas, seam
from tfx_gradient_accumulator.accumulator.window import validate_accum_steps

logger = logging.getLogger(__name__)


@keras.saving.register_keras_serializable(package="accumulator")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """Drop-in `keras.layers.BatchNormalization` with one moving-statistics update per window.

    Args:
        accum_steps: micro-batches per window; must match the optimizer's
            `GradientAccumulator`. `None` (the default) leaves it to
            `accumulating_compile` / `use_accumulated_batch_norm`, which set it,
            and behaves as 1 until then.
        **kwargs: those of `keras.layers.BatchNormalization` (`renorm` is not
            supported).
    """

    def __init__(self, *args, accum_steps=None, **kwargs):
        if kwargs.get("renorm"):
            raise ValueError("AccumBatchNormalization does not support `renorm=True`.")
        super().__init__(*args, **kwargs)
        self._initial_accum_steps = None if accum_steps is None else validate_accum_steps(accum_steps)

    def build(self, input_shape):
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
    def accum_steps(self):
        return int(self._window_accum_steps.numpy()) if self.built else self._initial_accum_steps

    def set_accum_steps(self, accum_steps):
        accum_steps = validate_accum_steps(accum_steps)
        self._initial_accum_steps = accum_steps
        if self.built:
            self._window_accum_steps.assign(accum_steps)

    def call(self, inputs, training=None, mask=None):
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

    def close_window(self, apply=True):
        """Applies (or, with apply=False, discards) a partly filled window's statistics."""
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

    def get_config(self):
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
    return [layer for layer in seam.flatten_layers(model) if isinstance(layer, AccumBatchNormalization)]


def configure_batch_norm(model, accum_steps, optimizer=None):
    """Sets `accum_steps` on the model's AccumBatchNormalization layers.

    With `optimizer` (a GradientAccumulator), the layers follow it: its
    partial windows close theirs, and `set_accum_steps` (a schedule) changes
    theirs. `fit` does this for a model compiled with a GradientAccumulator.
    Returns the layers.
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


def use_accumulated_batch_norm(model, accum_steps):
    """A copy of `model` whose BatchNormalization layers are AccumBatchNormalization.

    Weights (gamma, beta, moving statistics, all other layers') are kept, so a
    pretrained model can be fine-tuned with accumulation. Works for Sequential
    and functional models (through `keras.models.clone_model`).
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
