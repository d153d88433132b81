"""`help()` and `inspect.signature` of the Keras 2 classes show their real parameters
(the Keras 3 side: `tests/accumulator/test_documented_claims.py`)."""

import inspect
import pydoc

import pytest

from tfx_gradient_accumulator.accumulator import AccumulationSchedule, AutoAccumulation, EpochWindows, GradientAccumulator, GradientCache
from tfx_gradient_accumulator.accumulator.core import flavours

k2 = flavours.keras2_module()
pytestmark = pytest.mark.skipif(k2 is None, reason="no Keras 2 installed")
PUBLIC = (GradientAccumulator, GradientCache, EpochWindows, AccumulationSchedule, AutoAccumulation)


@pytest.mark.parametrize("public", PUBLIC, ids=lambda c: c.__name__)
def test_each_keras2_class_shows_its_init_parameters(public):
    klass = public.for_keras(k2) if hasattr(public, "for_keras") else public    # TF 2.15: the public name
    names = list(inspect.signature(klass).parameters)
    assert names == list(inspect.signature(klass.__init__).parameters)[1:] and names[:1] != ["args"]
    text = pydoc.render_doc(klass, renderer=pydoc.plaintext)
    assert f"{klass.__name__}({names[0]}" in "".join(text.replace("|", " ").split())   # pydoc's header line


def test_a_call_binds_to_the_keras2_accumulators_signature():
    from tfx_gradient_accumulator.accumulator import keras2

    signature = inspect.signature(keras2.GradientAccumulator)
    assert signature.bind(k2.optimizers.SGD(), accum_steps=4).arguments["accum_steps"] == 4
    assert "accum_steps" in pydoc.render_doc(keras2.GradientAccumulator, renderer=pydoc.plaintext)
