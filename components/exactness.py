"""`AccumulatingTrainer(options=TrainerOptions(verify_exactness=...))`: `check_exact` on the run_fn's model, before training.

The run_fn runs up to its `fit` (`probe`), the model and data it reached are checked
(`verify`), the random state is put back, and the verdict (`exactness`,
`exactness_max_delta`, `exactness_detail`) is recorded on the artifacts (`record`);
"refuse" stops before training unless the verdict is "exact".
"""

from __future__ import annotations

import copy
import dataclasses
import tempfile
from typing import TYPE_CHECKING
from typing import Optional

import keras
import tensorflow as tf
from absl import logging
from tfx.types import standard_component_specs

from tfx_gradient_accumulator.accumulator.core import flavours, seam
from tfx_gradient_accumulator.accumulator.check import check_exact
from tfx_gradient_accumulator.components import run_fn_swaps

if TYPE_CHECKING:
    from collections.abc import Callable

VERIFY_EXACTNESS_KEY = "verify_exactness"
MODES = (False, True, "refuse")
UPDATES = 2
EXACT, DIFFERS, NOT_CHECKED = VERDICTS = ("exact", "differs", "not checked")
_STORED = {True: "record", "refuse": "refuse"}


def validate_mode(mode: bool | str | None) -> str | None:
    """`verify_exactness` as stored in the pipeline.

    Args:
        mode: False, True or "refuse" (or a stored value: None, "", "record").

    Returns:
        None (off), "record" or "refuse".

    Raises:
        ValueError: `mode` is none of those.
    """
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


def probe(run_fn: Callable, fn_args, strategy: tf.distribute.Strategy | None = None
          ) -> run_fn_swaps.FitReached | None:
    """Runs `run_fn` until its first `fit`.

    It runs as training will: under `strategy` (the executor's), with the strategies
    the run_fn constructs standing in for it, so the run_fn sees the replicas it
    will train on, and never makes a second strategy beside a
    `MultiWorkerMirroredStrategy` (TF 2.16 segfaults). On a cluster every process
    probes: building the model there runs collectives (its initial values come from
    the chief).

    Args:
        run_fn: the user's run_fn.
        fn_args: its `FnArgs` (copied; its output folders point at a scratch folder).
        strategy: the executor's strategy.

    Returns:
        The `run_fn_swaps.FitReached` of its first `fit`, or None if none came.
    """
    fn_args = copy.copy(fn_args)
    scratch = tempfile.mkdtemp(prefix="exactness-probe-")
    fn_args.serving_model_dir, fn_args.model_run_dir = f"{scratch}/serving", f"{scratch}/run"
    with run_fn_swaps.fits_stopped(), run_fn_swaps.under_strategy(strategy):
        try:
            run_fn(fn_args)
        except run_fn_swaps.FitReached as reached:
            return reached
    return None


def _check_arguments(reached, settings):
    """`check_exact`'s arguments from the model and data the run_fn reached `fit` with."""
    model = reached.model
    if getattr(model, "optimizer", None) is None or not getattr(model, "loss", None):
        raise ValueError("the run_fn's model was not compiled with an optimizer and a loss before `fit`")
    initial = model.get_weights()
    package = flavours.keras_package_of(model) if flavours.is_keras2_object(model) else keras

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


def _refuse(why):
    """Raises for "refuse" when nothing could be checked."""
    raise RuntimeError(
        f"AccumulatingTrainer(options=TrainerOptions(verify_exactness='refuse')) could not check the run_fn's model ({why}), "
        "so nothing was trained. Set verify_exactness=True to train anyway and record 'not checked'.")


def verify(run_fn: Callable, fn_args, settings, mode: str | None, strategy: tf.distribute.Strategy | None = None,
           role=None) -> Optional[Verdict]:
    """Runs the check when `mode` asks for it.

    On a cluster (`role.workers` > 1) every process probes the run_fn, the chief alone
    checks, and every process gets the chief's verdict (one collective), so all of
    them train, or all refuse. Whatever the check drew, the run's random state
    (seeds, generators) is put back as it was before the probe: the training that
    follows is the one without the check.

    Args:
        run_fn: the user's run_fn.
        fn_args: its `FnArgs`.
        settings: the run's resolved accumulation settings.
        mode: the stored `verify_exactness` (None, "record" or "refuse").
        strategy: the executor's strategy.
        role: this process's place in a cluster (None: one process).

    Returns:
        The `Verdict` to record, or None (off).

    Raises:
        RuntimeError: `mode` is "refuse" and the verdict is not "exact".
    """
    if not mode:
        return None
    if settings.gradient_cache:
        return _decide(_not_checked("gradient_cache=True trains each batch in one update: no window to compare"),
                       mode)
    if getattr(settings, "splits_in_step", False):
        return _decide(_not_checked(f"micro_batch_size={settings.micro_batch_size!r}: check_exact compares "
                                    "accum_steps' windows across fit steps, not micro-batches inside one step"),
                       mode)
    if settings.accum_steps < 2:
        return _decide(_not_checked(f"accum_steps={settings.accum_steps}: nothing accumulates"), mode)
    chief = role is None or role.chief
    logging.info("verify_exactness: running the run_fn up to its fit, then check_exact (%d updates, "
                 "accum_steps=%d)%s.", UPDATES, settings.accum_steps,
                 "" if chief else "; the chief checks, this process takes its verdict")
    before = keras.config.dtype_policy(), seam.random_state()
    try:
        verdict = _verdict(run_fn, fn_args, settings, strategy, chief)
    finally:
        forget_the_probe(before)
    if role is not None and role.workers > 1:
        verdict = _the_chiefs(verdict, strategy, chief)
    return _decide(verdict, mode)


