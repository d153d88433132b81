"""Fixtures the library's Keras 3 tests share."""

import keras
import pytest


@pytest.fixture
def mixed_policy():
    """Keras' global dtype policy is mixed_float16 inside the test, float32 after."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    yield
    keras.mixed_precision.set_global_policy("float32")
