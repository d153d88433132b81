"""Checks of the numbers users pass, before any work starts.

Every message names the parameter, what it allows and what it received, so a
bad pipeline definition or hyperparameter fails where it is written.
"""

import numbers

_ALLOWED = {0: "a non-negative integer (0, 1, 2, ...)", 1: "a positive integer (1, 2, 3, ...)"}


def integer_at_least(value, name, minimum=1):
    """Returns `value` as an int if it is one (not a bool) and `>= minimum`; raises otherwise.

    TypeError for a value that is no integer (2.5, "4", True), ValueError for
    one that is too small.
    """
    allowed = _ALLOWED.get(minimum, f"an integer >= {minimum}")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"`{name}` must be {allowed}; received {value!r} of type {type(value).__name__}."
        )
    if value < minimum:
        raise ValueError(f"`{name}` must be {allowed}; received {value}.")
    return int(value)
