"""The refusal texts the Keras 3 and Keras 2 classes share (`GradientCache`, `GradientAccumulator`).

One place, so the two Keras give the same words for the same refusal.
"""

from __future__ import annotations

from typing import Any

LOSSES_ADDED_WHILE_RUNNING = (
    "GradientCache: the model adds losses while it runs (`add_loss`, an "
    "activity_regularizer); they would come from one micro-batch, not the batch. "
    "Put them into `compute_loss`, on the representations, or use weight "
    "regularizers (kernel_regularizer), which GradientCache handles exactly.")


def batch_norm_in_gradient_cache(layer_name: str) -> str:
    """`GradientCache` refuses a trainable BatchNormalization layer named `layer_name`."""
    return (f"GradientCache: layer {layer_name!r} is a BatchNormalization, whose training "
            "output depends on the other samples of its batch; it would normalize with "
            "micro-batch statistics, not the batch's. Use LayerNormalization, or freeze "
            "the layer (trainable=False).")


def names_no_optimizer(keras_name: str, optimizer: str, error: Exception) -> str:
    """`GradientAccumulator` was given a name that `<keras>.optimizers.get` refuses."""
    return f"`optimizer` names no {keras_name} optimizer: {optimizer!r} ({error})"


def not_an_optimizer(keras_name: str, package_name: str, optimizer: Any, name_example: str = "") -> str:
    """`GradientAccumulator` was given something that is not an optimizer of its Keras.

    Args:
        keras_name: "Keras 3" or "Keras 2".
        package_name: the Keras package's module name ("keras", "tf_keras").
        optimizer: what was given.
        name_example: said after "or the name of one", e.g. " (for example 'adam')".
    """
    return (f"`optimizer` must be a {keras_name} optimizer instance (for example "
            f"`{package_name}.optimizers.Adam()`) or the name of one{name_example}; "
            f"received {optimizer!r} of type {type(optimizer).__name__}.")
