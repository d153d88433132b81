"""`GradientCache` for Keras 2: `tf_keras` (TF >= 2.16) or `tf.keras` on TF <= 2.15.

The three passes are the Keras 3 class's (`accumulator.cache.cache_passes`); this module holds
what Keras 2 does differently: its loss and logs, its loss scaling, its sparse rows, and
its refusals (random layers among them). Made by `accumulator.GradientCache(model, ...)`
for a Keras 2 model; a TensorFlow Recommenders model goes to `keras2.task_cache`.
"""

from __future__ import annotations

import functools

from tfx_gradient_accumulator.accumulator.cache import across_replicas, cache_passes
from tfx_gradient_accumulator.accumulator.cache.wrapped_model import WrappedModel
from tfx_gradient_accumulator.accumulator.core import flavours, rebuilding, refusals, seam
from tfx_gradient_accumulator.accumulator.keras2 import task_cache
from tfx_gradient_accumulator.accumulator.core.options import CacheOptions

keras2 = flavours.keras2_module()
if keras2 is None:
    raise ImportError(
        "accumulator.keras2.gradient_cache needs Keras 2: `pip install tf_keras` (TensorFlow "
        ">= 2.16) or TensorFlow <= 2.15, whose tf.keras is Keras 2."
    )

_RANDOM_LAYERS = tuple(getattr(keras2.layers, name) for name in
                       ("Dropout", "GaussianNoise", "GaussianDropout", "AlphaDropout")
                       if hasattr(keras2.layers, name))


def validate_gather_across_replicas(model, gather_across_replicas: bool) -> bool:
    """`gather_across_replicas`, checked for the Keras 2 `model` as the Keras 3 class checks its
    own (`accumulator.gradient_cache.validate_gather_across_replicas`): a ValueError where it
    is not a bool, or where it is True and `model` has neither a `compute_loss` of its own
    nor a TensorFlow Recommenders task (Keras 2 scales a compiled loss per replica, for the
    replica's share)."""
    return across_replicas.refuse_gathering_with_a_compiled_loss(
        model, gather_across_replicas, keras2.Model, "Keras 2",
        scores_the_batch_itself=gather_across_replicas is True and task_cache.find_task(model) is not None)


