"""`fit_with_out_of_memory_recovery`: `fit` at a found micro-batch that survives an
out-of-memory error in the middle of training, exactly.

`find_micro_batch` measures one step on the sample it is given. Later data can need more:
longer sequences padded per batch, larger images, a fragmented allocator. Then a training
step raises `ResourceExhaustedError` in the middle of the run. Here the run goes on:

1. **What the error leaves.** Inside a window the model's weights and the inner
   optimizer's state are untouched until the window's closing micro-step; only the
   window's buffers change. The close waits for every gradient of its micro-step (it reads
   every buffer the micro-step adds to), so an error in a forward or backward pass, the
   memory that grows with b, leaves the weights and the optimizer's state as the last
   update left them. An error inside the inner optimizer's update itself is told apart by
   a counter (`GradientAccumulator.track_updates`): +1 before the update's first write,
   +1 after its last. Odd: the update stopped half-way, some variables written and others
   not; nothing can be redone exactly, and the run stops with an error saying so (the
   update's memory does not depend on b anyway). Even: the update did not begin (the
   window is redone) or finished (the next window is trained).
2. **The switch.** The open window is dropped (`close_partial_window("drop")`), the
   micro-batch halves: b' = ceil(E / 2N), in N' = ceil(E / b') micro-batches (2N, or fewer
   where 2N micro-batches of b' hold more than E), and the window is fed
   again from its first sample, its batch of E kept aside while it trains. `fit` is called
   again from the epoch it stopped in. Each switch is logged (the
   `tfx_gradient_accumulator` logger, at WARNING) and returned.
3. **What it costs.** Redone: the micro-steps of the dropped window (at most N - 1) and the
   one that failed, then a trace of the step at the new shape. Each batch of E passes
   through Python (`tf.data.Dataset.from_generator`) so that the window can be fed again,
   whatever the dataset (a reshuffling one included); the last four batches of E read are
   kept on the host.

Not redone exactly: the state a forward pass changes besides the window (Keras' metrics,
`BatchNormalization`'s moving statistics, random layers' draws) sees the dropped
micro-steps twice; a window's noise-scale reading can count a dropped micro-batch.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import warnings
from typing import Any, List, Optional, Sequence, Tuple

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.batch.micro_batch import MicroBatchFit, is_out_of_memory, split
from tfx_gradient_accumulator.accumulator.core.validation import integer_at_least

logger = logging.getLogger(__name__)

__all__ = ["MicroBatchSwitch", "RecoveredFit", "fit_with_out_of_memory_recovery"]

# Batches of E kept on the host, newest last: the open window's, and those the input
# pipeline has read ahead of the training.
_KEPT_BATCHES = 4
_VERBOSE = ("auto", 0, 1, 2)


@dataclasses.dataclass(frozen=True)
class MicroBatchSwitch:
    """One switch to a smaller micro-batch after an out-of-memory error.

    Attributes:
        update: the updates made before it (the optimizer's `iterations`): the first
            update trained at the new micro-batch is this index, counted from 0.
        micro_batch: b', the micro-batch from here on.
        accum_steps: N', the micro-batches per update from here on (ceil(E / b'): 2N at most).
        previous_micro_batch: b before the switch.
        previous_accum_steps: N before the switch.
        dropped: the micro-batches the dropped window held (`close_partial_window`'s count;
            the one that failed is among them when the error came after the window counted
            it, in its backward pass).
        epoch: the epoch it happened in.
    """

    update: int
    micro_batch: int
    accum_steps: int
    previous_micro_batch: int
    previous_accum_steps: int
    dropped: int
    epoch: int

    def as_record(self) -> dict:
        """`{"update", "micro_batch", "accum_steps"}`: what a run records of it."""
        return {"update": self.update, "micro_batch": self.micro_batch, "accum_steps": self.accum_steps}


@dataclasses.dataclass(frozen=True)
class RecoveredFit:
    """What `fit_with_out_of_memory_recovery` trained.

    Attributes:
        history: a `keras.callbacks.History` with every epoch's logs, across the restarts.
        switches: the `MicroBatchSwitch`es, in order (empty: no error).
        micro_batch: b at the end.
        accum_steps: N at the end.
    """

    history: keras.callbacks.History
    switches: Tuple[MicroBatchSwitch, ...]
    micro_batch: int
    accum_steps: int


def fit_with_out_of_memory_recovery(model: keras.Model, dataset: tf.data.Dataset, found: MicroBatchFit, *,
                                    epochs: int = 1, initial_epoch: int = 0,
                                    callbacks: Optional[Sequence[keras.callbacks.Callback]] = None,
                                    verbose: Any = "auto", validation_data: Any = None,
                                    validation_freq: int = 1, steps_per_epoch: Optional[int] = None,
                                    validation_steps: Optional[int] = None) -> RecoveredFit:
    """`model.fit(found.micro_batches(dataset), ...)`, going on at half the micro-batch after
    an out-of-memory error in a training step, with the weights of the run without it.

    On a `ResourceExhaustedError` in a training step, the open window is dropped, the
    micro-batch halves (N about doubles, so E stays), and the window is trained again from its
    first sample; the weights and the inner optimizer's state are those the last update
    left (see the module's docstring for why, and for the one case that stops the run).
    Every epoch's logs go to one `History`; the user's callbacks see a new `fit` after each
    switch (`on_train_begin` again, and `on_epoch_begin` of the epoch it happened in).

    Args:
        model: the model `find_micro_batch` was called with: built, compiled with a
            `GradientAccumulator` whose `accum_steps` is `found.accum_steps`, on one device.
        dataset: a `tf.data.Dataset` of batches of E samples (`found.effective_batch_size`);
            each becomes one window of micro-batches, as `found.micro_batches` cuts it.
        found: what `find_micro_batch` returned.
        epochs: as `fit`'s: the epoch to end before, an int >= 1.
        initial_epoch: as `fit`'s: the epoch to start at, an int in [0, epochs).
        callbacks: as `fit`'s: a list of `keras.callbacks.Callback`, or None.
        verbose: as `fit`'s: "auto", 0, 1 or 2.
        validation_data: as `fit`'s (an error in validation is not recovered from).
        validation_freq: as `fit`'s: an int >= 1.
        steps_per_epoch: None: each epoch reads `dataset` once, from its start. An int
            >= 1: each epoch trains that many batches of E (windows, not micro-steps), one
            reading going on from epoch to epoch, as `fit(steps_per_epoch=...)` reads a
            repeated dataset (`dataset.repeat()`, the TFX way); data that runs out first
            ends the training, as in `fit`.
        validation_steps: as `fit`'s: None, or an int >= 1.

    Returns:
        A `RecoveredFit`: the `history`, the `switches`, and b and N at the end.

    Raises:
        TypeError, ValueError: a bad option, a model that is not compiled with a
            `GradientAccumulator` at `found`'s window, or an open window; before any step.
        NotImplementedError: a strategy with several replicas.
        tf.errors.ResourceExhaustedError: a step ran out of memory at a micro-batch of 1.
        RuntimeError: an inner update stopped half-way (nothing can be redone exactly).
    """
    options = _validated(model, dataset, found, epochs, initial_epoch, callbacks, verbose, validation_freq,
                         steps_per_epoch, validation_steps)
    optimizer = model.optimizer
    halves = optimizer.track_updates()
    model.make_train_function(force=True)
    feed = _Feed(dataset, steps_per_epoch)
    tracker = _Tracker(feed, optimizer)
    switches: List[MicroBatchSwitch] = []
    current, epoch = found, initial_epoch
    while epoch < epochs:
        # Resumed in the middle of an epoch: to its end only. `fit` counts the steps of a
        # dataset of unknown size in its first epoch, and takes that for the next ones.
        end = epoch + 1 if tracker.resuming else epochs
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*ran out of data")   # `fit` at each epoch's end
                model.fit(current.micro_batches(feed.as_dataset()), epochs=end, initial_epoch=epoch,
                          callbacks=[tracker, *options["callbacks"]], verbose=verbose, shuffle=False,
                          validation_data=validation_data, validation_freq=validation_freq,
                          validation_steps=validation_steps)
        except tf.errors.OpError as err:
            if not (tracker.in_step and is_out_of_memory(err)):
                raise
            tracker.in_step = False
            current, switch = _switch(model, current, halves, tracker, err)
            switches.append(switch)
            feed.rewind(tracker.windows_done_in_epoch())
            tracker.resuming, epoch = True, tracker.epoch
            continue
        if model.stop_training:
            break
        epoch = end
    tracker.history.set_model(model)
    return RecoveredFit(tracker.history, tuple(switches), current.micro_batch, current.accum_steps)


def _switch(model, current, halves, tracker, err):
    """After an out-of-memory error in a step: drops the open window, halves b, and
    returns the new `MicroBatchFit` and the `MicroBatchSwitch`."""
    optimizer = model.optimizer
    if int(halves.numpy()) % 2:
        raise RuntimeError(
            "fit_with_out_of_memory_recovery: the out-of-memory error came inside the inner optimizer's "
            "update, which stopped half-way: some variables were updated and others not, so the window "
            "cannot be trained again exactly. The update's memory does not depend on the micro-batch; "
            "resume from a checkpoint (TrainingBackup) with more free memory.") from err
    dropped = optimizer.close_partial_window("drop")
    if current.micro_batch == 1:
        raise tf.errors.ResourceExhaustedError(
            None, None, "fit_with_out_of_memory_recovery: a training step ran out of memory at a micro-batch "
            f"of 1 sample (update {int(optimizer.iterations.numpy())}, epoch {tracker.epoch}): the data there "
            "needs more memory than the device has for one sample. The weights are those of the last "
            f"update, the open window dropped. Original error: {err.message}")
    # b' = ceil(E / 2N), and N' = ceil(E / b') of them make E: 2N of b' can hold more than E
    # (E = 20, N = 4: b' = 3, and 7 micro-batches, not 8, which would never close a window).
    micro_batch, accum_steps = split(current.effective_batch_size,
                                     -(-current.effective_batch_size // (2 * current.accum_steps)), headroom=0.0)
    optimizer.set_accum_steps(accum_steps)
    update = int(optimizer.iterations.numpy())
    switch = MicroBatchSwitch(update, micro_batch, accum_steps, current.micro_batch, current.accum_steps,
                              dropped, tracker.epoch)
    logger.warning(
        "fit_with_out_of_memory_recovery: out of memory in epoch %d at update %d with micro-batch %d x %d; "
        "dropped the open window (%d micro-batches, trained again) and go on with micro-batch %d x %d.",
        tracker.epoch, update, current.micro_batch, current.accum_steps, dropped, micro_batch, accum_steps)
    return dataclasses.replace(current, micro_batch=micro_batch, accum_steps=accum_steps), switch


class _Feed:
    """The batches of E for `fit`, through Python: each epoch reads `dataset` once (or, with
    `steps_per_epoch`, its next `steps_per_epoch` batches), and keeps the last few batches
    read, so that a dropped window is fed again from its first sample."""

    def __init__(self, dataset, steps_per_epoch=None):
        self._dataset = dataset
        self._steps_per_epoch = steps_per_epoch
        self._iterator = None
        self._recent = collections.deque(maxlen=_KEPT_BATCHES)
        self._replay: list = []
        self._next = 0
        self.ran_out = False      # with `steps_per_epoch`: the data ended before an epoch did

    def start_epoch(self):
        """The epoch's batches: a new reading of the dataset (as `fit` reads it once an
        epoch), or, with `steps_per_epoch`, the next ones of the one reading."""
        if self._iterator is None or self._steps_per_epoch is None:
            self._iterator = iter(self._dataset)
        self._recent.clear()
        self._replay, self._next = [], 0

    def rewind(self, window):
        """Feeds the epoch's windows again from `window` on (those already read, once each)."""
        read = dict(list(self._recent) + self._replay)   # {index: batch}: fed again, or still to be
        kept = sorted((index, batch) for index, batch in read.items() if index >= window)
        if (kept[0][0] if kept else self._next) != window:
            raise RuntimeError(f"fit_with_out_of_memory_recovery lost window {window} of the epoch "
                               f"(kept: {sorted(read)}); please report this.")
        self._recent.clear()                              # each is kept again as it is fed
        self._replay = kept

    def _batches(self):
        while True:
            if self._replay:
                index, batch = self._replay.pop(0)
            elif self._next == self._steps_per_epoch:
                return
            else:
                try:
                    batch = next(self._iterator)
                except StopIteration:
                    self.ran_out = self._steps_per_epoch is not None
                    return
                index, self._next = self._next, self._next + 1
            self._recent.append((index, batch))
            yield batch

    def as_dataset(self) -> tf.data.Dataset:
        """The batches as `fit` reads them (no read-ahead added)."""
        data = tf.data.Dataset.from_generator(self._batches, output_signature=self._dataset.element_spec)
        options = tf.data.Options()
        options.experimental_optimization.inject_prefetch = False
        return data.with_options(options)


