"""Exact large batches for losses that couple the batch: gradient caching (`GradientCache`).

A contrastive loss (in-batch negatives) scores every sample against every other, so
accumulating micro-batch gradients would be wrong by design. Gradient caching (Gao et al.,
2021) keeps the large batch exact with one micro-batch's activations at a time, in three
passes (`accumulator.cache.cache_passes`, shared with the Keras 2 class).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.cache import across_replicas, cache_passes
from tfx_gradient_accumulator.accumulator.cache.wrapped_model import WrappedModel
from tfx_gradient_accumulator.accumulator.core import flavours, rebuilding, refusals, seam
from tfx_gradient_accumulator.accumulator.core.options import CacheOptions


def validate_gather_across_replicas(model: keras.Model, gather_across_replicas: bool) -> bool:
    """Checks that the Keras 3 `model` can be scored over the global batch.

    Args:
        model: the wrapped model.
        gather_across_replicas: the option asked for.

    Returns:
        `gather_across_replicas`.

    Raises:
        ValueError: it is not a bool, or it is True and `model` has no `compute_loss`
            of its own (Keras scales a compiled loss per replica).
    """
    return across_replicas.refuse_gathering_with_a_compiled_loss(model, gather_across_replicas, keras.Model, "Keras")


@keras.saving.register_keras_serializable(package="accumulator")
class GradientCache(WrappedModel, keras.Model, metaclass=flavours.OneNameForBothKeras):
    """Trains `model` on each batch in `accum_steps` micro-batches with the whole batch's loss.

    Exact large batches for losses that couple the batch (in-batch negatives, InfoNCE,
    CLIP, SimCLR), holding one micro-batch's activations at a time, for one extra forward
    pass: (1) the model represents every micro-batch without a tape; (2) the whole
    batch's loss is scored on the concatenated representations under a tape; (3) each
    micro-batch runs again under a tape and sends its slice of that gradient back
    through the model. The optimizer applies the large batch's gradient once. So
    `fit(x, batch_size=N·b)` on `GradientCache(model, accum_steps=N)` trains like
    `fit(x, batch_size=N·b)` on `model`. Nothing is held between steps: any checkpoint
    resumes exactly.

    The loss is the wrapped model's `compute_loss(x, y, y_pred, sample_weight)` (its own
    override), or else the loss this wrapper is compiled with, `y_pred` being the whole
    batch's representations. Under a `tf.distribute` strategy each replica scores its
    own share, as Keras' large batch does (or the global batch: `gather_across_replicas`).
    Dropout and other random layers draw the same numbers in passes 1 and 3 (their
    seeds are rewound), but not those the large batch would draw.

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
            (`accumulator.cache.across_replicas`), so R replicas train like one device on
            the global batch. Costs one all-reduce of the representations, inputs
            and targets per step. Needs the model's own `compute_loss` (the loss of
            the batch it is given, as on one device); a compiled Keras loss is
            scaled per replica and refused here.
        **kwargs: passed on to `keras.Model` (`name`, ...).

    Raises:
        TypeError: `model` is not a Keras 3 model, or `accum_steps` is not an integer.
        ValueError: `accum_steps` < 1, `gather_across_replicas` is not a bool or the
            model has no `compute_loss` to gather with; in `fit`, before any training:
            a trainable `BatchNormalization` layer (it would normalize with micro-batch
            statistics) or losses added while the model runs (`add_loss`, activity
            regularizers: they would come from one micro-batch).

    A Keras 2 model (`tf_keras`, or `tf.keras` on TF 2.15) gets the Keras 2 class,
    `accumulator.keras2.gradient_cache.GradientCache`, with the same guarantees;
    `isinstance(x, GradientCache)` holds for both (`accumulator.core.flavours`).

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

    def __init__(self, model: keras.Model, accum_steps: int, gather_across_replicas: bool = False, **kwargs):
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

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training: bool = True) -> tf.Tensor:
        """The wrapped model's own `compute_loss`, or else Keras' (the compiled loss).

        Args:
            x: the batch's inputs.
            y: its targets.
            y_pred: the whole batch's representations.
            sample_weight: its sample weights.
            training: Keras' training flag.

        Returns:
            The batch's loss, a scalar tensor.
        """
        if type(self.model).compute_loss is not keras.Model.compute_loss:
            return self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        return super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)

    def train_step(self, data) -> dict:
        """One update from one batch, in the three passes.

        Args:
            data: the batch, `x` or `(x, y)` or `(x, y, sample_weight)`.

        Returns:
            The metrics' results, as Keras' `train_step` returns them.

        Raises:
            ValueError: the model holds a trainable `BatchNormalization` layer, or adds
                losses while it runs.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._refuse_what_would_not_be_exact()
        variables = self.trainable_variables
        if not self.optimizer.built and seam.in_xla_context():
            # Built outside the step: under XLA its variables could not be lifted
            # out of the passes' control dependencies.
            with tf.init_scope():
                self.optimizer.build(variables)
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

        gather = across_replicas.gathering(scored) if self.gather_across_replicas else None
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

    def test_step(self, data) -> dict:
        """Keras' own, or when gathering the loss of the global batch (as one device scores it).

        So that `evaluate` and `fit`'s validation loss are one device's too.

        Args:
            data: the batch, `x` or `(x, y)` or `(x, y, sample_weight)`.

        Returns:
            The metrics' results.
        """
        if not self.gather_across_replicas:
            return super().test_step(data)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        shares, gathered = across_replicas.global_batch(y_pred, {"x": x, "y": y, "sample_weight": sample_weight})
        loss = self.compute_loss(y_pred=shares.whole["whole"], training=False, **gathered)
        seam.loss_tracker(self).update_state(loss, sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _refuse_what_would_not_be_exact(self):
        """Refuses trainable `BatchNormalization` layers (micro-batch statistics)."""
        for layer in seam.flatten_layers(self.model):
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise ValueError(refusals.batch_norm_in_gradient_cache(layer.name))

    def _refuse_losses_added_while_running(self):
        """Refuses losses beyond weight regularization: they would come from one micro-batch."""
        regularized = sum(1 for v in self.trainable_variables if getattr(v, "regularizer", None) is not None)
        if len(self.losses) > regularized:
            raise ValueError(refusals.LOSSES_ADDED_WHILE_RUNNING)

    def get_config(self) -> dict:
        """The wrapped model (serialized), `accum_steps` and `gather_across_replicas`."""
        return {**super().get_config(), "model": keras.saving.serialize_keras_object(self.model),
                "accum_steps": self.accum_steps, "gather_across_replicas": self.gather_across_replicas}

    @classmethod
    def from_config(cls, config: dict) -> GradientCache:
        """Rebuilds it from `get_config()` (`core.rebuilding`)."""
        return rebuilding.rebuilt_from_config(cls, config, "model", keras.saving.deserialize_keras_object)


def is_gradient_cache(model: object) -> bool:
    """Deprecated: `isinstance(model, GradientCache)`, which holds for both Keras.

    Args:
        model: any object.

    Returns:
        Whether it is a `GradientCache` of either Keras.
    """
    return isinstance(model, GradientCache)


def _is_float(variable):
    """Whether `variable` holds floats (frozen weights, not seeds and counters)."""
    return tf.as_dtype(variable.dtype).is_floating
