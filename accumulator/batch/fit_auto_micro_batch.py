"""`micro_batch_size="auto"`: the largest micro-batch whose training step fits, found by the run.

`GradientAccumulator(inner, micro_batch_size="auto")` trains as `micro_batch_size=b`
(`accumulator.batch.fit_micro_batches`: each batch `fit` draws is one update, its micro-batches
a loop inside one step), with b chosen here, per batch, by the run itself:

1. **Start whole.** The first batch's size E is the first b: one micro-batch, the large
   batch itself, where it fits.
2. **An out-of-memory error retries the same batch at a smaller b.** The inner optimizer's
   update is the step's last act (it reads every micro-batch's gradient), so a step that
   raises `ResourceExhaustedError` in a forward or backward pass has not touched the
   weights or the optimizer's state; what it accumulated was in the loop's own tensors
   and is gone. What it changed besides (Keras' metrics, updated per micro-batch, and the
   model's non-trainable variables: `BatchNormalization`'s moving statistics, random
   layers' seed states) is put back from shadow copies the step writes first, before
   anything else it does runs; then the same batch is trained again at the next b. An
   error inside the inner update itself (`GradientAccumulator.track_updates`: odd) stops
   the run with a `RuntimeError`, as `fit_with_out_of_memory_recovery` does: some
   variables were written and others not. b only goes down; later batches that need more
   memory (longer sequences padded per batch) do the same.
3. **The next b, with few errors** (each may cost the allocator's ~10 s retry, on a GPU and
   on a oneDNN CPU): always an even split, b = ceil(E / N) for a larger N, so the
   micro-batches are balanced and the padding of the last one small. A step's memory
   grows about linearly in the micro-batch's input elements X = b x (elements per sample:
   a padded batch's tokens) above a constant, so the most elements a step has fit in
   (X_fit) predicts the next b: the largest even split with b x s <= X_fit for this
   batch's s elements per sample (below the b that failed). Under that model it fits at
   once; where the constant is large the bound is conservative (the predicted memory at
   X_fit is the memory that fit). Before any step has fit: N -> 2N (b about halves).
   A peak from `tf.config.experimental.get_memory_info` adds nothing to this rule while
   the device's limit is unknown (a fitting step's peak P at X_fit predicts P x X / X_fit,
   which is at most P exactly where X <= X_fit), so the rule reads shapes only and works
   the same on every device.
4. **Recorded.** `optimizer.micro_batch_size` reads the b in use (None before the first
   batch); each batch that needed a smaller b adds a `MicroBatchChange` to
   `optimizer.micro_batch_changes` and logs it at WARNING on the `tfx_gradient_accumulator`
   logger.

How: Keras 3's train function fetches the batch inside its compiled function, so a retry
could not have it again. For "auto" the `"fit_auto_micro_batch"` hook of
`accumulator.hooks` makes `make_train_function` return `train_function(model)` here: it
takes the next batch eagerly, then calls a compiled step for the current b (one
`tf.function` per b, XLA where the model's `jit_compile` is True), catching the error
there. `steps_per_execution` > 1 is refused at `fit` (one batch per call). Under
`MirroredStrategy` and `MultiWorkerMirroredStrategy` the step is split so that no
out-of-memory error can come while a collective is in flight: `accumulator.batch.fit_auto_distributed`.

Under XLA (`jit_compile=True`): each micro-batch size and batch shape is trained first by
the step traced without XLA (an out-of-memory error there is survived as above), and by its
XLA program from the next batch of that shape on. An XLA program whose memory is refused at
launch leaves the variables it writes unusable (measured with TensorFlow 2.21 on CPU: their
buffers freed, garbage read back, a double free on the next write), so no XLA program runs
before a step of its shape has fit; XLA's program needs no more memory than the graph's in
the cases measured here, so a later error there is not expected, and it would stop the run.
"""

from __future__ import annotations

