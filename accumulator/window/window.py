"""The accumulation window: the update rule every `GradientAccumulator` shares.

`AccumulationWindow` holds the update rule (`_update`: add `weight * grad`; when the
window is full, hand the window's mean to the inner optimizer once and reset), on the
state `window.state` declares (`WindowState`: the variables saved, `WindowVariables`,
and what Python notes, `WindowNotes`). What it shows is `window.readings`; what runs
between windows, `window.between_windows`; saving, `window_saving`; rows and replicas,
`accumulator.rows.window_rows` and `accumulator.core.replicas`.
"""

from __future__ import annotations

import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, replicas
from tfx_gradient_accumulator.accumulator.rows import window_rows
from tfx_gradient_accumulator.accumulator.noise import preconditioning, window_noise
from tfx_gradient_accumulator.accumulator.window import window_saving
from tfx_gradient_accumulator.accumulator.window.between_windows import BetweenWindows
from tfx_gradient_accumulator.accumulator.window.readings import WindowReadings
from tfx_gradient_accumulator.accumulator.window.state import WindowState
from tfx_gradient_accumulator.accumulator.core.options import (  # noqa: F401  (the validators' names here before options.py)
    AUTO_START_ACCUM_STEPS, DEFAULT_SMOOTHING, LOSS_REDUCTIONS, PARTIAL_WINDOW_MODES, SUMMED_NOISE_SCALE_MESSAGE,
    WindowOptions, refuse_unknown_arguments, validate_accum_steps, validate_auto, validate_loss_reduction,
    validate_measure_noise_scale, validate_merge_duplicate_rows, validate_partial_window,
)
from tfx_gradient_accumulator.accumulator.rows.window_rows import WindowRows  # noqa: F401  (also its public home)

# What `accumulator.window.weighting` notes for a loss that sums over its samples.
SUMMED_LOSS = "sum"

__all__ = [
    "AccumulationWindow", "DEFAULT_SMOOTHING", "PARTIAL_WINDOW_MODES", "optimizer_chain",
    "validate_accum_steps", "validate_partial_window", "validate_measure_noise_scale",
]


def optimizer_chain(optimizer) -> list:
    """`optimizer` and every optimizer it wraps (`inner_optimizer`, `optimizers`).

    Args:
        optimizer: a Keras 3 or Keras 2 optimizer.

    Returns:
        The optimizers, `optimizer` first.
    """
    chain, todo = [], [optimizer]
    while todo:
        current = todo.pop(0)
        if current is None or any(current is known for known in chain):
            continue
        chain.append(current)
        todo.append(getattr(current, "inner_optimizer", None))
        try:
            todo.extend(getattr(current, "optimizers", None) or [])
        except AttributeError:
            pass
    return chain


def refuse_nested_accumulation(optimizer) -> None:
    """Refuses an optimizer that already accumulates (ours, or Keras' own steps).

    Args:
        optimizer: the optimizer to wrap.

    Raises:
        TypeError: it (or one it wraps) is a `GradientAccumulator`.
        ValueError: it was built with Keras' own `gradient_accumulation_steps`.
    """
    for inner in optimizer_chain(optimizer):
        if isinstance(inner, AccumulationWindow):
            raise TypeError(
                "`optimizer` is already a GradientAccumulator; nest the accumulation "
                "by multiplying `accum_steps` instead."
            )
        if getattr(inner, "gradient_accumulation_steps", None):
            raise ValueError(
                f"`optimizer` ({type(inner).__name__}) was built with Keras' own "
                f"`gradient_accumulation_steps={inner.gradient_accumulation_steps}`, which "
                "would accumulate again inside every window; build it without that "
                "argument and set `accum_steps` on the GradientAccumulator "
                f"(accum_steps={inner.gradient_accumulation_steps} for the same window)."
            )


def _is_summed(noted_weight):
    """Whether the noted weight says the loss sums over its samples (`SUMMED_LOSS`)."""
    return isinstance(noted_weight, str) and noted_weight == SUMMED_LOSS


