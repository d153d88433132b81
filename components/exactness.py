"""`AccumulatingTrainer(verify_exactness=...)`: `check_exact` on the run_fn's model, before training.

With `verify_exactness=True` (or "refuse") the executor first runs the user's
run_fn up to its `fit` call, without accumulation, and stops it there: the
model it compiled (architecture, initial weights, loss, optimizer) and the
training data it passes to `fit` (at the micro-batch, as training reads them)
are what `accumulator.check_exact` checks, on one device, for `UPDATES`
updates at the run's `accum_steps` (and `merge_duplicate_rows`). Then the run
trains as without the check. The verdict is recorded on the `model` and
`model_run` artifacts (ML Metadata, and `record.json`):

* `exactness`: "exact", "differs" or "not checked";
* `exactness_max_delta` (float): the largest max |Δw| over the model's variables;
* `exactness_detail`: the variables that differ with their kinds, or why nothing
  was checked.

`verify_exactness="refuse"` stops before training when the verdict is not
"exact" (a model that differs, or one the check cannot run on), with the report
in the message. Not checked: `gradient_cache=True` (no window to compare) and
`accum_steps=1` (nothing accumulates).
"""

import contextlib
import copy
import dataclasses
import tempfile
from typing import Optional

import keras
import tensorflow as tf
from absl import logging
from tfx.types import standard_component_specs

from tfx_gradient_accumulator.accumulator import hooks, seam
from tfx_gradient_accumulator.accumulator.check import check_exact

VERIFY_EXACTNESS_KEY = "verify_exactness"
MODES = (False, True, "refuse")
UPDATES = 2
_STORED = {True: "record", "refuse": "refuse"}


def validate_mode(mode):
    """`verify_exactness` as stored in the pipeline: None (off), "record" or "refuse"."""
    if mode is None or mode is False or mode == "":
        return None
    if mode is True or mode in ("record", "refuse"):
        return _STORED.get(mode, mode)
    raise ValueError(f"`verify_exactness` must be one of {MODES}; received {mode!r}.")


@dataclasses.dataclass(frozen=True)
class Verdict:
    """What is recorded: `exactness`, `max_delta`, `detail`; `report` the check's, if it ran."""

    exactness: str
    max_delta: Optional[float] = None
    detail: str = ""
    report: object = None


class _FitReached(Exception):
    """Raised by the probe's `fit`: the run_fn's model and data are known, nothing trained."""

    def __init__(self, model, x, y, batch_size):
        super().__init__("fit reached")
        self.model, self.x, self.y, self.batch_size = model, x, y, batch_size


def _fit_that_stops(original):
    def fit(self, x=None, y=None, batch_size=None, *args, **kwargs):
        raise _FitReached(self, x, y, batch_size)

    return fit


def probe(run_fn, fn_args):
    """Runs `run_fn` until its first `fit`; returns that `_FitReached`, or None if none came."""
    fn_args = copy.copy(fn_args)
    scratch = tempfile.mkdtemp(prefix="exactness-probe-")
    fn_args.serving_model_dir, fn_args.model_run_dir = f"{scratch}/serving", f"{scratch}/run"
    with _fits_stopped():
        try:
            run_fn(fn_args)
        except _FitReached as reached:
            return reached
    return None


