"""Gives the accumulator the epoch ends that Keras `fit` does not tell an optimizer.

An optimizer sees gradients, never epochs, so on its own a `GradientAccumulator`
could not close the window left open when an epoch ends mid-window (the
large-batch run's short last batch). `install()` wraps `keras.Model.fit` once:
when the model's optimizer is a `GradientAccumulator`, `fit` gets an
`accumulator.callbacks.EpochWindows` callback, first in its list, so the window
is closed (as the optimizer's `partial_window` says) before validation,
checkpoints, early stopping or any other callback looks at the weights. A
callback of that kind the user passes (for example an `AccumulationSchedule`)
is moved to the front instead of being doubled. The model's
`AccumBatchNormalization` layers are tied to the optimizer's windows too.
Models compiled with any other optimizer train exactly as before.
"""

import functools
import inspect

import keras

_MARK = "_accumulator_epoch_windows"


def install():
    """Wraps `keras.Model.fit` (idempotent)."""
    fit = keras.Model.fit
    if getattr(fit, _MARK, False):
        return
    signature = inspect.signature(fit)

    @functools.wraps(fit)
    def fit_with_epoch_windows(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.arguments["callbacks"] = with_epoch_windows(self, bound.arguments.get("callbacks"))
        return fit(*bound.args, **bound.kwargs)

    setattr(fit_with_epoch_windows, _MARK, True)
    keras.Model.fit = fit_with_epoch_windows


def with_epoch_windows(model, callbacks):
    """`callbacks` with an `EpochWindows` first, if `model` trains with an accumulator."""
    from accumulator.batch_norm import configure_batch_norm
    from accumulator.callbacks import EpochWindows
    from accumulator.optimizer import GradientAccumulator

    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, GradientAccumulator) or optimizer._passthrough:
        return callbacks
    # Window-pooling layers follow the optimizer's windows.
    configure_batch_norm(model, optimizer.accum_steps, optimizer)
    as_list = isinstance(callbacks, keras.callbacks.CallbackList)
    items = callbacks.callbacks if as_list else list(callbacks or [])
    ours = [c for c in items if isinstance(c, EpochWindows)]
    if not ours:
        ours = [EpochWindows()]
        if as_list:     # Keras configured the others already
            ours[0].set_model(model)
            ours[0].set_params(getattr(callbacks, "params", None) or {})
    ordered = ours + [c for c in items if not isinstance(c, EpochWindows)]
    if as_list:
        items[:] = ordered
        return callbacks
    return ordered
