"""Saving and restoring the window: its state as one device holds it, whatever the replicas.

Keras 3's `save_own_variables` / `load_own_variables` and both Keras'
`get_weights` / `set_weights` go through `saved` and `restore`: every replica's
rows (gathered) are saved and put back on replica 0, and the window's weight is
saved per device, so a window resumes under another replica count.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import replicas, seam
from tfx_gradient_accumulator.accumulator.noise import window_noise
from tfx_gradient_accumulator.accumulator.core._tf import backing_variable, filled, is_filled, local_components, runtime_shape
from tfx_gradient_accumulator.accumulator.rows.window_rows import read_rows


class WindowSaving:
    """The saving API of an `AccumulationWindow` (both Keras' optimizers).

    Keras 3's `save_own_variables` / `load_own_variables` call `window_state` /
    `restore_window_state`; `get_weights` / `set_weights` too.
    """

    def set_weights(self, weights):
        """Sets the wrapper's and the inner optimizers' state, in `variables` order."""
        if not (self._window_built() or getattr(self, "built", False)):
            raise ValueError("Build the optimizer (or train one step) before `set_weights()`.")
        check_weights(self.variables, weights)
        self.restore_window_state(weights)

    def get_weights(self):
        """The wrapper's and the inner optimizers' state as NumPy arrays, in `variables` order."""
        return self.window_state()

    def window_state(self):
        """Every variable's value as NumPy arrays, in `variables` order, for saving: the
        window as one device holds it, every replica's rows (`saved`). A custom loop's
        window still open is reported once (`accumulator.window.loop_notes`)."""
        self._state.notes.loop_notes.note_saved(self.held_micro_batches)
        return saved(self.variables, self._state)

    def restorable(self, values):
        """`values` (what a store saved, in order) in this version's layout: as they are where
        they fit, converted where version 0.3 saved them (`window_noise.from_version_0_3`),
        else None."""
        if len(values) == len(self.variables):
            return list(values)
        return window_noise.from_version_0_3(self._state, self.variables, values) if self._window_built() else None

    def restore_window_state(self, state):
        """Assigns `state` (as `window_state` returns it) to `variables`; rows go to replica 0."""
        restore(self.variables, self._state, state)


def held_after_a_restore(state) -> set:
    """The variables an open window holds when it was restored into a process that has not
    traced a step yet (which variables a window holds is otherwise learnt as steps are
    traced): the filled dense buffers and the rows with a count; those with rows are
    marked as such. Asked eagerly, before a close of that window alone."""
    held = set()
    for i, (buffer, variable) in enumerate(zip(state.saved.accumulators, state.variables)):
        rows = state.saved.rows[i]
        if rows is not None and int(np.sum([c.numpy() for c in local_components(rows.count, state.strategy)])):
            state.notes.rows_seen.add(i)
            held.add(i)
        elif is_filled(buffer, tuple(variable.shape), state.strategy) and (
                variable.shape[0] != 1 or any(np.any(c.numpy()) for c in local_components(buffer, state.strategy))):
            # A one-row variable's buffer looks filled as a stand-in too: held if it holds a sum.
            state.notes.dense_seen.add(i)
            held.add(i)
    return held


def check_weights(variables, weights):
    """Raises unless `weights` (arrays) fit `variables`, one each, in order (`set_weights`)."""
    if len(weights) != len(variables):
        raise ValueError(
            f"`weights` must hold {len(variables)} arrays (the wrapper's and the inner "
            f"optimizer's variables, as `get_weights()` returns them); received {len(weights)}."
        )
    for variable, weight in zip(variables, weights):
        shape = tuple(weight.shape) if hasattr(weight, "shape") else tuple(np.shape(weight))
        # The window's buffers take any size along their open (None) axis.
        expected = seam.declared_shape(variable)
        if not expected.is_compatible_with(shape):
            raise ValueError(
                f"`weights` entry for {variable.name} has shape {shape}; "
                f"expected {tuple(expected.as_list())}."
            )


def saved(variables, state):
    """Every one of `variables` as NumPy arrays, in order, for saving.

    The window is saved as one device would hold it, so a window saved under
    one number of replicas resumes under another: under R replicas each
    micro-batch weighs R times its samples (its gradient carries Keras' 1/R
    loss scaling), so the weight read across the replicas is divided by R.
    The rows of sparse gradients are every replica's, concatenated in replica
    order (a checkpoint reading the variables sees replica 0's alone).
    `restore` undoes both. (The noise-scale sums of an open window stay per
    replica micro-batch: a window resumed under another number of replicas
    mixes the two in its one estimate.)

    Args:
        variables: the optimizer's `variables` (the window's and the inner optimizer's).
        state: the window's `WindowState`.

    Returns:
        A list of NumPy arrays, one per variable.
    """
    if state.strategy is None:   # not built: no window, no replicas
        return [np.asarray(v.numpy()) for v in variables]
    seen = [rows for i, rows in enumerate(state.saved.rows) if i in state.notes.rows_seen]
    row_ids = {id(part) for rows in seen for part in rows.variables}
    values = {id(v): np.asarray(v.numpy()) for v in variables if id(v) not in row_ids}
    for rows, (row_values, indices) in zip(seen, rows_of_every_replica(
            [rows.variables for rows in seen], state.strategy)):
        values.update({id(rows.values): row_values, id(rows.indices): indices,
                       id(rows.count): np.int64(len(indices))})
    weight = id(state.saved.weight_sum)
    values[weight] = values[weight] / state.strategy.num_replicas_in_sync
    return [values[id(v)] for v in variables]


def restore(variables, state, values):
    """Assigns `values` (as `saved` returns them) to `variables`; rows go to replica 0.

    Args:
        variables: the optimizer's `variables`.
        state: the window's `WindowState`.
        values: one array per variable, in order.
    """
    if state.strategy is None:   # not built: no window, no replicas
        for variable, value in zip(variables, values):
            backing_variable(variable).assign(value, read_value=False)
        return
    value_of = {id(v): np.asarray(value) for v, value in zip(variables, values)}
    weight = value_of[id(state.saved.weight_sum)]
    value_of[id(state.saved.weight_sum)] = weight * np.asarray(state.strategy.num_replicas_in_sync, weight.dtype)
    rows_variables = set()
    replica_ids = replicas.local_replica_ids(state.strategy)
    for rows in state.saved.rows:
        if rows is None:
            continue
        rows_variables.update(map(id, rows.variables))
        place_rows_on_first_replica(
            rows.values, rows.indices, rows.count, value_of[id(rows.values)],
            value_of[id(rows.indices)][:int(value_of[id(rows.count)])], state.strategy, replica_ids)
    for variable in variables:
        if id(variable) not in rows_variables:
            backing_variable(variable).assign(value_of[id(variable)], read_value=False)


def rows_of_every_replica(buffers, strategy):
    """Each `(values, indices, count)`'s window rows of every replica, concatenated in
    replica order, as NumPy pairs.

    Eagerly, across replicas (for saving), in one traced function. Each replica
    sends at least one row, marked valid or not, so no collective sees an empty tensor.
    """
    if strategy.num_replicas_in_sync == 1:
        return [tuple(part.numpy() for part in read_rows(*b)) for b in buffers]

    def local():
        sent = []
        for values, indices, count in buffers:
            held = backing_variable(count).read_value()
            size = tf.maximum(held, 1)
            valid = tf.cast(tf.range(size) < held, tf.int32)     # collectives take no bool
            sent.append((backing_variable(values)[:size], backing_variable(indices)[:size], valid))
        return sent

    gathered = tf.function(lambda: tf.nest.map_structure(
        lambda part: strategy.gather(part, axis=0), strategy.run(local)), autograph=False)()
    return [(values.numpy()[valid.numpy() == 1], indices.numpy()[valid.numpy() == 1])
            for values, indices, valid in gathered]


def place_rows_on_first_replica(values, indices, count, saved_values, saved_indices, strategy, replica_ids):
    """Restores saved window rows: all of them on replica 0, none on the others.

    At the window's close the replicas' rows are gathered in replica order, so
    replica 0 holding every row hands the update the same rows in the same order.
    `replica_ids` are `replicas.local_replica_ids(strategy)`.
    """
    held = len(saved_indices)
    for replica_id, v, i, c in zip(replica_ids, *(local_components(x, strategy)
                                                  for x in (values, indices, count))):
        first = replica_id == 0 and held > 0
        v.assign(saved_values[:held] if first else filled((None,) + runtime_shape(v)[1:], v.dtype),
                 read_value=False)
        i.assign(saved_indices if first else filled((None,), i.dtype), read_value=False)
        c.assign(held if first else 0, read_value=False)