import time

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.batch import fit_auto_distributed
from tfx_gradient_accumulator.accumulator.batch.micro_batch import is_out_of_memory, unique_variables
from tfx_gradient_accumulator.accumulator.batch.micro_batch_changes import AUTO, next_micro_batch, state_of
from tfx_gradient_accumulator.accumulator.batch.auto_batches import (  # also read from here (Keras 2)
    _elements_per_sample, _first_tensor, _next_batch, _record)



def is_auto(model) -> bool:
    """Whether `model`'s optimizer is a `GradientAccumulator` with `micro_batch_size="auto"`."""
    options = getattr(getattr(model, "optimizer", None), "options", None)
    return getattr(options, "micro_batch_size", None) == AUTO


def refuse_unsupported(model) -> None:
    """Before `fit` trains a Keras 3 model: what "auto" does not take (several batches per call,
    strategies other than Mirrored and MultiWorkerMirrored). Keras 2's: `accumulator.keras2.fit_auto_micro_batch`."""
    if not is_auto(model):
        return
    if getattr(model, "steps_per_execution", 1) != 1:
        raise ValueError(
            f"micro_batch_size='auto' trains one batch per call, to train it again after an "
            f"out-of-memory error; compile with steps_per_execution=1 (received "
            f"{model.steps_per_execution}), or pass an int micro_batch_size.")
    fit_auto_distributed.refuse_unsupported(model)


class EpochNote(keras.callbacks.Callback):
    """Tells the optimizer's `AutoMicroBatch` the epoch `fit` is in (for its records)."""

    def __init__(self, state):
        super().__init__()
        self._state = state

    def on_epoch_begin(self, epoch, logs=None):
        self._state.epoch = int(epoch)


def with_epoch_note(model, callbacks):
    """`callbacks` with an `EpochNote` added for an "auto" model (unchanged otherwise)."""
    if not is_auto(model):
        return callbacks
    note = EpochNote(state_of(model.optimizer))
    if isinstance(callbacks, keras.callbacks.CallbackList):
        note.set_model(model)
        callbacks.callbacks.append(note)
        return callbacks
    return list(callbacks or []) + [note]


class _Shadows:
    """Shadow copies of the variables a failed step can change besides the update (metrics,
    non-trainable state): written by the step before anything else in it runs, read back
    after an out-of-memory error. `copies` counts the steps that wrote them, so a step that
    did not begin (an XLA program refused its memory at launch) restores nothing."""

    def __init__(self, variables):
        self.variables = unique_variables(variables)
        with tf.init_scope():
            self.copies = tf.Variable(0, dtype=tf.int64, trainable=False, name="auto_micro_batch_copies")
            self.shadows = [tf.Variable(tf.convert_to_tensor(v), trainable=False, shape=v.shape,
                                        name="auto_micro_batch_shadow") for v in self.variables]
        self.steps = 0

    def write(self):
        """In the step: the copies, then the count (what the step's other ops wait for)."""
        writes = [shadow.assign(tf.convert_to_tensor(v)) for shadow, v in zip(self.shadows, self.variables)]
        with tf.control_dependencies(writes):
            return self.copies.assign_add(1)

    def put_back(self):
        """After a failed step: the variables as the step found them, if it wrote the copies."""
        if int(self.copies.numpy()) == self.steps:
            for shadow, variable in zip(self.shadows, self.variables):
                variable.assign(shadow)
            return True
        return False