class _Tracker(keras.callbacks.Callback):
    """Where the training stands: the epoch, the updates at its start, whether a step is
    running; and every epoch's logs, in one `History`."""

    def __init__(self, feed, optimizer):
        super().__init__()
        self._feed = feed
        self._optimizer = optimizer
        self.history = keras.callbacks.History()
        self.history.epoch = []
        self.epoch, self.in_step, self.resuming, self._base = 0, False, False, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        if self.resuming:        # the epoch a switch stopped: its windows go on where they were
            self.resuming = False
            return
        self._base = int(self._optimizer.iterations.numpy())
        self._feed.start_epoch()

    def on_train_batch_begin(self, batch, logs=None):
        self.in_step = True

    def on_train_batch_end(self, batch, logs=None):
        self.in_step = False

    def on_test_begin(self, logs=None):
        # The epoch's last step, which finds the data run out, has no `on_train_batch_end`.
        self.in_step = False

    def on_epoch_end(self, epoch, logs=None):
        if self._feed.ran_out:
            logger.warning("fit_with_out_of_memory_recovery: the data ran out before epoch %d's "
                           "steps_per_epoch; the training stops here, as `fit`'s does.", epoch)
            self.model.stop_training = True
        self.history.epoch.append(epoch)
        for name, value in (logs or {}).items():
            self.history.history.setdefault(name, []).append(value)

    def windows_done_in_epoch(self) -> int:
        """The epoch's windows whose update is made."""
        return int(self._optimizer.iterations.numpy()) - self._base


