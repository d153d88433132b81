"""Every-optimizer sweeps, and which of their cases run in which environment.

A sweep runs one test for every optimizer Keras ships. The core Keras 3 environments
(the newest and the oldest supported Keras) run every case. The TFX environment has
the newest Keras again (on TF 2.16): there `make test` runs only the representative
optimizers (`-m "not sweep"`), which are the ones the Trainer's users mostly pick;
the other cases are marked `sweep`.
"""

import pytest

REPRESENTATIVE = ("SGD", "Adam", "AdamW")


def marks(name):
    """`pytest.param(..., marks=marks(name))`: `sweep` unless `name` is representative."""
    return [] if name.split("(")[0] in REPRESENTATIVE else [pytest.mark.sweep]
