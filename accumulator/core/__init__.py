"""What every room stands on: which Keras is in use and the one place that reaches past its API.

`flavours` tells Keras 3 from Keras 2; `seam` holds every private Keras and TensorFlow name
the library uses, `_tf` the TensorFlow helpers built on them; `options` and `validation`
check every option once, before any work (`WindowOptions`); `refusals` the combinations
refused; `replicas` and `distribute` what a strategy needs; `loss_scaling` the loss scale's
reading shared by both Keras.

May import: nothing of the library.
"""