def _validated(model, dataset, found, epochs, initial_epoch, callbacks, verbose, validation_freq,
               steps_per_epoch=None, validation_steps=None) -> dict:
    """Every option checked before any step; `{"callbacks": [...]}`."""
    if not isinstance(found, MicroBatchFit):
        raise TypeError(f"`found` must be the MicroBatchFit that find_micro_batch returned; received "
                        f"{type(found).__name__}.")
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"`dataset` must be a tf.data.Dataset of batches of effective_batch_size="
                        f"{found.effective_batch_size} samples; received {type(dataset).__name__}.")
    epochs = integer_at_least(epochs, "epochs")
    initial_epoch = integer_at_least(initial_epoch, "initial_epoch", minimum=0)
    if initial_epoch >= epochs:
        raise ValueError(f"`initial_epoch` must be below `epochs`={epochs}; received {initial_epoch}.")
    integer_at_least(validation_freq, "validation_freq")
    for name, value in (("steps_per_epoch", steps_per_epoch), ("validation_steps", validation_steps)):
        if value is not None:
            integer_at_least(value, name)
    if isinstance(verbose, bool) or verbose not in _VERBOSE:
        raise ValueError(f"`verbose` must be one of {_VERBOSE}; received {verbose!r}.")
    callbacks = list(callbacks or [])
    wrong = [type(c).__name__ for c in callbacks if not isinstance(c, keras.callbacks.Callback)]
    if wrong:
        raise TypeError(f"`callbacks` must be keras.callbacks.Callback objects; received {wrong}.")
    _check_model(model, found)
    return {"callbacks": callbacks}