def _signs_of_the_micro_batch(weight, grads):
    """What the window's count waits on: tensors that exist only once the micro-batch does.

    The micro-batch's weight where it is computed from the batch (the loss's
    denominator the `compute_loss` hook hands over: the forward pass, not the
    backward one); else the gradient a backward pass makes first, the last
    variable's (the output layer's, where variables are in the layers' order), not
    the first one's, which waits on the whole pass.
    """
    if tf.is_tensor(weight) and tf.get_static_value(weight) is None:
        return [weight]
    return [g for g in grads if g is not None][-1:]


class AccumulationWindow(WindowReadings, BetweenWindows, window_saving.WindowSaving):
    """The window's update rule, on the state `WindowState` declares; mixed into each Keras' optimizer.

    Subclasses call `_init_window(...)` in their constructor and
    `_build_window(var_list)` in their `build`, route each micro-batch through
    `_apply_micro_batch` (which runs `_update`, the whole flow), and supply, in
    one place per Keras, `_new_variable` (a plain optimizer variable),
    `_hand_to_updater` (one inner update with an already reduced gradient),
    `_updates_without_reduction` (a context in which that holds) and
    `_window_gradient_scale` (the loss scale the sums carry). The state is `self._state`
    (`WindowState`); the options are attributes (`partial_window`, ...). What it
    shows is `WindowReadings`; what runs between windows (`close_partial_window`,
    `set_accum_steps`), `BetweenWindows`; saving, `window_saving.WindowSaving`.
    ``fit_callback`` (set by `accumulating_compile`) makes the window callback
    every `fit` uses; None: a plain `EpochWindows`.
    """

    # ------------------------------------------------------------------ setup
    def _init_window(self, options: WindowOptions):
        """Sets up the (unbuilt) window from its checked options."""
        # The options, checked once (`accumulator.core.options`); each is also a read-only
        # property of its own name (`partial_window`, `schedulable`, ...: `WindowReadings`).
        self._untracked(options=options)
        self._accum_steps = options.accum_steps
        # accum_steps="auto": the rule (`AutoAccumulation`) is made by the first `fit`
        # (`accumulator.fit_hook`), which knows the micro-batch, and kept here: its
        # decisions carry on into a later `fit` and into a `TrainingBackup`.
        self.auto_accumulation = None
        # Makes the window callback `fit` puts first (set by `accumulating_compile`).
        self.fit_callback = None
        self._untracked(_state=WindowState())

    def _build_window(self, var_list):
        """Creates the window's variables for `var_list` (the model's trainable variables)."""
        measuring = self.measure_noise_scale and not self.is_passthrough
        self._state.build(var_list, self._new_variable, self._accum_steps, self.is_passthrough,
                          self.noise_scale_smoothing if measuring else None,
                          preconditioning.preconditioner_of(self.inner_optimizer) if measuring else None)

    # ------------------------------------------------------- the update rule
    def note_micro_batch_weight(self, weight, samples=None):
        """Hands over the loss denominator D_k of the micro-batch whose gradients come next.

        The `compute_loss` hook calls it (`accumulator.window.weighting.note_batch`);
        `_apply_micro_batch` takes it, in the same thread and graph
        (`WindowNotes.noted_weight`). An explicit `micro_batch_weight` wins.

        Args:
            weight: the micro-batch's loss denominator.
            samples: its samples (the noise scale's unit), or None: `weight`.
        """
        self._state.notes.noted_weight.hand_over(weight, samples)

    def _apply_micro_batch(self, grads, variables, micro_batch_weight=None):
        """One micro-batch of `grads` for `variables` (built optimizer), weighed by
        `micro_batch_weight` or else by what the `compute_loss` hook handed over."""
        noted, noted_samples = self._state.notes.noted_weight.take()
        indices = [self._state.index_of(v) for v in variables]
        if not grads:
            return
        if self.is_passthrough:
            # Transparent: the inner optimizer sees exactly what it would alone. Its
            # count waits for the gradients: the step Keras runs on a dataset of
            # unknown size that has run out makes no update and counts none.
            with tf.control_dependencies([g.values if isinstance(g, tf.IndexedSlices) else g
                                          for g in grads if g is not None]):
                self._hand_to_updater(grads, variables, reduced=False)
            return
        self._state.notes.loop_notes.note_step(micro_batch_weight, noted, summed=self.loss_reduction == "sum")
        weight, divisor = self._micro_batch_weights(micro_batch_weight, noted)
        samples = None
        if micro_batch_weight is None and noted_samples is not None and not _is_summed(noted):
            # The noise scale counts samples; a zero weight (no sample counted) stays zero.
            samples = tf.where(tf.cast(weight, tf.float32) > 0.0, tf.cast(noted_samples, tf.float32), 0.0)
        self._update(grads, indices, weight, divisor=divisor, samples=samples)

    def _micro_batch_weights(self, micro_batch_weight, noted_weight):
        """(what the micro-batch's gradient is multiplied by, what it adds to the divisor).

        A loss that is a mean (S_k / D_k, `accumulator.window.weighting`) weighs D_k in
        both: the window's gradient is sum(D_k g_k) / sum(D_k). A loss that sums
        over its samples (reduction "sum" or "none": S_k) weighs 1, and the
        window divides by 1, not by its micro-batches: its gradient is sum(g_k),
        the large batch's sum. Under R replicas each replica adds 1 at the
        window's start, and the close divides the reduced weight by R.
        """
        summed = self.loss_reduction == "sum" or (
            self.loss_reduction == "auto" and micro_batch_weight is None and _is_summed(noted_weight))
        if summed:
            if self.measure_noise_scale:
                raise ValueError(SUMMED_NOISE_SCALE_MESSAGE)
            if micro_batch_weight is not None:
                raise ValueError(
                    "`micro_batch_weight` is for losses that are means; this GradientAccumulator "
                    "has loss_reduction='sum' (the window sums the micro-batches' gradients, "
                    "as the large batch sums its samples'): leave it out.")
            return 1.0, tf.cast(tf.equal(self._state.saved.micro_step, 0), tf.float32)
        if micro_batch_weight is None:
            micro_batch_weight = 1.0 if noted_weight is None or _is_summed(noted_weight) else noted_weight
        return micro_batch_weight, micro_batch_weight

    def _update(self, grads, indices, weight=1.0, close_only=False, divisor=None, samples=None):
        """The window's whole flow: add a micro-batch, count it, and when the window is
        full close it: reduce it over the replicas, apply its mean, reset it.

        `close_only`: no micro-batch; close the window as it stands (a partial
        window's "apply"). Under a strategy, counting and closing run in
        cross-replica context, so the inner optimizer's own `merge_call` never
        sits inside a replica-context `cond`; the mean is applied in each replica.
        Without a strategy, `accumulator.core.replicas` is not entered.
        """
        saved, notes, distributed = self._state.saved, self._state.notes, tf.distribute.has_strategy()
        if distributed:
            replicas.refuse_cross_replica_context()
        with_grads = {i for g, i in zip(grads, indices) if g is not None}
        notes.with_grads |= with_grads
        if close_only:
            with_grads = set(notes.with_grads)
        else:
            # 1. Add: each replica adds `weight * grad` to its own buffers.
            self._accumulate(grads, indices, weight, weight if divisor is None else divisor, samples)

        def count_and_close(distribution):      # `distribution`: None without a strategy
            if close_only:
                full = saved.micro_step > 0
            else:
                # 2. Count, once the micro-batch exists: when the data runs out, `fit`
                # calls the step once more, and only ops that wait on the data fail.
                # Not on the whole backward pass: the close's condition is then known
                # (and on a GPU copied to the host) while the gradients are computed.
                _tf.assign_add_after(saved.micro_step, 1, after=_signs_of_the_micro_batch(weight, grads))
                full = saved.micro_step >= saved.accum_steps
            tf.cond(full, lambda: self._close(distribution, sorted(with_grads | notes.seen_in_window)), lambda: None)

        if distributed:
            replicas.in_cross_replica_context(count_and_close)
        else:
            count_and_close(None)

    def _accumulate(self, grads, indices, weight=1.0, divisor=1.0, samples=None):
        """Replica-local: adds `weight * grad` into the window's buffers, and `divisor`
        to the window's weight (see `_micro_batch_weights`); `samples` (None: `weight`)
        to the noise scale's sizes.

        A dense buffer gets its full shape on its first dense gradient, outside any
        graph (`_tf.fill_to`; a restored one keeps its sums). Sparse gradients go
        to their rows (`window_rows.keeps_rows`); `overwrite_with_gradient`
        variables keep the window's running maximum.
        """
        s, weight = self._state, tf.cast(weight, tf.float32)
        saved, notes = s.saved, s.notes
        for grad, index in zip(grads, indices):
            if grad is None:
                continue
            if tf.executing_eagerly():
                notes.seen_in_window.add(index)
            if index in s.overwrite_indices:
                _tf.keep_maximum(saved.accumulators[index], grad)
            elif isinstance(grad, tf.IndexedSlices) and window_rows.keeps_rows(
                    s, index, grad, self.merge_duplicate_rows or self.inner_sums_repeated_rows,
                    self.keeps_rows_across_replicas):
                notes.rows_seen.add(index)
                saved.rows[index].add(grad, weight, index in notes.once_per_batch, s.strategy)
            else:
                _tf.fill_to(saved.accumulators[index], tuple(s.variables[index].shape), s.strategy)
                notes.dense_seen.add(index)
                _tf.add_weighted(saved.accumulators[index], grad, weight)
        _tf.backing_variable(saved.weight_sum).assign_add(tf.cast(divisor, tf.float32), read_value=False)  # one kernel
        window_noise.add_micro_batch(s, grads, indices, weight, samples)

    # Whether the inner optimizer sums repeated rows of a sparse gradient itself
    # (Keras 2's do; Keras 3's apply them one by one).
    inner_sums_repeated_rows = False

    # Whether rows are kept under several replicas: only where the class saves
    # them itself (`window_state`), since a checkpoint reads replica 0's alone.
    keeps_rows_across_replicas = True

    def _close(self, distribution, used):
        """Closes the window (a `cond` branch, cross-replica context under a strategy).

        Which of the variables `used` close as dense sums and which as rows is
        decided as the close is traced: the buffers filled so far (also by a
        restored checkpoint) and the sparse gradients seen, the same on every
        worker. Without a strategy the local buffers are the sums (divided in
        place later: no second copy). Under one they are summed over the
        replicas in one batched all-reduce; the sums of Keras' scaled losses then
        carry each replica's 1/replicas, which the weight, summed the same way,
        divides out. Maxima (`overwrite_with_gradient`) are reduced in the replicas.
        """
        s = self._state
        saved, notes = s.saved, s.notes
        dense = [i for i in used if i in notes.dense_seen or (
            saved.rows[i] is None or s.variables[i].shape[0] != 1) and _tf.is_filled(
                saved.accumulators[i], tuple(s.variables[i].shape), s.strategy)]
        rows = [i for i in used if i in notes.rows_seen]
        sums = [_tf.backing_variable(saved.accumulators[i]) for i in dense]
        weight = _tf.backing_variable(saved.weight_sum)
        noise = window_noise.sums_to_reduce(s, distribution)
        if distribution is None:
            # 4. Apply the window's mean and 5. reset.
            self._apply_mean_and_reset(dense, rows, sums, weight, noise)
        else:
            # 3. Reduce: the sums and the weight, in one all-reduce; 4, 5 in each replica.
            summed = [k for k, i in enumerate(dense) if i not in s.overwrite_indices]
            first = s.variables[0]
            reduced = replicas.sum_over_replicas(
                distribution,
                [(sums[k], s.variables[dense[k]]) for k in summed] + [(weight, first)] + [(n, first) for n in noise])
            for k, total in zip(summed, reduced):
                sums[k] = total
            weight, noise = reduced[len(summed)], reduced[len(summed) + 1:]
            replicas.in_each_replica(distribution, self._updates_without_reduction,
                                     self._apply_mean_and_reset, dense, rows, sums, weight, noise)
        saved.micro_step.assign(0)
        notes.seen_in_window = set()

    def _apply_mean_and_reset(self, dense, rows, sums, weight_sum, noise_sums=()):
        """Replica-local: hands the inner optimizer the window's mean gradient once, then
        empties the window.

        `dense` lists the variables with dense sums in the window, `sums` those
        sums (reduced; for `overwrite_with_gradient` variables, their maxima),
        `rows` the variables with sparse rows (gathered across the replicas),
        `weight_sum` the window's weight summed over the replicas; the other
        variables get `None`, as in the large batch. `noise_sums` are the
        window's (reduced) noise-scale sums when it measures.
        """
        s = self._state
        replica_count = replicas.replicas_in_sync() if tf.distribute.has_strategy() else 1
        weight_sum = weight_sum / replica_count
        divisor = self._loss_scale_divisor()
        if divisor is not None:
            # Each micro-batch's loss was scaled by S / N: the mean at S for the unscaling.
            weight_sum = weight_sum / divisor
        grads = [None] * len(s.variables)
        summed = [(i, total) for i, total in zip(dense, sums) if i not in s.overwrite_indices]
        for i, total in zip(dense, sums):
            if i in s.overwrite_indices:
                grads[i] = tf.cast(replicas.maximum_over_replicas(total), s.variables[i].dtype)
        # In place where the sums lie in local buffers: no second copy (see _tf.divide_in_place).
        means = _tf.divide_in_place([total for _, total in summed], weight_sum)
        for (i, _), mean in zip(summed, means):
            grads[i] = tf.cast(mean, s.variables[i].dtype)
        row_means = [s.saved.rows[i].mean(s.variables[i], weight_sum, s.notes.once_per_batch.get(i),
                                          self.merge_duplicate_rows) for i in rows]
        for i, mean in zip(rows, row_means):
            # A variable with dense and sparse gradients in one window gets their sum.
            grads[i] = mean if grads[i] is None else window_rows.add_rows(grads[i], mean)
        if s.saved.noise is not None:
            window_noise.fold_window(s, noise_sums, grads, replica_count,
                                    self._window_gradient_scale(), self._loss_scale_divisor())
        self._hand_to_updater(grads, s.variables, reduced=True)
        # Refill once the update has read the means: reading the variables it
        # wrote orders the refill after it (automatic control dependencies).
        self._reset_window(dense, rows, after=[
            tf.convert_to_tensor(_tf.backing_variable(s.variables[i])) for i, _ in summed])

    def _reset_window(self, indices, row_indices=(), after=()):
        """Empties the buffers at `indices` and the rows at `row_indices` (the
        others are empty) and the weight. Row buffers keep their capacity."""
        s, indices = self._state, list(indices)
        squares = window_noise.reset(s)
        _tf.fill_one_after_another(
            [s.saved.accumulators[i] for i in indices] + squares,
            [float("-inf") if i in s.overwrite_indices else 0.0 for i in indices] + [0.0] * len(squares),
            after=after,
        )
        for i in row_indices:
            s.saved.rows[i].reset(i in s.notes.row_room)
        s.saved.weight_sum.assign(0.0)

    def _window_config(self):
        """The window's options for `get_config`, with its length now."""
        # The options as built, with the window's length now (a schedule may have changed it).
        config = self.options.get_config()
        if not self.options.auto:
            config["accum_steps"] = self.accum_steps
        return config

    # ------------------------------------------------ what each Keras supplies
    def _new_variable(self, shape, dtype, initial, name):
        """Each Keras: a plain optimizer variable (`None` in `shape`: a buffer that grows)."""
        raise NotImplementedError

    def _hand_to_updater(self, grads, variables, reduced):
        """Each Keras: one update of the inner optimizer with an already reduced gradient."""
        raise NotImplementedError

    def _updates_without_reduction(self):
        """Each Keras: a context in which the inner optimizer does not all-reduce again."""
        raise NotImplementedError

    def _window_gradient_scale(self):
        """Each Keras: the loss scale the window's sums carry (None: unscaled)."""
        raise NotImplementedError

    def _loss_scale_divisor(self):
        """N where each micro-batch's loss is scaled by the window's scale / N (None: by
        the window's scale, or unscaled)."""
        return None
