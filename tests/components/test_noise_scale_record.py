"""What the Trainer records of a run's noise scale: a value only when there is one.

Optimizers are fed windows by hand (weights fixed, SGD at learning rate 0), and
the expected values worked out by the appendix-A formulas: two micro-batches of
weight 1, gradients g1 and g2: m = (g1^2 + g2^2) / 2, |G_B|^2 = ((g1 + g2) / 2)^2,
h - 1/B = 1 - 1/2, tr = (m - |G_B|^2) / (1/2), |G|^2 = |G_B|^2 - tr / 2.
"""

import json
import math

import keras
import pytest
from tfx.types import standard_artifacts

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.components import noise_scale


def _fed(windows, measure=True, smoothing=0.0):
    variable = keras.Variable([0.0])
    optimizer = GradientAccumulator(keras.optimizers.SGD(0.0), 2, measure_noise_scale=measure,
                                    noise_scale_smoothing=smoothing)
    optimizer.build([variable])
    for g1, g2 in windows:
        for g in (g1, g2):
            optimizer.apply_gradients([(keras.ops.convert_to_tensor([g]), variable)])
    return optimizer


def _closed(g1, g2):
    m = (g1 * g1 + g2 * g2) / 2
    big = ((g1 + g2) / 2) ** 2
    trace = (m - big) / 0.5
    return big - trace / 2, trace


def test_a_resolved_estimate_is_recorded_with_its_windows():
    optimizer = _fed([(3.0, 1.0)])
    g2, trace = _closed(3.0, 1.0)      # 3 and 2: B_simple = 2/3
    reading = noise_scale.read([optimizer], measure=True)
    assert reading.measured and reading.windows == 1 and reading.smoothing == 0.0
    assert reading.noise_scale == pytest.approx(trace / g2, rel=1e-6)
    artifact = standard_artifacts.Model()
    noise_scale.record([artifact], reading)
    assert artifact.get_float_custom_property("noise_scale") == reading.noise_scale
    assert artifact.get_int_custom_property("noise_scale_windows") == 1
    assert artifact.get_string_custom_property("noise_scale_status") == "measured"


def test_an_unresolved_estimate_records_no_value():
    # g1 = 1, g2 = -1: |G_B|^2 = 0, so |G|^2 = -1 and the ratio is -2: no noise scale.
    optimizer = _fed([(1.0, -1.0)])
    assert _closed(1.0, -1.0) == (-1.0, 2.0)
    reading = noise_scale.read([optimizer], measure=True)
    assert reading.noise_scale == pytest.approx(-2.0) and not reading.measured
    assert reading.status.startswith("unresolved: after 1 window(s)")
    artifact = standard_artifacts.Model()
    noise_scale.record([artifact], reading)
    assert not artifact.has_custom_property("noise_scale")
    assert artifact.get_int_custom_property("noise_scale_windows") == 1
    assert json.loads(json.dumps(reading.as_dict(), allow_nan=False))["noise_scale"] is None
    assert noise_scale.describe(reading).startswith("Gradient noise scale: unresolved")


def test_the_optimizer_with_the_most_windows_is_read():
    few, many = _fed([(3.0, 1.0)]), _fed([(1.0, -1.0), (5.0, 1.0), (2.0, 1.0)])
    assert noise_scale.read([many, few], measure=True).windows == 3
    assert noise_scale.read([few, many], measure=True).windows == 3


def test_nothing_measured_says_why():
    assert noise_scale.read([_fed([(3.0, 1.0)])], measure=False) is None
    unbuilt = GradientAccumulator(keras.optimizers.SGD(0.0), 2, measure_noise_scale=True)
    reading = noise_scale.read([unbuilt], measure=True)
    assert (reading.windows, math.isnan(reading.noise_scale)) == (0, True)
    assert reading.status.startswith("no estimate")
    own = noise_scale.read([_fed([(3.0, 1.0)], measure=False)], measure=True)
    assert own.status.startswith("not measured: the run_fn compiled its own GradientAccumulator")
    artifact = standard_artifacts.Model()
    noise_scale.record([artifact], own)
    assert not artifact.has_custom_property("noise_scale")
    assert not artifact.has_custom_property("noise_scale_smoothing")
