"""What the Trainer changes in Keras and TensorFlow while it runs a run_fn: the component's one place.

`strategies_made_map_onto`: the strategies a run_fn constructs stand in for the
executor's; `fits_stopped`: `Model.fit` raises `FitReached` (for `verify_exactness`'s
probe); `fits_routed`: the run_fn's `Model.fit` goes elsewhere (`accum_steps="fit"`'s
out-of-memory recovery, `components.out_of_memory`). Each is restored when its context
closes; the library's own changes are `accumulator.hooks`.
"""

import contextlib
import functools
import inspect
import logging

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import hooks
from tfx_gradient_accumulator.accumulator.core import flavours

logger = logging.getLogger(__name__)

# The strategies a run_fn may construct, as `tf.distribute` names them: each becomes
# the executor's (synchronous replicas, as these are); the refused ones would train
# differently (parameter servers, a central copy of the variables, TPUs).
MAPPED_STRATEGIES = ("MirroredStrategy", "OneDeviceStrategy", "MultiWorkerMirroredStrategy",
                     "experimental.MultiWorkerMirroredStrategy")
REFUSED_STRATEGIES = ("experimental.CentralStorageStrategy", "experimental.ParameterServerStrategy",
                      "TPUStrategy", "experimental.TPUStrategy")


def _strategy_classes(names):
    """`{name: class}` of the `tf.distribute` strategies this TensorFlow has, each class once."""
    found = {}
    for name in names:
        owner = tf.distribute
        for part in name.split("."):
            owner = getattr(owner, part, None)
        if isinstance(owner, type) and owner not in found.values():
            found[name] = owner
    return found


def is_stand_in(candidate: object, strategy: tf.distribute.Strategy) -> bool:
    """Whether `candidate` is a strategy made inside `strategies_made_map_onto(strategy)`.

    Args:
        candidate: any object.
        strategy: the executor's strategy.

    Returns:
        True for a stand-in (not `strategy` itself).
    """
    return candidate is not strategy and getattr(candidate, "__dict__", None) is strategy.__dict__


@contextlib.contextmanager
def strategies_made_map_onto(strategy: tf.distribute.Strategy):
    """Context: a strategy of `MAPPED_STRATEGIES` constructed inside it stands in for
    `strategy` (its class, its state, its scope).

    Enter it inside `accumulating_compile(strategy=...)` (or `hooks.strategy_scopes_map_onto`):
    a stand-in's `scope()` then reaches the library's mapping as `strategy` itself,
    which warns only of strategies the run_fn did not get from here. A module written
    for the stock Trainer (TFX's penguin example makes `MirroredStrategy()`) so trains
    under the strategy the run was sized for, and never builds a second strategy
    beside a `MultiWorkerMirroredStrategy` (TF 2.16 segfaults).

    Args:
        strategy: the executor's strategy.

    Raises:
        ValueError: inside, when the run_fn constructs a strategy that would train
            differently (`REFUSED_STRATEGIES`: parameter servers, a central copy of
            the variables, TPUs).

    Raises:
        ValueError: when one of `REFUSED_STRATEGIES` is constructed inside; it names it.
    """
    described = f"{type(strategy).__name__} ({strategy.num_replicas_in_sync} replica(s))"

    def stand_in(original, name):
        def __init__(self, *args, **kwargs):
            logger.warning("run_fn constructed tf.distribute.%s; it trains under the executor's %s instead.",
                           name, described)
            self.__class__ = type(strategy)
            self.__dict__ = strategy.__dict__

        return __init__

    def refuse(original, name):
        def __init__(self, *args, **kwargs):
            raise ValueError(
                f"run_fn constructed tf.distribute.{name}, which AccumulatingTrainer cannot honour: it trains "
                f"every run_fn under its own synchronous strategy, here {described}, which a MirroredStrategy, "
                "OneDeviceStrategy or MultiWorkerMirroredStrategy made in the run_fn becomes. Remove the "
                "strategy from the run_fn (the executor picks one from TF_CONFIG and the devices; its "
                f"`strategy` parameter chooses one of those kinds), or train this module with the stock Trainer.")

        return __init__

    def scope(original):
        def scope(self):
            return original(strategy if is_stand_in(self, strategy) else self)

        return scope

    with contextlib.ExitStack() as stack:
        for make, names in ((stand_in, MAPPED_STRATEGIES), (refuse, REFUSED_STRATEGIES)):
            for name, cls in _strategy_classes(names).items():
                stack.enter_context(hooks.swapped(cls, "__init__", functools.partial(make, name=name)))
        stack.enter_context(hooks.swapped(tf.distribute.Strategy, "scope", scope))
        yield


@contextlib.contextmanager
def under_strategy(strategy: tf.distribute.Strategy = None):
    """Context: `strategy`'s scope, its scopes mapped, its stand-ins made, as training has them.

    In the order the executor's training has them (`accumulating_compile(strategy=...)`,
    then `strategies_made_map_onto`).

    Args:
        strategy: the executor's strategy; None changes nothing.
    """
    with contextlib.ExitStack() as stack:
        if strategy is not None:
            if strategy is not tf.distribute.get_strategy() or tf.distribute.has_strategy():
                stack.enter_context(strategy.scope())
                stack.enter_context(hooks.strategy_scopes_map_onto(strategy))
            stack.enter_context(strategies_made_map_onto(strategy))
        yield


class FitReached(Exception):
    """Raised by `Model.fit` inside `fits_stopped()`: the run_fn's model and data are known, nothing trained."""

    def __init__(self, model, x, y, batch_size):
        """Holds what `fit` was called with.

        Args:
            model: the model `fit` was called on.
            x: `fit`'s `x`.
            y: `fit`'s `y`.
            batch_size: `fit`'s `batch_size`.
        """
        super().__init__("fit reached")
        self.model, self.x, self.y, self.batch_size = model, x, y, batch_size


def _fit_that_stops(original):
    """A `fit` that raises `FitReached` instead of training."""
    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        raise FitReached(self, x, y, batch_size)

    return fit


@contextlib.contextmanager
def fits_stopped():
    """Context: `Model.fit` (Keras 3's, and Keras 2's where installed) raises `FitReached`."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(hooks.swapped(keras.Model, "fit", _fit_that_stops))
        keras2 = flavours.keras2_module()
        if keras2 is not None and keras2.Model is not keras.Model:
            stack.enter_context(hooks.swapped(keras2.Model, "fit", _fit_that_stops))
        yield


@contextlib.contextmanager
def fits_routed(route):
    """Context: `keras.Model.fit` called by the run_fn goes to `route(fit, model, arguments)`.

    `fit` is the `Model.fit` it replaced (the library's, and a backup's where one is on),
    `arguments` the call's, bound by name with `fit`'s defaults. A `fit` that `route`
    itself calls (a driver's) is the replaced one: only the run_fn's calls are routed.

    Args:
        route: the callable above, or None: nothing changes.
    """
    if route is None:
        yield
        return
    routing = []        # non-empty while a routed fit runs

    def make(original):
        signature = inspect.signature(inspect.unwrap(original))     # Keras' own parameters

        @functools.wraps(original)
        def fit(self, *args, **kwargs):
            if routing:
                return original(self, *args, **kwargs)
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            arguments = {k: v for k, v in bound.arguments.items() if k != "self"}
            arguments.update(arguments.pop("kwargs", None) or {})
            routing.append(self)
            try:
                return route(original, self, arguments)
            finally:
                routing.pop()

        return fit

    with hooks.swapped(keras.Model, "fit", make):
        yield
