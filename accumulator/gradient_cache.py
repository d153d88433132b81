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
class (`accumulator.keras2.gradient_cache`), which `GradientCache(model, ...)`
makes for a Keras 2 model; `isinstance(x, GradientCache)` holds for both.
"""

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import across_replicas, cache_passes, flavours, refusals, seam
from tfx_gradient_accumulator.accumulator.options import CacheOptions


def validate_gather_across_replicas(model, gather_across_replicas):
    """Returns `gather_across_replicas` if the Keras 3 `model` can be scored over the
    global batch, or raises: gathering needs the model's own `compute_loss`."""
    CacheOptions(gather_across_replicas=gather_across_replicas)      # a bool
    if gather_across_replicas and type(model).compute_loss is keras.Model.compute_loss:
        raise ValueError(
            "GradientCache(gather_across_replicas=True) needs the model's own `compute_loss` "
            f"(`{type(model).__name__}` has none): Keras scales a compiled loss per replica, "
            "for the replica's share. Override compute_loss(x, y, y_pred, sample_weight) to "
            "return the loss of the batch it is given, as on one device, or use "
            "gather_across_replicas=False.")
    return gather_across_replicas


@keras.saving.register_keras_serializable(package="accumulator")
class GradientCache(keras.Model, metaclass=flavours.OneNameForBothKeras):
    """Trains `model` on each batch in `accum_steps` micro-batches with the whole
    batch's loss: exact large batches for losses that couple the batch.

    Args:
        model: a Keras model whose outputs (any structure of tensors whose first
            axis is the batch) are what the loss scores. Unchanged: its
            `compute_loss`, if it overrides one, is the loss.
        accum_steps: micro-batches per batch (positive int). A batch of B samples is
            cut into micro-batches of ceil(B / accum_steps), in order; the last may
            be shorter, which changes nothing (the loss is always the batch's).
        gather_across_replicas: under a `tf.distribute` strategy with R replicas,
            `False` (the default) scores each replica's share alone, as Keras' own
            large batch does under the strategy (each sample meets the negatives of
            its share); `True` scores the whole global batch on every replica
            (`accumulator.across_replicas`), so R replicas train like one device on
            the global batch. Costs one all-reduce of the representations, inputs
            and targets per step. Needs the model's own `compute_loss` (the loss of
            the batch it is given, as on one device); a compiled Keras loss is
            scaled per replica and refused here.

    A Keras 2 model (`tf_keras`, or `tf.keras` on TF 2.15) gets the Keras 2 class,
    `accumulator.keras2.gradient_cache.GradientCache`, with the same guarantees;
    `isinstance(x, GradientCache)` holds for both (`accumulator.flavours`).

    ```python
    model = GradientCache(two_tower, accum_steps=8)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    model.fit(dataset.batch(4096))   # in-batch negatives of 4096, activations of 512
    ```
    """

    @staticmethod
    def _keras_of_arguments(model=None, *args, **kwargs):
        # One name for both Keras: a Keras 2 model gets the Keras 2 class.
        return flavours.keras_package_of(model) if flavours.is_keras2_object(model) else None

    @staticmethod
    def _make_keras2_class(keras2):
        from tfx_gradient_accumulator.accumulator.keras2 import gradient_cache as keras2_gradient_cache

        return keras2_gradient_cache.GradientCache

    def __init__(self, model, accum_steps, gather_across_replicas=False, **kwargs):
        super().__init__(**kwargs)
        options = CacheOptions(accum_steps, gather_across_replicas)
        self.accum_steps = options.accum_steps
        if not isinstance(model, keras.Model) or flavours.is_keras2_object(model):
            raise TypeError(f"`model` must be a Keras 3 `keras.Model`; received {type(model).__name__}.")
        self.model = model
        self.gather_across_replicas = validate_gather_across_replicas(model, options.gather_across_replicas)
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

        # What the loss reads beside the representations: this replica's, or when
        # gathering the global batch's (`gather` replaces them).
        scored = {"x": x, "y": y, "sample_weight": sample_weight}

        def score(whole):
            loss = self.compute_loss(y_pred=whole, training=True, **scored)
            return loss, self.optimizer.scale_loss(loss)

        def replay_state():
            for v, value in zip(state, saved):
                v.assign(value)

        gather = None
        if self.gather_across_replicas:
            def gather(whole):
                shares, gathered = _global_batch(whole, scored)
                scored.update(gathered)
                return _Scored(shares.whole["whole"], shares)

        loss, whole, grads = cache_passes.cached_gradients(
            lambda part: self.model(part, training=True), x, self.accum_steps, score, variables,
            after_pass_1=self._refuse_losses_added_while_running, before_pass_3=replay_state,
            gather=gather)
        with cache_passes.ready_for_update(grads):
            self.optimizer.apply_gradients(zip(grads, variables))
        # The loss is the global batch's on every replica when gathered; else the
        # share's, scaled by Keras for the replica.
        replicas = 1 if self.gather_across_replicas else tf.distribute.get_strategy().num_replicas_in_sync
        seam.loss_tracker(self).update_state(
            loss * replicas, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        return self.compute_metrics(x, y, whole, sample_weight=sample_weight)

    def test_step(self, data):
        """Keras' own, or when gathering the loss of the global batch (as one device
        scores it), so that `evaluate` and `fit`'s validation loss are one device's too."""
        if not self.gather_across_replicas:
            return super().test_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        shares, gathered = _global_batch(y_pred, {"x": x, "y": y, "sample_weight": sample_weight})
        loss = self.compute_loss(y_pred=shares.whole["whole"], training=False, **gathered)
        seam.loss_tracker(self).update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _refuse_what_would_not_be_exact(self):
        for layer in seam.flatten_layers(self.model):
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise ValueError(refusals.batch_norm_in_gradient_cache(layer.name))

    def _refuse_losses_added_while_running(self):
        regularized = sum(1 for v in self.trainable_variables if getattr(v, "regularizer", None) is not None)
        if len(self.losses) > regularized:
            raise ValueError(refusals.LOSSES_ADDED_WHILE_RUNNING)

    def get_config(self):
        return {**super().get_config(), "model": keras.saving.serialize_keras_object(self.model),
                "accum_steps": self.accum_steps, "gather_across_replicas": self.gather_across_replicas}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"))
        return cls(model, **config)


def is_gradient_cache(model) -> bool:
    """Deprecated: `isinstance(model, GradientCache)`, which holds for both Keras."""
    return isinstance(model, GradientCache)


def _global_batch(representations, scored):
    """The global batch of this replica's representations and of what the loss reads
    beside them ({"x", "y", "sample_weight"}, None where not given): the
    `across_replicas.GlobalBatch` (`whole["whole"]`: the representations), and
    `scored` with the given ones replaced by the global batch's."""
    given = {name: value for name, value in scored.items() if value is not None}
    shares = across_replicas.GlobalBatch({"whole": representations, **given})
    return shares, {**scored, **{name: shares.whole[name] for name in given}}


class _Scored:
    """The gathered representations, with the way back to this replica's rows."""

    def __init__(self, whole, shares):
        self.whole, self.own, self.replicas = whole, shares.own, shares.replicas


def _is_float(variable):
    return tf.as_dtype(variable.dtype).is_floating