@contextlib.contextmanager
def _fits_stopped():
    """`Model.fit` (Keras 3's, and Keras 2's where installed) raises `_FitReached` inside."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(hooks.swapped(keras.Model, "fit", _fit_that_stops))
        keras2 = seam.keras2_module()
        if keras2 is not None and keras2.Model is not keras.Model:
            stack.enter_context(hooks.swapped(keras2.Model, "fit", _fit_that_stops))
        yield


def _check_arguments(reached, settings):
    model = reached.model
    if getattr(model, "optimizer", None) is None or not getattr(model, "loss", None):
        raise ValueError("the run_fn's model was not compiled with an optimizer and a loss before `fit`")
    initial = model.get_weights()
    package = seam.keras_package_of(model) if seam.is_keras2_object(model) else keras

    def model_fn():
        clone = package.models.clone_model(model)
        clone.set_weights(initial)
        return clone

    optimizer = model.optimizer
    config, cls = optimizer.get_config(), type(optimizer)
    data = reached.x if isinstance(reached.x, tf.data.Dataset) else (reached.x, reached.y)
    return dict(model_fn=model_fn, data=data, optimizer_fn=lambda: cls.from_config(dict(config)),
                accum_steps=settings.accum_steps, loss=model.loss, updates=UPDATES,
                batch_size=None if isinstance(reached.x, tf.data.Dataset) else (reached.batch_size or 32),
                accumulator_options={"merge_duplicate_rows": settings.merge_duplicate_rows})


def _not_checked(why, mode):
    if mode == "refuse":
        raise RuntimeError(
            f"AccumulatingTrainer(verify_exactness='refuse') could not check the run_fn's model ({why}), "
            "so nothing was trained. Set verify_exactness=True to train anyway and record 'not checked'.")
    logging.warning("verify_exactness: not checked: %s.", why)
    return Verdict("not checked", detail=why)


def verify(run_fn, fn_args, settings, mode) -> Optional[Verdict]:
    """Runs the check when `mode` (the stored `verify_exactness`) asks for it; raises for
    "refuse" on anything but exact. Returns the `Verdict` to record, or None (off)."""
    if not mode:
        return None
    if settings.gradient_cache:
        return _not_checked("gradient_cache=True trains each batch in one update: no window to compare", mode)
    if settings.accum_steps < 2:
        return _not_checked(f"accum_steps={settings.accum_steps}: nothing accumulates", mode)
    logging.info("verify_exactness: running the run_fn up to its fit, then check_exact (%d updates, "
                 "accum_steps=%d).", UPDATES, settings.accum_steps)
    try:
        reached = probe(run_fn, fn_args)
        if reached is None:
            return _not_checked("the run_fn never called Model.fit", mode)
        report = check_exact(**_check_arguments(reached, settings))
    except Exception as err:      # noqa: BLE001 (any model the check cannot run on is reported, not fatal)
        return _not_checked(f"{type(err).__name__}: {err}", mode)
    finally:
        _forget_the_check()
    logging.info("verify_exactness:\n%s", report)
    detail = ", ".join(f"{v.path} ({v.kind})" for v in report.differing)
    if report.exact:
        return Verdict("exact", report.max_delta, f"every variable within its limit; {report.rule}", report)
    if mode == "refuse":
        raise RuntimeError(
            "AccumulatingTrainer(verify_exactness='refuse'): accumulation does not train this model like "
            f"Keras' large batch ({detail}), so nothing was trained.\n{report}\nFix what the report names, "
            "or set verify_exactness=True to train anyway and record the verdict.")
    logging.warning("verify_exactness: accumulation differs from Keras' large batch: %s.", detail)
    return Verdict("differs", report.max_delta, "; ".join([detail] + report.causes), report)


def _forget_the_check():
    """Keras' global state as before the check (layer names, the graph), so the run_fn's
    training sees its models named as without it."""
    keras.backend.clear_session()
    keras2 = seam.keras2_module()
    if keras2 is not None and keras2.Model is not keras.Model:
        keras2.backend.clear_session()


def record(output_dict, verdict: Optional[Verdict]) -> None:
    """Sets `exactness`, `exactness_max_delta`, `exactness_detail` on the `model` and
    `model_run` artifacts."""
    if verdict is None:
        return
    keys = (standard_component_specs.MODEL_KEY, standard_component_specs.MODEL_RUN_KEY)
    for artifact in [a for key in keys for a in output_dict.get(key, [])]:
        artifact.set_string_custom_property("exactness", verdict.exactness)
        if verdict.max_delta is not None:
            artifact.set_float_custom_property("exactness_max_delta", verdict.max_delta)
        artifact.set_string_custom_property("exactness_detail", verdict.detail)