@keras2.utils.register_keras_serializable(package="accumulator")
class GradientCache(WrappedModel, keras2.Model):
    """Trains a Keras 2 `model` on each batch in `accum_steps` micro-batches with the whole batch's loss.

    Exact large batches for losses that couple the batch, in the Keras 3 class's three
    passes. What Keras 2 does differently: the loss is the model's `compute_loss`
    override, or else the compiled loss with the model's regularization losses, as
    Keras 2's own `train_step` computes it; a `mixed_float16` model's
    `LossScaleOptimizer` scales passes 2 and 3 and skips a non-finite step; Keras 2's
    optimizers merge repeated rows themselves, as for the large batch. A TensorFlow
    Recommenders model (`tfrs.Model`) has its task score the whole batch. Under a
    strategy, `gather_across_replicas=True` scores the global batch on every replica,
    as the Keras 3 class does.

    ```python
    import tf_keras as keras          # or tf.keras with TF_USE_LEGACY_KERAS=1, or TF <= 2.15
    from tfx_gradient_accumulator.accumulator import GradientCache

    model = GradientCache(two_tower, accum_steps=8)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    model.fit(dataset.batch(4096))   # in-batch negatives of 4096, activations of 512
    ```

    Args:
        model: a Keras 2 model whose outputs (any structure of tensors whose first
            axis is the batch) are what the loss scores. Unchanged: its
            `compute_loss`, if it overrides one, is the loss.
        accum_steps: micro-batches per batch (positive int), as for the Keras 3 class.
        gather_across_replicas: under a `tf.distribute` strategy with R replicas,
            `False` (the default) scores each replica's share alone, as Keras 2's (and
            TFRS's) own large batch does under the strategy; `True` scores the whole
            global batch on every replica (`accumulator.cache.across_replicas`), so R
            replicas train like one device on the global batch: the model's own
            `compute_loss` (the loss of the batch it is given), or a TFRS model's
            task, whose `SUM_OVER_BATCH_SIZE` loss is then the global batch's mean.
        **kwargs: passed on to Keras 2's `Model` (`name`, ...; `dtype` defaults to
            the model's precision policy).

    Raises:
        TypeError: `model` is not a Keras 2 model, or `accum_steps` is not an integer.
        ValueError: `accum_steps` < 1, `gather_across_replicas` is not a bool or the
            model has neither a `compute_loss` of its own nor a TFRS task; in `fit`,
            before any training: a trainable batch normalization, random layers
            (`Dropout`, `GaussianNoise`, ...: Keras 2's generators cannot replay a
            draw), activity regularizers or other losses added while the model runs.
    """

    def __init__(self, model, accum_steps: int, gather_across_replicas: bool = False, **kwargs):
        if not isinstance(model, keras2.Model):
            raise TypeError(f"`model` must be a Keras 2 `{keras2.__name__}.Model`; received "
                            f"{type(model).__name__}.")
        options = CacheOptions(accum_steps, gather_across_replicas)
        # The model's precision policy: `compile` then wraps the optimizer of a
        # mixed_float16 model in a LossScaleOptimizer, as for the model itself.
        kwargs.setdefault("dtype", model.dtype_policy)
        super().__init__(**kwargs)
        self.accum_steps = options.accum_steps
        self.model = model
        # A TensorFlow Recommenders model: its task scores the whole batch (`task_cache`).
        self._task_attribute = task_cache.find_task(model)
        self.gather_across_replicas = validate_gather_across_replicas(model, options.gather_across_replicas)
        # Built with the model: `fit` never calls the wrapper itself, and loading
        # restores the optimizer's state only onto a built model's variables.
        # A TFRS model has no `call` to build with: its towers build inside `compute_loss`.
        self.built = model.built or self._task_attribute is not None

    def _validate_compile(self, optimizer, metrics, **kwargs):
        """Keras 2's own check at `compile`. Under a distribution strategy it checks
        that a built model's variables were created in the strategy's scope, reading
        `variables`, which raises for a TFRS tower not built yet (TFRS towers build
        inside `compute_loss`, at the first step). TFRS's own model, not built, skips
        that check: so does this wrapper of a TFRS model, which the check sees built
        or not as the TFRS model is. (This hook, not `compile`, is overridden: Keras 2
        does not compile a loaded model whose class overrides `compile`.)"""
        if self._task_attribute is None:
            return super()._validate_compile(optimizer, metrics, **kwargs)
        built, self.built = self.built, self.model.built
        try:
            return super()._validate_compile(optimizer, metrics, **kwargs)
        finally:
            self.built = built

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
        """The wrapped model's own `compute_loss`, or else Keras 2's (the compiled loss).

        Args:
            x: the batch's inputs.
            y: its targets.
            y_pred: the whole batch's representations.
            sample_weight: its sample weights.

        Returns:
            The batch's loss, a scalar tensor.
        """
        if type(self.model).compute_loss is not keras2.Model.compute_loss:
            return self.model.compute_loss(x, y, y_pred, sample_weight)
        return super().compute_loss(x, y, y_pred, sample_weight)

    def train_step(self, data) -> dict:
        """One update from one batch, in the three passes.

        Args:
            data: the batch, `x` or `(x, y)` or `(x, y, sample_weight)`.

        Returns:
            The metrics' results, as Keras 2's `train_step` returns them.

        Raises:
            ValueError: the model holds a layer or a loss that would not be exact.
        """
        self._refuse_what_would_not_be_exact()
        if self._task_attribute is not None:
            return task_cache.train_step(self, data, self._task_attribute)
        x, y, sample_weight = keras2.utils.unpack_x_y_sample_weight(data)
        optimizer = self.optimizer
        scaling = isinstance(optimizer, keras2.mixed_precision.LossScaleOptimizer)

        # What the loss reads beside the representations: this replica's, or when
        # gathering the global batch's (`gather` replaces them).
        scored = {"x": x, "y": y, "sample_weight": sample_weight}

        def score(whole):
            loss = self.compute_loss(y_pred=whole, **scored)
            return loss, optimizer.get_scaled_loss(loss) if scaling else loss

        gather = across_replicas.gathering(scored) if self.gather_across_replicas else None
        variables = self.trainable_variables
        _, whole, grads = cache_passes.cached_gradients(
            lambda part: self.model(part, training=True), x, self.accum_steps, score, variables,
            after_pass_1=self._refuse_losses_added_while_running, gather=gather)
        if scaling:
            grads = optimizer.get_unscaled_gradients(grads)
        with cache_passes.ready_for_update(grads):
            optimizer.apply_gradients(zip(grads, variables))
        return self.compute_metrics(x, y, whole, sample_weight)

    def test_step(self, data) -> dict:
        """Keras 2's own, or a TFRS model's own evaluation; when gathering, the loss
        of the global batch (as one device scores it).

        Args:
            data: the batch.

        Returns:
            The metrics' results.
        """
        if self._task_attribute is not None:
            if self.gather_across_replicas:
                return task_cache.test_step(self, data, self._task_attribute)
            # A TFRS model has no `call`: its own evaluation (`compute_loss` with
            # training=False, its metrics and logs), as TFRS's `evaluate` runs it.
            return self.model.test_step(data)
        if not self.gather_across_replicas:
            return super().test_step(data)
        x, y, sample_weight = keras2.utils.unpack_x_y_sample_weight(data)
        y_pred = self(x, training=False)
        shares, gathered = across_replicas.global_batch(y_pred, {"x": x, "y": y, "sample_weight": sample_weight})
        self.compute_loss(y_pred=shares.whole["whole"], **gathered)
        return self.compute_metrics(x, y, y_pred, sample_weight)

    def _refuse_what_would_not_be_exact(self):
        """Refuses batch normalization, random layers and activity regularizers."""
        for layer in self.model.submodules:
            if not isinstance(layer, keras2.layers.Layer):
                continue
            if _is_batch_norm(layer) and layer.trainable:
                raise ValueError(refusals.batch_norm_in_gradient_cache(layer.name))
            if isinstance(layer, _RANDOM_LAYERS):
                raise ValueError(
                    f"GradientCache: layer {layer.name!r} is a {type(layer).__name__}, which draws "
                    "random numbers in training; Keras 2's random layers cannot replay a draw, so "
                    "the second forward pass of each micro-batch would draw other numbers than the "
                    "first and its gradient would be wrong. Remove the layer, or use Keras 3, whose "
                    "seed generators GradientCache rewinds.")
            if getattr(layer, "activity_regularizer", None) is not None:
                raise ValueError(
                    f"GradientCache: layer {layer.name!r} has an activity_regularizer, a loss added "
                    "while the model runs; it would come from one micro-batch, not the batch. Put it "
                    "into `compute_loss`, on the representations.")

    def _refuse_losses_added_while_running(self):
        """Refuses losses beyond weight regularization: they would come from one micro-batch."""
        if len(self.model.losses) > seam.keras2_weight_regularization_count(self.model):
            raise ValueError(refusals.LOSSES_ADDED_WHILE_RUNNING)

    def get_config(self) -> dict:
        """The name, the wrapped model (serialized), `accum_steps` and `gather_across_replicas`."""
        return {"name": self.name, "model": keras2.utils.serialize_keras_object(self.model),
                "accum_steps": self.accum_steps, "gather_across_replicas": self.gather_across_replicas}

    @classmethod
    def from_config(cls, config: dict, custom_objects: dict | None = None) -> GradientCache:
        """Rebuilds it from `get_config()`, the wrapped model with `custom_objects` (`core.rebuilding`)."""
        deserialize = functools.partial(keras2.utils.deserialize_keras_object, custom_objects=custom_objects)
        return rebuilding.rebuilt_from_config(cls, config, "model", deserialize)


def _is_batch_norm(layer):
    """Keras 2's batch normalizations (`BatchNormalization`, `SyncBatchNormalization`,
    the V1 layer) share a base class that Keras 2 does not export: known by name."""
    return any(klass.__name__.startswith(("BatchNormalization", "SyncBatchNormalization"))
               for klass in type(layer).__mro__)