class _Steps:
    """The compiled steps, one per b. Under `jit_compile=True` a batch shape is first trained by
    the step traced without XLA, and by the XLA program from its second batch on, once a step of
    that shape has fit: an XLA program refused its memory at launch leaves the variables it
    writes unusable (TensorFlow 2.16 to 2.21 on CPU: their buffers freed, garbage read, a
    double free on the next write), where a graph step's error leaves them whole."""

    def __init__(self, model, shadows):
        self.model, self.shadows = model, shadows
        self.xla = getattr(model, "jit_compile", False) is True and not model.run_eagerly
        self.compiled, self.fitted = {}, set()

    def _function(self, size, xla):
        if (size, xla) not in self.compiled:
            model, shadows = self.model, self.shadows

            def step(data):
                with tf.control_dependencies([shadows[0].write()]):
                    return model.train_step(data)

            self.compiled[size, xla] = step if model.run_eagerly else tf.function(
                step, reduce_retracing=True, jit_compile=xla)
        return self.compiled[size, xla]

    def __call__(self, size, data):
        shapes = (size, tuple(tuple(t.shape) for t in tf.nest.flatten(data) if t is not None))
        xla = self.xla and shapes in self.fitted
        logs = self._function(size, xla)(data)
        if self.xla:
            self.fitted.add(shapes)
        return logs


def train_function(model):
    """`model.train_function` for "auto" (the module's docstring, "How")."""
    optimizer = model.optimizer
    state = state_of(optimizer)
    halves = optimizer.track_updates()
    if fit_auto_distributed.is_distributed(model):
        return fit_auto_distributed.train_function(model, state, halves)
    shadows = []
    steps = _Steps(model, shadows)

    def function(iterator):
        data = _next_batch(iterator)
        if not shadows:
            # Keras builds the compiled metrics (and the optimizer) in the first trace of a step on
            # one device: traced once here, never run, so that the shadows cover their variables.
            if state.current is None:
                state.current = state.effective_batch = int(_first_tensor(
                    keras.utils.unpack_x_y_sample_weight(data)[0]).shape[0])
            tf.function(model.train_step, autograph=False).get_concrete_function(data)
            shadows.append(_Shadows(list(model.metrics_variables) + list(model.non_trainable_variables)))
        return _train(model, state, halves, shadows[0], steps, data)

    return function


def _train(model, state, halves, shadows, steps, data):
    """One batch: trained at the current b, again at smaller ones after out-of-memory errors."""
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    count = int(_first_tensor(x).shape[0])
    if state.current is None:
        state.current = count
    # The largest batch seen is E (a later `fit` at a larger batch_size raises it; a shorter
    # last batch does not lower it): the splits are of E, and the records name it.
    state.effective_batch = max(state.effective_batch or 0, count)
    per_sample = _elements_per_sample(x)
    started, errors, lost = state.current, 0, 0.0
    while True:
        began = time.monotonic()
        shadows.steps += 1
        try:
            logs = steps(state.current, data)
            break
        except tf.errors.OpError as err:
            if not is_out_of_memory(err):
                raise
            errors, lost = errors + 1, lost + time.monotonic() - began
            _after_out_of_memory(model, state, halves, shadows, err, per_sample)
    state.elements_fit = max(state.elements_fit or 0, state.current * per_sample)
    if errors:
        _record(model, state, started, errors, lost)
    return logs


def _after_out_of_memory(model, state, halves, shadows, err, per_sample):
    """The failed step undone (or the run stopped), and the next b set."""
    if int(halves.numpy()) % 2:
        raise RuntimeError(
            "micro_batch_size='auto': the out-of-memory error came inside the inner optimizer's update, "
            "which stopped half-way: some variables were updated and others not, so the batch cannot be "
            "trained again exactly. The update's memory does not depend on the micro-batch; resume from a "
            "checkpoint (TrainingBackup) with more free memory.") from err
    shadows.put_back()
    if state.current == 1:
        raise tf.errors.ResourceExhaustedError(
            None, None, "micro_batch_size='auto': a training step ran out of memory at a micro-batch of 1 "
            f"sample (update {int(model.optimizer.iterations.numpy())}, epoch {state.epoch}): this batch needs "
            "more memory than the device has for one sample. The weights are those of the last update. "
            f"Original error: {err.message}")
    state.current = next_micro_batch(state.current, state.effective_batch, per_sample, state.elements_fit)
