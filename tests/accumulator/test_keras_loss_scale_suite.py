"""Keras' own `LossScaleOptimizer` tests, run through `GradientAccumulator(LossScaleOptimizer(...), N)`.

`data/keras_loss_scale_optimizer_tests.py` is Keras 3.15.1's test file (its header says
from where), loaded here once per configuration with its name `LossScaleOptimizer`
replaced by a factory: `GradientAccumulator(keras.optimizers.LossScaleOptimizer(inner,
...), accum_steps=N)`, for N = 1 (a pass-through) and N = 2. Each step of Keras' tests
(one `apply` of a gradient at the scale S) becomes one window (`StepAsAWindow`): N
micro-batches, each with the step's gradient over N, what a micro-batch hands over when
its loss is scaled by the accumulator's `scale_loss` (S / N).

Every test runs as Keras wrote it, except where the window's design differs from Keras'
(each override below says why in one line, and asserts this library's contract, next
to Keras' own LossScaleOptimizer run on the same steps):

- `scale_loss` is S / N, each micro-batch's share of the window's scale (the window's
  sum carries S again; at S each micro-batch would overflow N times too early);
- `get_config` is the accumulator's, holding the LossScaleOptimizer's config whole.

The same file against Keras' own `LossScaleOptimizer` (`KerasOwn...`) is the control: the
file passes in this environment. On Keras 3.8 (the oldest supported) the tests of what
Keras 3.8's own LossScaleOptimizer does not do yet are skipped, each with its reason
(`KERAS_3_8_LACKS`; two more for the control alone), and the MultiOptimizer tests
wherever Keras has none (before 3.15).
"""

import importlib.util
import pathlib
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import GradientAccumulator
from tfx_gradient_accumulator.accumulator.core import flavours

DATA = pathlib.Path(__file__).parent / "data" / "keras_loss_scale_optimizer_tests.py"
HAS_MULTI_OPTIMIZER = hasattr(keras.optimizers, "MultiOptimizer")     # Keras >= 3.15
KERAS_3_8 = flavours.version_tuple(keras.__version__) < (3, 9)


@keras.saving.register_keras_serializable(package="keras_loss_scale_suite")
class StepAsAWindow(GradientAccumulator):
    """The accumulator, whose `apply` takes one step of Keras' tests as one window.

    A step's gradient is at the scale S (Keras' tests multiply by `initial_scale`, as
    `scale_loss` would): each of the N micro-batches gets it over N, the gradient of a
    micro-batch's loss scaled by S / N; a maximum (`overwrite_with_gradient`) as it is.
    N a power of two: the shares are exact."""

    def apply(self, grads, trainable_variables=None, micro_batch_weight=None):
        known = trainable_variables if trainable_variables is not None else \
            (self._state.variables if self.built else [None] * len(grads))
        n = self.accum_steps
        share = [g if g is None or getattr(v, "overwrite_with_gradient", False) else g / n
                 for g, v in zip(grads, known)]
        for _ in range(n):
            super().apply(share, trainable_variables)


def _factory(accum_steps):
    """What the file calls `LossScaleOptimizer`: the accumulator around Keras' own."""

    def loss_scale_optimizer(inner_optimizer, *args, **kwargs):
        return StepAsAWindow(keras.optimizers.LossScaleOptimizer(inner_optimizer, *args, **kwargs),
                             accum_steps=accum_steps)

    def from_config(config, custom_objects=None):
        # A LossScaleOptimizer's config (old ones too) as the accumulator's config holds it.
        held = {"module": "keras.optimizers", "class_name": "LossScaleOptimizer", "config": config,
                "registered_name": None}
        return StepAsAWindow.from_config({"optimizer": held, "accum_steps": accum_steps}, custom_objects)

    loss_scale_optimizer.from_config = from_config
    return loss_scale_optimizer


def _suite(name, factory=None):
    """A fresh copy of Keras' test module; with `factory` in place of `LossScaleOptimizer`."""
    spec = importlib.util.spec_from_file_location(f"keras_loss_scale_suite_{name}", DATA)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if factory is not None:
        module.LossScaleOptimizer = factory
        module.optimizers = types.SimpleNamespace(**{**vars(module.optimizers), "LossScaleOptimizer": factory})
    return module