def _not_checked(why):
    """The verdict "not checked", with why."""
    return Verdict(NOT_CHECKED, detail=why)


def _verdict(run_fn, fn_args, settings, strategy, chief):
    """This process's verdict (None on a process that is not the chief: it only probes)."""
    try:
        reached = probe(run_fn, fn_args, strategy)
        if not chief:
            return None
        if reached is None:
            return _not_checked("the run_fn never called Model.fit")
        report = check_exact(**_check_arguments(reached, settings))
    except Exception as err:      # noqa: BLE001 (any model the check cannot run on is reported, not fatal)
        return _not_checked(f"{type(err).__name__}: {err}") if chief else None
    logging.info("verify_exactness:\n%s", report)
    if report.exact:
        within = ("every variable within its limit, or as close to float64 arithmetic as Keras' large batch "
                  "(the arbiter)" if report.verdict == "exact-by-arbiter" else "every variable within its limit")
        return Verdict(EXACT, report.max_delta, f"{within}; {report.rule}", report)
    detail = ", ".join(f"{v.path} ({v.kind})" for v in report.differing)
    return Verdict(DIFFERS, report.max_delta, "; ".join([detail] + report.causes), report)


def _the_chiefs(verdict, strategy, chief):
    """The chief's exactness and max |dw|, on every process of the cluster (one all-reduce
    under the executor's strategy, to which only the chief's first replica adds)."""
    mine = [float(VERDICTS.index(verdict.exactness)),
            -1.0 if verdict.max_delta is None else float(verdict.max_delta)] if chief else [0.0, 0.0]

    def share():
        first = tf.equal(tf.distribute.get_replica_context().replica_id_in_sync_group, 0)
        return tf.where(first, tf.constant(mine, tf.float64), tf.zeros(2, tf.float64))

    code, delta = strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(share), axis=None).numpy()
    if chief:
        return verdict
    exactness = VERDICTS[int(round(code))]
    verdict = Verdict(exactness, None if delta < 0 else float(delta),
                      "the chief could not check it; its log says why" if exactness == NOT_CHECKED
                      else "as the chief's check found; its log has the report")
    logging.info("verify_exactness: the chief's verdict: %s (max |dw| %s).", verdict.exactness, verdict.max_delta)
    return verdict


def _decide(verdict, mode):
    """Logs the verdict; raises for "refuse" unless it is exact."""
    if verdict.exactness == EXACT:
        return verdict
    if verdict.exactness == NOT_CHECKED:
        if mode == "refuse":
            _refuse(verdict.detail)
        logging.warning("verify_exactness: not checked: %s.", verdict.detail)
        return verdict
    if mode == "refuse":
        report = verdict.report if verdict.report is not None else f"max |dw| {verdict.max_delta:.3g}"
        raise RuntimeError(
            "AccumulatingTrainer(options=TrainerOptions(verify_exactness='refuse')): accumulation does not train this model like "
            f"Keras' large batch ({verdict.detail}), so nothing was trained.\n{report}\nFix what the report "
            "names, or set verify_exactness=True to train anyway and record the verdict.")
    logging.warning("verify_exactness: accumulation differs from Keras' large batch: %s.", verdict.detail)
    return verdict


def forget_the_probe(before):
    """Keras' global state as before the check (or `accum_steps="fit"`'s probe) (layer names, the graph), so the run_fn's
    training sees its models named as without it; and as `before` (taken before the
    probe) the dtype policy, which clearing the session forgets, and the random state:
    the check seeds every generator, and the probe's run_fn drew from them."""
    policy, random_state = before
    keras.backend.clear_session()
    keras2 = flavours.keras2_module()
    if keras2 is not None and keras2.Model is not keras.Model:
        keras2.backend.clear_session()
    keras.config.set_dtype_policy(policy)
    seam.restore_random_state(random_state)


def record(output_dict: dict, verdict: Optional[Verdict]) -> None:
    """Sets `exactness`, `exactness_max_delta`, `exactness_detail` on the `model` and `model_run` artifacts.

    Args:
        output_dict: the executor's output artifacts, by key.
        verdict: what `verify` returned (None: nothing is recorded).
    """
    if verdict is None:
        return
    keys = (standard_component_specs.MODEL_KEY, standard_component_specs.MODEL_RUN_KEY)
    for artifact in [a for key in keys for a in output_dict.get(key, [])]:
        artifact.set_string_custom_property("exactness", verdict.exactness)
        if verdict.max_delta is not None:
            artifact.set_float_custom_property("exactness_max_delta", verdict.max_delta)
        artifact.set_string_custom_property("exactness_detail", verdict.detail)