def _check_model(model, found):
    """The model trains at `found`'s window, on one device, with no window open."""
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(model, keras.Model) or optimizer is None or not callable(getattr(optimizer, "track_updates",
                                                                                       None)):
        raise TypeError("fit_with_out_of_memory_recovery needs a Keras 3 model compiled with "
                        "GradientAccumulator(optimizer, schedulable=True), as find_micro_batch does.")
    if getattr(optimizer, "auto_accumulation", None) is not None or optimizer.is_passthrough:
        raise ValueError("fit_with_out_of_memory_recovery changes `accum_steps`: the GradientAccumulator must "
                         "be made with schedulable=True (not accum_steps='auto', not a pass-through).")
    if optimizer.accum_steps != found.accum_steps:
        raise ValueError(f"the optimizer's accum_steps={optimizer.accum_steps} is not found.accum_steps="
                         f"{found.accum_steps}: pass the MicroBatchFit that find_micro_batch returned for "
                         "this model.")
    if optimizer.built and optimizer.held_micro_batches:
        raise ValueError(f"a window is open ({optimizer.held_micro_batches} micro-batches held): close it "
                         "first (`optimizer.close_partial_window()`).")
    if model.distribute_strategy.num_replicas_in_sync > 1:
        raise NotImplementedError("fit_with_out_of_memory_recovery trains on one device; this model's "
                                  "strategy has several replicas.")