def _side_by_side(make, inner, grads, steps, **settings):
    """`steps` steps of `grads` on a variable, through `make` (the factory) and through
    Keras' own LossScaleOptimizer; [(optimizer, variable)] for ours, then Keras'."""
    runs = []
    for optimizer in (make(inner(), **settings), keras.optimizers.LossScaleOptimizer(inner(), **settings)):
        variable = keras.Variable([1.0, 2.0, 3.0, 4.0])
        optimizer.build([variable])
        for _ in range(steps):
            optimizer.apply([tf.constant(grads, "float32")], [variable])
        runs.append((optimizer, variable))
    return runs


class WindowContract:
    """The tests whose assertions differ for the window by design (N from the class)."""

    N = 1

    def _scale_loss_is_the_share(self, runs, expected_scale):
        (ours, ours_variable), (own, own_variable) = runs
        self.assertAllClose(ours_variable, own_variable)                 # the same updates
        self.assertEqual(int(ours.iterations.numpy()), int(own.inner_optimizer.iterations.numpy()))
        self.assertAllClose(own.scale_loss(1.0), expected_scale)          # Keras' assertion
        self.assertAllClose(ours.loss_scale_optimizer.scale_loss(1.0), expected_scale)
        self.assertAllClose(ours.scale_loss(1.0), expected_scale / self.N)

    def test_downscaling_stateful(self):
        # Ours: `scale_loss` is S / N (each micro-batch's share); the LossScaleOptimizer holds S.
        runs = _side_by_side(_factory(self.N), lambda: keras.optimizers.SGD(0.5), [np.inf] * 4, 4,
                             initial_scale=400.0)
        self._scale_loss_is_the_share(runs, 25.0)

    def test_upscaling_stateful(self):
        # Ours: `scale_loss` is S / N (each micro-batch's share); the LossScaleOptimizer holds S.
        runs = _side_by_side(_factory(self.N), lambda: keras.optimizers.SGD(0.5), [1.0, 6.0, 7.0, 2.0], 8,
                             initial_scale=2.0, dynamic_growth_steps=2)
        self._scale_loss_is_the_share(runs, 32.0)

    def test_serialization(self):
        # Ours: the accumulator's config holds the LossScaleOptimizer's (Keras' four keys) whole.
        settings = dict(initial_scale=3.0, dynamic_growth_steps=2, name="test_opt")
        sgd = lambda: keras.optimizers.SGD(learning_rate=0.5, name="sgd")    # noqa: E731
        optimizer = _factory(self.N)(sgd(), **settings)
        config = optimizer.get_config()
        held = config["optimizer"]["config"]
        self.assertEqual(held, keras.optimizers.LossScaleOptimizer(sgd(), **settings).get_config())
        if not KERAS_3_8:
            self.assertLen(held, 4)
        self.assertEqual(held["name"], "test_opt")
        self.assertEqual(held["initial_scale"], 3.0)
        self.assertEqual(held["dynamic_growth_steps"], 2)
        self.assertIn("inner_optimizer", held)
        self.assertEqual(config["accum_steps"], self.N)
        rebuilt = StepAsAWindow.from_config(config)
        self.assertEqual(rebuilt.accum_steps, self.N)
        self.assertEqual((rebuilt.initial_scale, rebuilt.dynamic_growth_steps), (3.0, 2))
        self.assertEqual(rebuilt.loss_scale_optimizer.name, "test_opt")


class MultiOptimizerContract:
    """Keras' MultiOptimizer-inside-a-LossScaleOptimizer test, `scale_loss` at S / N."""

    N = 1

    def test_multi_optimizer_wrapped_in_loss_scale_optimizer(self):
        # Ours: `scale_loss` is S / N (each micro-batch's share); the rest as Keras' test.
        sgd = keras.optimizers.SGD
        first, second = sgd(learning_rate=0.1), sgd(learning_rate=0.1)
        multi = keras.optimizers.MultiOptimizer(
            keras.optimizers.OptimizerMap(default_optimizer=second, optimizer_map={".*dense_1/.*": first}),
            loss_scale_factor=5.0)
        optimizer = _factory(self.N)(multi, initial_scale=10.0, dynamic_growth_steps=1000)
        with keras.name_scope("dense_1"):
            w1 = keras.Variable([[2.0, 2.0]], name="kernel")
        with keras.name_scope("dense_2"):
            w2 = keras.Variable([[2.0, 2.0]], name="kernel")
        optimizer.build([w1, w2])
        for held in (multi, first, second):
            self.assertIsNone(held.loss_scale_factor)
        self.assertAllClose(optimizer.loss_scale_optimizer.scale_loss(2.0), 20.0)    # Keras' assertion
        self.assertAllClose(optimizer.scale_loss(2.0), 20.0 / self.N)
        optimizer.apply([tf.constant([[10.0, 10.0]]), tf.constant([[10.0, 10.0]])], [w1, w2])
        self.assertAllClose(w1.numpy(), [[1.9, 1.9]])
        self.assertAllClose(w2.numpy(), [[1.9, 1.9]])
        self.assertEqual(int(first.iterations.numpy()), 1)
        self.assertEqual(int(second.iterations.numpy()), 1)


