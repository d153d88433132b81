"""`accumulator.check_exact` on a Keras 2 model (`tf_keras`, or TF <= 2.15's `tf.keras`).

Run in the Keras 2 environments (TF 2.15, and tf_keras with TF_USE_LEGACY_KERAS=1).
One check (three tiny `fit` runs): an embedding model with Adam is exact, and its
table is reported as rows; the float64 arbiter, asked for, says why it cannot run. Keras 2 sums an id's repeated rows itself, so the
window's rows and Keras' large batch agree either way.
"""

import os

import numpy as np
import pytest

from tfx_gradient_accumulator.accumulator import check_exact
from tfx_gradient_accumulator.accumulator.core import flavours

k2 = flavours.keras2_module()
pytestmark = [
    pytest.mark.skipif(k2 is None, reason="no Keras 2 here (tf_keras not installed)"),
    # Beside Keras 3 without TF_USE_LEGACY_KERAS (the TFX stack) tf_keras' fit takes ~80 s
    # of autograph here; the two Keras 2 environments run it in seconds.
    pytest.mark.skipif(flavours.keras_is_3() and os.environ.get("TF_USE_LEGACY_KERAS") != "1",
                       reason="run in the Keras 2 environments (TF 2.15, TF_USE_LEGACY_KERAS=1)"),
]


def test_a_keras2_embedding_model_is_exact_and_its_table_is_rows():
    rng = np.random.RandomState(0)
    x = rng.randint(0, 40, size=(64, 10)).astype("int32")
    y = rng.randn(64, 1).astype("float32")

    def model_fn():
        return k2.Sequential([k2.Input((10,), dtype="int32"), k2.layers.Embedding(40, 8),
                              k2.layers.GlobalAveragePooling1D(), k2.layers.Dense(1)])

    report = check_exact(model_fn, (x, y), lambda: k2.optimizers.Adam(1e-2), 4, batch_size=8, updates=2,
                         loss="mse", arbiter=True, verbose=False)
    assert report.exact, str(report)
    # The float64 arbiter reads Keras 3's dtype policy: for a Keras 2 model it says so, and
    # the float32 verdict stands.
    assert report.arbiter == "unavailable" and "a Keras 2 model" in report.arbiter_reason
    assert "float64 cannot be had" in str(report)
    assert report.settings["keras"].startswith("2.")
    assert [v.kind for v in report.variables] == ["rows", "dense", "dense"]
    assert min(v.moved for v in report.variables) > 1e-3
