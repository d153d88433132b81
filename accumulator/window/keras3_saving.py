"""Keras 3's saving of the window's variables (`model.save`, `.keras` and `.weights.h5` files).

Keras 3 saves an optimizer through `save_own_variables` / `load_own_variables`, reading and
assigning each variable as it is. The window's differ: its sparse rows live on every
replica (reading gives replica 0's), and its buffers change size (Keras' own assign holds
a variable to the size it was made with). So the Keras 3 `GradientAccumulator` saves and
restores through the window's own `window_state` / `restore_window_state`
(`window_saving`), under any replica count. The Keras 2 class keeps Keras 2's own.
"""

from __future__ import annotations


class Keras3WindowSaving:
    """`save_own_variables` and `load_own_variables` of the Keras 3 `GradientAccumulator`."""

    def save_own_variables(self, store: dict) -> None:
        """Saves the state, with every replica's window rows (Keras 3's saving).

        Args:
            store: Keras' store of this object's variables.
        """
        # Every replica's window rows (`window_state`), not the replica-0 value
        # that reading the variables gives.
        for i, value in enumerate(self.window_state()):
            store[str(i)] = value

    def load_own_variables(self, store: dict) -> None:
        """Restores what `save_own_variables` saved (under any replica count).

        Args:
            store: Keras' store of this object's variables.
        """
        # Keras' own loop assigns through `keras.Variable.assign`, which holds a
        # buffer to the size it was made with; the window's buffers change size.
        values = self.restorable([store[str(i)] for i in range(len(store.keys()))])
        if values is None:
            return super().load_own_variables(store)   # Keras' warning, nothing loaded
        self.restore_window_state(values)
