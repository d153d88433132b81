"""Exact large batches for losses that couple the batch: gradient caching.

A contrastive loss (in-batch negatives, InfoNCE, CLIP, SimCLR) scores every
sample of a batch against every other: the batch *is* the set of negatives.
Accumulating micro-batch gradients is then wrong by design, not merely
approximate: micro-batches of b give each sample b - 1 negatives, not N·b - 1.
Gradient caching (Gao et al., "Scaling Deep Contrastive Learning Batch Size
under Memory Limited Setup", 2021) makes the large batch exact with one
micro-batch's activations in memory at a time. `GradientCache` does it inside
Keras' `fit`, for every batch `fit` gives it, in three passes:

1. **Represent.** The wrapped model runs over each of the `accum_steps`
   micro-batches without a tape: no activations are kept, only the outputs
   (the representations: small).
2. **Score.** The loss of the whole batch is computed on the concatenated
   representations, under a tape: its gradient with respect to every
   representation (and to any variable the loss itself uses, such as a learned
   temperature, or weight regularization).
3. **Back-propagate.** Each micro-batch runs again under a tape, one after
   another (a `tf.while_loop`), and sends its slice of that gradient back through the model: the
   parameter gradients add up (dense ones summed, sparse embedding rows
   concatenated in sample order) to the large batch's gradient, which the
   optimizer applies once.

So `fit(x, batch_size=N·b)` on `GradientCache(model, accum_steps=N)` trains like
`fit(x, batch_size=N·b)` on `model`, holding the activations of b samples at a
time, for one extra forward pass. Nothing is held between steps, so nothing is
lost when training stops between any two steps: any checkpoint resumes exactly.

What the loss sees is the wrapped model's `compute_loss(x, y, y_pred,
sample_weight)` (its own override, as Keras 3 models that compute a contrastive
loss write it), or else the loss this wrapper was compiled with, with `y_pred` the
representations of the whole batch. Under a `tf.distribute` strategy each
replica computes the loss on its own share of the batch, as Keras' large batch
does under the same strategy: the same negatives.

Refused, before any training, with a message: layers whose training output
mixes the samples of a batch (`BatchNormalization`: it would normalize with
micro-batch statistics) and losses added while the model runs (`add_loss`,
activity regularizers: they would come from one micro-batch). Dropout and other
random layers draw the same numbers in passes 1 and 3 (their seeds are rewound),
but not the numbers the large batch would draw.

The passes themselves are `accumulator.cache_passes`, shared with the Keras 2
class (`accumulator.keras2_gradient_cache`), which `GradientCache(model, ...)`
returns for a Keras 2 model.
"""

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import cache_passes, seam
from tfx_gradient_accumulator.accumulator.window import validate_accum_steps


@keras.saving.register_keras_serializable(package="accumulator")
class GradientCache(keras.Model):
    """Trains `model` on each batch in `accum_steps` micro-batches with the whole
    batch's loss: exact large batches for losses that couple the batch.

    Args:
        model: a Keras model whose outputs (any structure of tensors whose first
            axis is the batch) are what the loss scores. Unchanged: its
            `compute_loss`, if it overrides one, is the loss.
        accum_steps: micro-batches per batch (positive int). A batch of B samples is
            cut into micro-batches of ceil(B / accum_steps), in order; the last may
            be shorter, which changes nothing (the loss is always the batch's).

    A Keras 2 model (`tf_keras`, or `tf.keras` on TF 2.15) gets the Keras 2 class,
    `accumulator.keras2_gradient_cache.GradientCache`, with the same guarantees.

    ```python
    model = GradientCache(two_tower, accum_steps=8)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    model.fit(dataset.batch(4096))   # in-batch negatives of 4096, activations of 512
    ```
    """

    def __new__(cls, model=None, *args, **kwargs):
        # One name for both Keras: a Keras 2 model gets the Keras 2 class.
        if cls is GradientCache and seam.is_keras2_object(model):
            from tfx_gradient_accumulator.accumulator import keras2_gradient_cache

            return keras2_gradient_cache.GradientCache(model, *args, **kwargs)
        return super().__new__(cls, model, *args, **kwargs)

    def __init__(self, model, accum_steps, **kwargs):
        super().__init__(**kwargs)
        self.accum_steps = validate_accum_steps(accum_steps)
        if not isinstance(model, keras.Model) or seam.is_keras2_object(model):
            raise TypeError(f"`model` must be a Keras 3 `keras.Model`; received {type(model).__name__}.")
        self.model = model
        # Built with the model: `fit` never calls the wrapper itself, and saving
        # and loading need it built (the optimizer is restored onto its variables).
        self.built = model.built

    def build(self, input_shape=None):
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if type(self.model).compute_loss is not keras.Model.compute_loss:
            return self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        return super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._refuse_what_would_not_be_exact()
        variables = self.trainable_variables
        # What a forward pass changes and pass 3 must replay: random seeds and
        # counters (integers), not frozen weights (BatchNormalization is refused).
        state = [v for v in self.model.variables if not v.trainable and not _is_float(v)]
        saved = [tf.identity(v.value) for v in state]

        def score(whole):
            loss = self.compute_loss(x=x, y=y, y_pred=whole, sample_weight=sample_weight, training=True)
            return loss, self.optimizer.scale_loss(loss)

        def replay_state():
            for v, value in zip(state, saved):
                v.assign(value)

        loss, whole, grads = cache_passes.cached_gradients(
            lambda part: self.model(part, training=True), x, self.accum_steps, score, variables,
            after_pass_1=self._refuse_losses_added_while_running, before_pass_3=replay_state)
        with cache_passes.ready_for_update(grads):
            self.optimizer.apply_gradients(zip(grads, variables))
        seam.loss_tracker(self).update_state(
            loss * tf.distribute.get_strategy().num_replicas_in_sync,
            sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        return self.compute_metrics(x, y, whole, sample_weight=sample_weight)

    def _refuse_what_would_not_be_exact(self):
        for layer in seam.flatten_layers(self.model):
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise ValueError(
                    f"GradientCache: layer {layer.name!r} is a BatchNormalization, whose training "
                    "output depends on the other samples of its batch; it would normalize with "
                    "micro-batch statistics, not the batch's. Use LayerNormalization, or freeze "
                    "the layer (trainable=False).")

    def _refuse_losses_added_while_running(self):
        regularized = sum(1 for v in self.trainable_variables if getattr(v, "regularizer", None) is not None)
        if len(self.losses) > regularized:
            raise ValueError(
                "GradientCache: the model adds losses while it runs (`add_loss`, an "
                "activity_regularizer); they would come from one micro-batch, not the batch. "
                "Put them into `compute_loss`, on the representations, or use weight "
                "regularizers (kernel_regularizer), which GradientCache handles exactly.")

    def get_config(self):
        return {**super().get_config(), "model": keras.saving.serialize_keras_object(self.model),
                "accum_steps": self.accum_steps}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"))
        return cls(model, **config)


def is_gradient_cache(model):
    """Whether `model` is a `GradientCache` of either Keras (the Keras 2 class is
    another class, returned by this one's constructor for a Keras 2 model)."""
    if isinstance(model, GradientCache):
        return True
    if seam.is_keras2_object(model):
        from tfx_gradient_accumulator.accumulator import keras2_gradient_cache

        return isinstance(model, keras2_gradient_cache.GradientCache)
    return False


def _is_float(variable):
    return tf.as_dtype(variable.dtype).is_floating
