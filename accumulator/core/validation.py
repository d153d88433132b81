"""Checks of the numbers users pass, before any work starts.

Every message names the parameter, what it allows and what it received, so a
bad pipeline definition or hyperparameter fails where it is written.
"""

import math
import numbers

_ALLOWED = {0: "a non-negative integer (0, 1, 2, ...)", 1: "a positive integer (1, 2, 3, ...)"}


def integer_at_least(value, name: str, minimum: int = 1) -> int:
    """Checks an integer parameter.

    Args:
        value: the value given.
        name: the parameter's name, for the message.
        minimum: the smallest value allowed.

    Returns:
        `value` as an int.

    Raises:
        TypeError: `value` is no integer (2.5, "4", True).
        ValueError: `value` < `minimum`.
    """
    allowed = _ALLOWED.get(minimum, f"an integer >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be {allowed}; received {value!r} of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be {allowed}; received {value}.")
    return int(value)


# The noise scale's smoothing: checked with every option (core.options), used by noise/.
DEFAULT_SMOOTHING = 0.99


def validate_smoothing(smoothing: float, name: str = "smoothing") -> float:
    """Checks an EMA decay for the noise-scale estimate.

    Args:
        smoothing: the decay, a real number in [0, 1).
        name: the parameter's name, for the error message.

    Returns:
        `smoothing` as a float.

    Raises:
        ValueError: `smoothing` is not a finite real number in [0, 1) (a bool included).
    """
    allowed = "a float in [0, 1) (0 keeps only the last window; 0.99 averages over ~100 windows)"
    if (
        isinstance(smoothing, bool)
        or not isinstance(smoothing, numbers.Real)
        or not math.isfinite(smoothing)
        or not 0.0 <= smoothing < 1.0
    ):
        raise ValueError(f"`{name}` must be {allowed}; received {smoothing!r}.")
    return float(smoothing)