# What Keras 3.8's own LossScaleOptimizer lacks of Keras 3.15.1's file (the control fails
# these there): each test whose name starts so is skipped on Keras 3.8, for all three alike.
KERAS_3_8_LACKS = {
    "test_finite_step_with_inner_loss_scale": "Keras 3.8's LossScaleOptimizer keeps the inner "
                                              "optimizer's loss_scale_factor (later ones clear it)",
    "test_finite_step_with_overwrite": "Keras 3.8's LossScaleOptimizer has no overwrite_with_gradient path",
    "test_init_base_optimizer_unsupported_args": "Keras 3.8's LossScaleOptimizer takes the base "
                                                 "optimizer's arguments",
    "test_init_unsupported_arg": "Keras 3.8's LossScaleOptimizer hands unknown arguments to the base "
                                 "optimizer, whose message differs",
}
# ... and these the control alone: the accumulator keeps them on Keras 3.8 too.
KERAS_3_8_OWN_LACKS = {
    "test_iterations_update": "Keras 3.8's LossScaleOptimizer counts its own iterations (the "
                              "accumulator's are the inner optimizer's updates)",
    "test_serialization": "Keras 3.8's LossScaleOptimizer's config holds the base optimizer's "
                          "arguments too",
}


def _skipped_on_keras_3_8(lacks):
    """A class decorator: on Keras 3.8, the tests named in `lacks` skipped with their reason."""

    def skip(cls):
        if KERAS_3_8:
            for name in [n for n in dir(cls) if n.startswith("test_")]:
                reason = next((r for prefix, r in lacks.items() if name.startswith(prefix)), None)
                if reason is not None:
                    setattr(cls, name, pytest.mark.skip(reason=reason)(getattr(cls, name)))
        return cls

    return skip


_own, _one, _two = _suite("keras_own"), _suite("window_of_1", _factory(1)), _suite("window_of_2", _factory(2))


@_skipped_on_keras_3_8({**KERAS_3_8_LACKS, **KERAS_3_8_OWN_LACKS})
class TestKerasOwnLossScaleOptimizer(_own.LossScaleOptimizerTest):
    """The control: Keras' file against Keras' own LossScaleOptimizer."""


@_skipped_on_keras_3_8(KERAS_3_8_LACKS)
class TestWindowOfOne(WindowContract, _one.LossScaleOptimizerTest):
    """accum_steps=1: the pass-through; Keras' tests unchanged but `test_serialization`."""

    test_downscaling_stateful = _one.LossScaleOptimizerTest.test_downscaling_stateful     # Keras' own: S / 1
    test_upscaling_stateful = _one.LossScaleOptimizerTest.test_upscaling_stateful


@_skipped_on_keras_3_8(KERAS_3_8_LACKS)
class TestWindowOfTwo(WindowContract, _two.LossScaleOptimizerTest):
    """accum_steps=2: a window of two micro-batches per step of Keras' tests."""

    N = 2


@pytest.mark.skipif(not HAS_MULTI_OPTIMIZER, reason="keras.optimizers.MultiOptimizer is new in Keras 3.15")
class TestKerasOwnMultiOptimizerInside(_own.MultiOptimizerInsideLossScaleOptimizerTest):
    """The control: Keras' MultiOptimizer test against Keras' own LossScaleOptimizer."""


@pytest.mark.skipif(not HAS_MULTI_OPTIMIZER, reason="keras.optimizers.MultiOptimizer is new in Keras 3.15")
class TestMultiOptimizerInsideWindowOfOne(_one.MultiOptimizerInsideLossScaleOptimizerTest):
    """accum_steps=1: Keras' test unchanged."""


@pytest.mark.skipif(not HAS_MULTI_OPTIMIZER, reason="keras.optimizers.MultiOptimizer is new in Keras 3.15")
class TestMultiOptimizerInsideWindowOfTwo(MultiOptimizerContract, _two.MultiOptimizerInsideLossScaleOptimizerTest):
    """accum_steps=2: `scale_loss` at S / 2, the update as Keras'."""

    N = 2
