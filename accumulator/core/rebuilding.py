"""How every wrapper comes back from its `get_config`, and how a wrapped optimizer comes from its name.

`GradientAccumulator` (around an optimizer) and `GradientCache` (around a model), in Keras 3
and in Keras 2, each save the object they wrap serialized under one key of their config,
beside their own arguments. Rebuilding is the same for all four: deserialize that object
with the saving Keras' own function, and call the class with it and the remaining
arguments, so that a saved config goes through the same checks as a new wrapper. Both
`GradientAccumulator`s also take their optimizer by name ("adam"): the saving Keras' own
`optimizers.get` makes it, and a name it refuses is refused in the same words for both.
"""

from __future__ import annotations

from typing import Any, Callable

from tfx_gradient_accumulator.accumulator.core import refusals


def rebuilt_from_config(cls: type, config: dict, wrapped_key: str, deserialize: Callable[[Any], Any]) -> Any:
    """`cls(deserialize(config[wrapped_key]), **the other entries of config)`.

    Args:
        cls: the wrapper's class (the one `from_config` was called on).
        config: what the wrapper's `get_config` returned (not changed).
        wrapped_key: the key of the wrapped object's serialized form ("optimizer", "model").
        deserialize: the Keras function that turns that form back into the object.

    Returns:
        The rebuilt wrapper.
    """
    config = dict(config)
    return cls(deserialize(config.pop(wrapped_key)), **config)


def optimizer_of_name(optimizer: Any, get: Callable[[str], Any], keras_name: str) -> Any:
    """`get(optimizer)` where `optimizer` is a name, else `optimizer` as given.

    Args:
        optimizer: what the wrapper was given: a name ("adam") or anything else.
        get: the Keras function that makes an optimizer from its name (`optimizers.get`).
        keras_name: the Keras, for the message ("Keras", "Keras 2").

    Returns:
        The optimizer the name makes, or `optimizer` itself (checked by the caller).

    Raises:
        ValueError: `get` refuses the name (the message names it and the Keras).
    """
    if not isinstance(optimizer, str):
        return optimizer
    try:
        return get(optimizer)
    except ValueError as err:
        raise ValueError(refusals.names_no_optimizer(keras_name, optimizer, err)) from None
