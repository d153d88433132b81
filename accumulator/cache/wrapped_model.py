"""What both `GradientCache` classes (Keras 3 and Keras 2) do as a Keras model around a model.

The wrapper's forward pass is the wrapped model's, and building the wrapper builds it: one
copy of that for both Keras, mixed in before each Keras' `Model`.
"""

from __future__ import annotations


class WrappedModel:
    """`build` and `call` of a Keras model that stands for the model it holds as `self.model`."""

    def build(self, input_shape=None) -> None:
        """Builds the wrapped model (when it is not built yet).

        Args:
            input_shape: the inputs' shape, for the wrapped model's `build`.
        """
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        """The wrapped model's outputs (the representations).

        Args:
            inputs: the wrapped model's inputs.
            training: Keras' training flag.

        Returns:
            What the wrapped model returns.
        """
        return self.model(inputs, training=training)
