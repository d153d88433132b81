"""Test session set-up: quiet TensorFlow, the Keras TF backend, 2 logical CPUs.

The logical CPUs must be configured before TensorFlow initialises its devices,
which is why it happens here, at import time of the test session.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ["KERAS_BACKEND"] = "tensorflow"

import tensorflow as tf  # noqa: E402

_cpus = tf.config.list_physical_devices("CPU")
try:
    tf.config.set_logical_device_configuration(
        _cpus[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
except RuntimeError:  # devices already initialised by an earlier import
    pass
