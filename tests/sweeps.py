"""Every-optimizer sweeps, and which of their cases run in which environment.

A sweep runs one test for every optimizer Keras ships. The newest Keras 3 environment
and `tf_keras` (Keras 2 on the newest TensorFlow) run every case; the oldest supported
Keras 3, TF 2.15's Keras 2 and the TFX environment (the newest Keras again, on TF 2.16)
run only the representative optimizers (`-m "not sweep"`), the ones the Trainer's users
mostly pick: `make test` has two cores and 45 minutes. The other cases are marked
`sweep`.
"""

import pytest

REPRESENTATIVE = ("SGD", "Adam", "AdamW")


def marks(name):
    """`pytest.param(..., marks=marks(name))`: `sweep` unless `name` is representative."""
    return [] if name.split("(")[0] in REPRESENTATIVE else [pytest.mark.sweep]
