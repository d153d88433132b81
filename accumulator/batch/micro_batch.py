"""`find_micro_batch`: the largest micro-batch that trains on this device, found by trying.

A user who accumulates gradients sets one number that matters to the training, the
effective batch E (samples per update). How E splits into N micro-batches of b samples
depends on the device, the model and the data, and a wrong guess either fails with an
out-of-memory error or wastes the device. Since the window is exact for micro-batches of
any size (even a short last one: it weighs by samples), every split of E trains the same
weights, so the split can be left to the device:

1. **Search.** Real training steps (forward, backward, the window's accumulation and the
   inner optimizer's update: the step `fit` runs, under the model's strategy, with its
   compiled options such as XLA) on batches of b samples made by repeating the sample's
   rows: b = 1, 2, 4, ... doubling until a step raises `ResourceExhaustedError` (or b
   reaches E), then bisection between the last b that fit and the first that did not,
   down to adjacent sizes. A search is about 2 log2(b) steps.
2. **Margin.** The micro-batch taken is at most `(1 - headroom)` times the largest that
   fit (`headroom=0.1` by default), then balanced: N = ceil(E / b), and b = ceil(E / N),
   the smallest micro-batch with the same N (same number of steps, less memory, even
   micro-batches). The search goes on above E, up to E / (1 - headroom): where that step
   fits, E fits with the same margin and is taken whole (N = 1, b = E: no split, no
   accumulation); where E fits but not with the margin, E is split (N = 2 at least), as
   any micro-batch that close to the limit would be. `headroom=0` takes E whole wherever
   its step fits. Why a margin: the probe measures one step on fresh memory and on the
   sample's shapes. Training runs many steps, and the allocator's fragmentation grows
   with them (TensorFlow's BFC allocator: a few percent), evaluation and callbacks hold
   buffers of their own, and data whose shapes vary (sequences padded per batch) can
   need more than the sample did. Memory grows about linearly in b above a constant
   (weights, optimizer state), so a tenth of b leaves at least a tenth of the
   activations' memory free. For data that grows, probe with the largest examples, or
   raise `headroom`.
3. **Nothing changes.** Every variable of the model (weights, batch-norm statistics,
   random layers' seeds), of the optimizer (window, inner slots, iterations) and of the
   compiled metrics is put back after each probe, and so is the random state of Python,
   NumPy, TensorFlow and Keras (`seam.random_state`): training after the probe is the
   training without it. The probe never reads the training data (a reshuffling
   `tf.data.Dataset` would move to its next order): it is given one sample batch.

4. **On a cluster**, each worker probes a copy of the model on its own device and every
   worker takes the smallest micro-batch any of them found (`micro_batch_workers`).
5. **What was found stays on the optimizer** (`found_micro_batch`, a plain attribute, not
   saved): `fit(x, y, batch_size=b)` on the model warns, once, when b * N is not E
   (`warn_of_windows_off_the_effective_batch`, from `accumulator.fit_hook`): a window of N
   micro-batches of b would train another effective batch, without an error.

A step that runs out of memory leaves the process usable: the allocation is refused
before anything is written, and the variables are put back anyway.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import warnings
import weakref
from typing import Any, Callable, List, Mapping, Optional, Tuple

import keras
import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf, seam
from tfx_gradient_accumulator.accumulator.batch import micro_batch_workers
from tfx_gradient_accumulator.accumulator.core.options import validate_micro_batch_search

logger = logging.getLogger(__name__)

DEFAULT_HEADROOM = 0.1
# What an out-of-memory error says when a runtime wraps it in another class (XLA on some
# GPUs raises InternalError with the status text).
_OUT_OF_MEMORY_TEXTS = ("RESOURCE_EXHAUSTED", "out of memory", "OOM when allocating")

# The optimizer's attribute that holds what `find_micro_batch` found for it.
FOUND_ATTRIBUTE = "found_micro_batch"
# Keras' `fit` batch size for arrays given neither `batch_size` nor `steps_per_epoch`.
_KERAS_DEFAULT_BATCH_SIZE = 32

__all__ = ["DEFAULT_HEADROOM", "FOUND_ATTRIBUTE", "MicroBatchFit", "find_micro_batch",
           "warn_of_windows_off_the_effective_batch"]


@dataclasses.dataclass(frozen=True)
class MicroBatchFit:
    """What `find_micro_batch` found.

    Attributes:
        micro_batch: b, the samples per training step to train with (`fit`'s `batch_size`).
        accum_steps: N = ceil(E / b), the micro-batches per update (set on the optimizer).
        effective_batch_size: E, the samples per update.
        largest_fitting: the largest micro-batch whose step ran (b before the margin).
        probes: `(micro_batch, fitted)` for every step tried, in order.
    """

    micro_batch: int
    accum_steps: int
    effective_batch_size: int
    largest_fitting: int
    probes: Tuple[Tuple[int, bool], ...]

    def micro_batches(self, dataset: tf.data.Dataset) -> tf.data.Dataset:
        """`dataset`, batched at the effective batch, with each batch cut into micro-batches.

        Every batch of E samples becomes `accum_steps` micro-batches of `micro_batch`
        samples, the last one shorter when b does not divide E; a shorter last batch of
        the epoch becomes fewer (its window closes at the epoch's end, as Keras' short
        last batch). So one window is one batch of `dataset`, whatever E is. (`fit(x, y,
        batch_size=micro_batch)` does the same only when `micro_batch * accum_steps` is E.)

        Its cardinality (the micro-batches of one pass) is known where `dataset`'s is and the
        sizes of its batches can be told without reading it (`_micro_batch_count`), so that
        `fit` knows its steps (no "Your input ran out of data" after each epoch); unknown
        otherwise, as `flat_map` leaves it.

        Args:
            dataset: a `tf.data.Dataset` whose elements are batches of E samples.

        Returns:
            The dataset of micro-batches, for `fit`.
        """
        micro_batch = self.micro_batch

        def cut(*element):
            element = element[0] if len(element) == 1 else element
            return tf.data.Dataset.from_tensor_slices(element).batch(micro_batch)

        micro_batches = dataset.flat_map(cut)
        count = _micro_batch_count(dataset, micro_batch)
        if count is None:
            return micro_batches
        return micro_batches.apply(tf.data.experimental.assert_cardinality(count))

    def __str__(self) -> str:
        tried = ", ".join(f"{b} {'fits' if ok else 'OOM'}" for b, ok in self.probes)
        return (f"micro-batch {self.micro_batch} x {self.accum_steps} steps for the effective batch "
                f"{self.effective_batch_size} (largest that fit: {self.largest_fitting}; tried {tried})")


def find_micro_batch(model: keras.Model, x: Any, y: Any = None, *, effective_batch_size: int,
                     sample_weight: Any = None, headroom: float = DEFAULT_HEADROOM,
                     max_micro_batch: Optional[int] = None, uniform: bool = False) -> MicroBatchFit:
    """Finds the largest micro-batch that trains on this device, and sets the window to match.

    Call it after `compile` and before `fit`. It runs real training steps on batches of
    growing size made from the sample (x, y), until one runs out of memory, puts
    everything back as it was, and sets the model's `GradientAccumulator` to
    N = ceil(E / b) micro-batches per update. Train with `found.micro_batches(dataset)`
    (a dataset batched at E, each batch cut into its N micro-batches), or, with
    `uniform=True`, with `fit(x, y, batch_size=found.micro_batch)`. The training is the
    same as at any other split of E.

    Args:
        model: a built Keras 3 model, compiled with a `GradientAccumulator` that can change
            its `accum_steps` (`accum_steps` > 1, or `schedulable=True`).
        x: a sample of the inputs, as `fit` takes them (an array, or a dict or list of
            arrays): one batch, of any size; its rows are repeated to make each probe's
            batch. Not a dataset: reading one would move a reshuffling dataset on.
        y: the targets for `x`, as `fit` takes them (None for models that need none).
        effective_batch_size: E, the samples per update the run trains with.
        sample_weight: optional per-sample weights for `x`.
        headroom: the share of the largest micro-batch that fit left unused, in [0, 1):
            the margin for fragmentation and for data larger than the sample. E is taken
            whole (N = 1) where a step of E / (1 - headroom) samples fits (the search goes
            that far above E); `headroom=0`: wherever a step of E fits.
        max_micro_batch: None, or the largest micro-batch to try (below
            E / (1 - headroom), E is never taken whole with its margin).
        uniform: False (the default): N = ceil(E / b), the window's last micro-batch
            shorter when b does not divide E (train through `MicroBatchFit.micro_batches`).
            True: b divides E (and the strategy's replicas divide b), so that
            `fit(x, y, batch_size=b)` or any pipeline batched at one size trains E per
            update; b can be smaller then (E = 1000, 100 fitting, 90 with the headroom:
            50 x 20, not 84 x 12).

    Returns:
        A `MicroBatchFit`: `micro_batch`, `accum_steps`, `largest_fitting` and the `probes`;
        also kept on the optimizer (`found_micro_batch`), so that `fit` at a `batch_size`
        whose windows are not E warns.

    Raises:
        TypeError, ValueError: a bad option, a model that is not built or not compiled
            with a `GradientAccumulator` that can change its window, data `x` that is
            a dataset or has no rows, or `uniform` with E not a multiple of the replicas.
        tf.errors.ResourceExhaustedError: not even one sample's step fits on this device.
        TypeError: on several workers, a model that cannot be copied from its configuration.
    """
    effective_batch_size, headroom, max_micro_batch, uniform = validate_micro_batch_search(
        effective_batch_size, headroom, max_micro_batch, uniform)
    optimizer = _accumulator_of(model)
    strategy = model.distribute_strategy
    replicas = strategy.num_replicas_in_sync
    if uniform:
        _refuse_indivisible(effective_batch_size, replicas)
    sample = _sample_of(x, y, sample_weight)
    whole = smallest_taken_whole(effective_batch_size, headroom)
    limit = min(whole, max_micro_batch or whole)
    workers = micro_batch_workers.workers_of(strategy)
    probed, probed_optimizer = model, optimizer
    if workers > 1:     # each worker probes a copy on its first device: b is per device there
        probed = micro_batch_workers.local_copy(model)
        probed_optimizer, limit = _accumulator_of(probed), max(1, limit // replicas)
    with _StatePutBack(probed, probed_optimizer) as put_back:
        if probed.distribute_strategy.num_replicas_in_sync > 1:
            _build_as_fit_does(probed, sample, put_back)
        largest, probes = _search(lambda b: _step_fits(probed, sample, b, put_back), limit)
    del probed, probed_optimizer
    if workers > 1:
        logger.info("find_micro_batch: a step of %d samples per device is the largest that fits this "
                    "worker; taking the smallest of its %d workers'.", largest, workers)
        largest = micro_batch_workers.smallest_over_workers(strategy, largest) * replicas
    if largest == 0:
        raise tf.errors.ResourceExhaustedError(
            None, None, f"find_micro_batch: not even a micro-batch of 1 sample trains on this device "
            f"(effective_batch_size={effective_batch_size}): the model, its optimizer state and one "
            "sample's activations need more memory than it has. Use a smaller model or a device "
            "with more memory.")
    micro_batch, accum_steps = split(effective_batch_size, largest, headroom, uniform, replicas)
    optimizer.set_accum_steps(accum_steps)
    found = MicroBatchFit(micro_batch, accum_steps, effective_batch_size, largest, tuple(probes))
    setattr(optimizer, FOUND_ATTRIBUTE, found)
    logger.info("find_micro_batch: %s.", found)
    return found


def smallest_taken_whole(effective_batch_size: int, headroom: float = DEFAULT_HEADROOM) -> int:
    """The smallest largest-fitting micro-batch with which `split` takes E whole (N = 1):
    about E / (1 - headroom), the end of the search; E itself with `headroom=0`."""
    whole = math.ceil(effective_batch_size / (1.0 - headroom))
    while whole > effective_batch_size and _safe(whole - 1, headroom) >= effective_batch_size:
        whole -= 1
    while _safe(whole, headroom) < effective_batch_size:
        whole += 1
    return whole


def _safe(largest_fitting, headroom):
    """The largest micro-batch the margin allows: `(1 - headroom) * largest_fitting`, 1 at least."""
    return max(1, math.floor(largest_fitting * (1.0 - headroom) + 1e-9))


def split(effective_batch_size: int, largest_fitting: int, headroom: float = DEFAULT_HEADROOM,
          uniform: bool = False, replicas: int = 1) -> Tuple[int, int]:
    """`(b, N)` for the effective batch E, given the largest micro-batch that fit.

    b at most `(1 - headroom) * largest_fitting` (1 at least), N = ceil(E / b), and then
    b = ceil(E / N): the smallest micro-batch with that N, so that the micro-batches are
    even and the last one is short by less than N samples. So E is taken whole, (E, 1),
    when `(1 - headroom) * largest_fitting` reaches E (`smallest_taken_whole`), and split
    when it does not, even where E itself fit: the margin holds for every b. With
    `uniform`, the smallest N from there on that divides E into micro-batches that `replicas` divides: b * N = E,
    for pipelines that batch at one size.

    Raises:
        ValueError: `uniform` and E is not a multiple of `replicas`.
    """
    safe = _safe(largest_fitting, headroom)
    accum_steps = -(-effective_batch_size // min(safe, effective_batch_size))
    if not uniform:
        return -(-effective_batch_size // accum_steps), accum_steps
    _refuse_indivisible(effective_batch_size, replicas)
    while effective_batch_size % accum_steps or (effective_batch_size // accum_steps) % replicas:
        accum_steps += 1
    return effective_batch_size // accum_steps, accum_steps


def warn_of_windows_off_the_effective_batch(model: keras.Model, fit_arguments: Mapping[str, Any]) -> None:
    """Warns, once per optimizer, split found and batch size, when `fit` would train windows that are not
    the effective batch `find_micro_batch` set the window for.

    `find_micro_batch` set N for E; `fit(x, y, batch_size=b)` (or a dataset whose batches
    show the size b in their shapes) then trains windows of b * N samples, which is E only
    where b * N is E: with a non-uniform split (38 x 8 for 300) the update would be of 304
    samples, with no error. Said before any step, logged and by `warnings.warn`. Nothing is
    said where the batch size cannot be seen (a dataset of unknown batch dimension, such as
    `MicroBatchFit.micro_batches`' own, a generator), or where N is no longer the one found
    (a schedule, or the out-of-memory recovery, changed it).

    Args:
        model: the model `fit` is called on.
        fit_arguments: `{name: value}` of the `fit` call, as given.
    """
    optimizer = getattr(model, "optimizer", None)
    found = getattr(optimizer, FOUND_ATTRIBUTE, None)
    if not isinstance(found, MicroBatchFit) or getattr(optimizer, "accum_steps", None) != found.accum_steps:
        return
    batch_size = _batch_size_of_fit(fit_arguments)
    if batch_size is None or batch_size * found.accum_steps == found.effective_batch_size:
        return
    warned, said = _WARNED.setdefault(optimizer, set()), (found.effective_batch_size, found.accum_steps, batch_size)
    if said in warned:
        return
    warned.add(said)
    message = (
        f"fit at batch_size={batch_size} trains windows of {batch_size} x {found.accum_steps} = "
        f"{batch_size * found.accum_steps} samples, not the effective batch {found.effective_batch_size} that "
        f"find_micro_batch set accum_steps={found.accum_steps} for (micro-batch {found.micro_batch}). Train "
        f"from a dataset batched at {found.effective_batch_size} through `found.micro_batches(dataset)` (each "
        f"batch cut into its {found.accum_steps} micro-batches), or call find_micro_batch(..., uniform=True), "
        f"whose micro-batch divides {found.effective_batch_size}, and fit at batch_size=found.micro_batch.")
    logger.warning("%s", message)
    warnings.warn(message, UserWarning, stacklevel=4)


# {optimizer: the (E, N, b) already warned of}: once each.
_WARNED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _batch_size_of_fit(fit_arguments):
    """The batch size `fit` will read, where it can be seen before reading: `batch_size` for
    arrays (Keras' 32 without it or `steps_per_epoch`), the batch dimension every component
    of a `tf.data.Dataset` states in its shape (`batch(b, drop_remainder=True)`); else None."""
    x = fit_arguments.get("x")
    if x is None:
        return None
    if isinstance(x, tf.data.Dataset):
        return _static_batch_size(x)
    if not all(hasattr(leaf, "shape") for leaf in tf.nest.flatten(x)):   # a generator, a PyDataset, ...
        return None
    batch_size = fit_arguments.get("batch_size")
    if batch_size is None:
        return None if fit_arguments.get("steps_per_epoch") else _KERAS_DEFAULT_BATCH_SIZE
    return batch_size if isinstance(batch_size, int) and not isinstance(batch_size, bool) else None


def _static_batch_size(dataset):
    """The batch dimension all of `dataset`'s components state in their shapes, or None."""
    sizes = set()
    for spec in tf.nest.flatten(dataset.element_spec):
        shape = getattr(spec, "shape", None)
        if shape is None or shape.rank is None or shape.rank == 0:
            return None
        sizes.add(shape[0])
    return sizes.pop() if len(sizes) == 1 and None not in sizes else None


def _micro_batch_count(dataset, micro_batch):
    """The micro-batches `MicroBatchFit.micro_batches` cuts from one pass over `dataset`,
    where that is known without reading it: its cardinality known, and the sizes of its
    batches from their shapes (all full) or from the `batch` that made them
    (`seam.batches_made_by`: the samples it batched, reached through transformations that
    keep each batch as it is); None otherwise (then the count stays unknown)."""
    batches = int(dataset.cardinality())
    if batches < 0:       # unknown, or infinite (`fit` needs `steps_per_epoch` then anyway)
        return None
    full = _static_batch_size(dataset)
    if full is not None:
        return batches * -(-full // micro_batch)
    made = seam.batches_made_by(dataset)
    if made is None:
        return None
    batch_size, drop_remainder, samples = made
    full_batches, last = divmod(samples, batch_size)
    if drop_remainder:
        last = 0
    if batches != full_batches + (last > 0):
        return None
    return full_batches * -(-batch_size // micro_batch) + -(-last // micro_batch)


def _refuse_indivisible(effective_batch_size, replicas):
    """ValueError unless E splits evenly among `replicas`."""
    if effective_batch_size % replicas:
        raise ValueError(f"find_micro_batch(uniform=True): `effective_batch_size`={effective_batch_size} does "
                         f"not split into micro-batches of one size over {replicas} replicas; give a "
                         f"multiple of {replicas}, or uniform=False.")


def _search(fits: Callable[[int], bool], limit: int) -> Tuple[int, List[Tuple[int, bool]]]:
    """The largest b in [1, limit] for which `fits(b)`, by doubling then bisection (0: none),
    assuming that what does not fit at b does not fit above it; and the probes tried."""
    probes: List[Tuple[int, bool]] = []

    def probe(b):
        probes.append((b, fits(b)))
        return probes[-1][1]

    fitting, failing, b = 0, None, 1
    while failing is None:
        if not probe(b):
            failing = b
        elif b >= limit:
            return b, probes
        else:
            fitting, b = b, min(2 * b, limit)
    while failing - fitting > 1:
        middle = (fitting + failing) // 2
        if probe(middle):
            fitting = middle
        else:
            failing = middle
    return fitting, probes


def _step_fits(model, sample, micro_batch, put_back) -> bool:
    """Whether one training step on `micro_batch` samples runs without running out of memory
    (the state is put back after it either way)."""
    rows = np.arange(micro_batch) % sample.rows
    x, y, sample_weight = tf.nest.map_structure(
        lambda a: None if a is None else np.take(a, rows, axis=0), sample.arrays)
    fitted = False
    try:
        _train_step(model, x, y, sample_weight)
        fitted = True
    except tf.errors.OpError as err:
        if not is_out_of_memory(err):
            raise
    finally:
        del x, y, sample_weight
        if not fitted:
            gc.collect()   # what the failed step's frames held (only then: a collection costs ~0.3 s)
        put_back()
    logger.info("find_micro_batch: a step of %d samples %s.", micro_batch,
                "fits" if fitted else "runs out of memory")
    return fitted


def _train_step(model, x, y, sample_weight):
    """One step of `fit`'s on the batch: under a strategy with several replicas, the batch
    split among them as `fit` splits it (`train_on_batch` would hand each the whole batch)."""
    strategy = model.distribute_strategy
    if strategy.num_replicas_in_sync == 1:
        model.train_on_batch(x, y, sample_weight=sample_weight)
        return
    data = (x,) if y is None and sample_weight is None else (x, y) if sample_weight is None else (x, y, sample_weight)
    batches = strategy.experimental_distribute_dataset(tf.data.Dataset.from_tensors(data))
    model.make_train_function()
    model.train_function(iter(batches))


def _build_as_fit_does(model, sample, put_back):
    """One `train_on_batch` on one sample: it builds the compiled metrics, as `fit` does before
    its first step, which the probes' steps (`train_function`) do not."""
    x, y, sample_weight = tf.nest.map_structure(lambda a: None if a is None else a[:1], sample.arrays)
    try:
        model.train_on_batch(x, y, sample_weight=sample_weight)
    finally:
        put_back()


def is_out_of_memory(err: tf.errors.OpError) -> bool:
    """Whether `err` is an out-of-memory error (or one a runtime wrapped as another class)."""
    return isinstance(err, tf.errors.ResourceExhaustedError) or any(
        text in str(err) for text in _OUT_OF_MEMORY_TEXTS)


class _StatePutBack:
    """The values of every variable of a model, its optimizer and its metrics (each replica's
    own, under a strategy), and the random state, as they were when entered; `__call__`
    puts them back (after each probe)."""

    def __init__(self, model, optimizer):
        self._model = model
        self._optimizer = optimizer

    def __enter__(self):
        if not self._optimizer.built:
            # As `fit`'s first step would: zeros, no random draw.
            self._optimizer.build(self._model.trainable_variables)
        self._accum_steps = int(self._optimizer.accum_steps)
        strategy = self._model.distribute_strategy
        variables = unique_variables(list(self._model.variables) + list(self._optimizer.variables)
                            + list(self._model.metrics_variables))
        self._components = [c for v in variables for c in _tf.local_components(v, strategy)]
        self._values = [c.numpy() for c in self._components]
        self._rows = [rows for rows in self._optimizer.window_rows if rows is not None]
        self._random = seam.random_state()
        # Every probe closes its window: the step measured includes the inner update.
        self._optimizer.set_accum_steps(1)
        return self

    def __call__(self, last=False):
        for component, value in zip(self._components, self._values):
            # A static shape fully known is the shape held (no shape op to run then).
            static = component.shape
            held = tuple(static) if static.is_fully_defined() else _tf.runtime_shape(component)
            component.assign(value if held == value.shape else _grown(value, held), read_value=False)
        for rows in self._rows:
            # A probe that ran out of memory may have grown one of a variable's row buffers
            # and not the other (a step stops part-way): both get the same rows again.
            rows.even_out(self._model.distribute_strategy)
        self._model.reset_metrics()   # metrics the probe built; `fit` resets them anyway
        # Between probes the kernel cache stays: clearing it (as putting back TensorFlow's
        # seed does) would instantiate the step's function again at every probe.
        seam.restore_random_state(self._random, clear_kernel_cache=last)

    def __exit__(self, *exc):
        self(last=True)
        self._optimizer.set_accum_steps(self._accum_steps)
        return False


def _grown(value, held):
    """`value` in the `held` shape of a buffer the probe grew: its rows, then zero rows.

    A window's one-row stand-in that the probe's first gradient filled stays filled (the
    traced step writes the full shape), emptied: zeros, to which the first step adds what
    it would have put; grown row buffers keep the rows they held, in their first rows.
    """
    if value.ndim != len(held) or not value.ndim or value.shape[1:] != held[1:] or value.shape[0] > held[0]:
        return np.zeros(held, value.dtype)
    return np.concatenate([value, np.zeros((held[0] - value.shape[0],) + held[1:], value.dtype)])


def unique_variables(variables):
    """`variables` without repeats (a variable can be the model's and a metric's), in order."""
    return list({id(v): v for v in variables}.values())


@dataclasses.dataclass(frozen=True)
class _Sample:
    """The sample batch: `(x, y, sample_weight)` as NumPy arrays, and its rows."""

    arrays: tuple
    rows: int


def _sample_of(x, y, sample_weight) -> _Sample:
    """The sample as NumPy arrays, checked: not a dataset, every array with the same rows."""
    if isinstance(x, (tf.data.Dataset, keras.utils.PyDataset)) or callable(getattr(x, "__next__", None)):
        raise TypeError(
            "find_micro_batch takes one sample batch `x` (and `y`) as arrays, not "
            f"{type(x).__name__}: reading a dataset would move a reshuffling one on to its next "
            "order, so training would see other data. Pass one batch, e.g. "
            "`x, y = next(iter(dataset))` taken from a copy of the pipeline that does not shuffle.")
    arrays = tf.nest.map_structure(lambda a: None if a is None else np.asarray(a), (x, y, sample_weight))
    rows = {np.shape(a)[0] if np.ndim(a) else 0 for a in tf.nest.flatten(arrays) if a is not None}
    if len(rows) != 1 or 0 in rows:
        raise ValueError("find_micro_batch: `x`, `y` and `sample_weight` must be arrays with the same "
                         f"number of rows (at least 1); received rows {sorted(rows)}.")
    return _Sample(arrays, rows.pop())


def _accumulator_of(model):
    """The model's `GradientAccumulator`, checked: it can take any `accum_steps`."""
    if not isinstance(model, keras.Model):
        raise TypeError(f"find_micro_batch takes a Keras 3 model; received {type(model).__name__}.")
    if not model.built:
        raise ValueError("find_micro_batch needs a built model (give it a `keras.Input`, or call it "
                         "once): building it while probing would draw its initial weights from the "
                         "random state the training starts from.")
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not model.compiled:
        raise ValueError("find_micro_batch needs a compiled model: compile it with "
                         "GradientAccumulator(optimizer, schedulable=True) and the loss first.")
    if not callable(getattr(optimizer, "set_accum_steps", None)) or not hasattr(optimizer, "inner_optimizer"):
        raise TypeError(
            "find_micro_batch probes the step training will run, window included: compile the model "
            f"with GradientAccumulator(optimizer, schedulable=True), not {type(optimizer).__name__}.")
    if getattr(optimizer, "is_passthrough", False):
        raise ValueError("find_micro_batch sets the window's `accum_steps`: this GradientAccumulator "
                         "was made with accum_steps=1, a pass-through; make it with `schedulable=True`.")
    held = optimizer.held_micro_batches if optimizer.built else 0
    if held:
        raise ValueError(f"find_micro_batch sets `accum_steps`, which changes only between windows, and a "
                         f"window is open ({held} micro-batches held): call it before `fit`, "
                         "or close the window first (`optimizer.close_partial_window()`).")
    if getattr(optimizer, "auto_accumulation", None) is not None:
        raise ValueError("find_micro_batch sets `accum_steps`; accum_steps='auto' grows it itself. "
                         "Use one or the other.")
    return optimizer
