"""What the reference and the guides say, held against what the code and Keras do.

`help()` and `inspect.signature` of the public classes (made by
`flavours.OneNameForBothKeras`, whose dispatching `__call__` would show `(*args,
**kwargs)`), the docstring's account of sparse gradients under XLA, and the
comparison with Keras' own `fit` on a dataset of unknown size (docs/guide/exact.md).
"""

import inspect
import pydoc

import keras
import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import (
    AccumulationSchedule, AutoAccumulation, EpochWindows, GradientAccumulator, GradientCache,
)
from tests.accumulator import reference as ref

PUBLIC = (GradientAccumulator, GradientCache, EpochWindows, AccumulationSchedule, AutoAccumulation)


def _init_parameters(klass):
    """The names `klass.__init__` takes, less `self`."""
    return list(inspect.signature(klass.__init__).parameters)[1:]


@pytest.mark.parametrize("public", PUBLIC, ids=lambda c: c.__name__)
def test_the_signature_and_help_show_the_real_parameters(public):
    names = list(inspect.signature(public).parameters)
    assert names == _init_parameters(public) and names[:1] != ["args"]
    text = pydoc.render_doc(public, renderer=pydoc.plaintext)
    assert f"{public.__name__}({names[0]}" in "".join(text.replace("|", " ").split())   # pydoc's header line


def test_help_names_accum_steps_and_the_signature_binds_a_call():
    for public in (GradientAccumulator, GradientCache):
        assert "accum_steps" in pydoc.render_doc(public, renderer=pydoc.plaintext)
    bound = inspect.signature(GradientAccumulator).bind(keras.optimizers.SGD(), accum_steps=4)
    assert bound.arguments["accum_steps"] == 4
    with pytest.raises(TypeError):
        inspect.signature(GradientCache).bind(accum_steps=2)       # `model` is required


def test_a_users_subclass_and_an_instance_keep_their_own_signatures():
    class Mine(GradientAccumulator):
        def __init__(self, optimizer, window=2):
            super().__init__(optimizer, window)

    assert list(inspect.signature(Mine).parameters) == ["optimizer", "window"]
    cache = GradientCache(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), 2)
    assert inspect.signature(cache) == inspect.signature(cache.__call__)    # the model's call, not __init__


def test_sparse_rows_under_xla_are_kept_with_no_option_as_the_docstring_says():
    doc = " ".join(GradientAccumulator.__doc__.split())
    assert "Under XLA (`jit_compile=True`, Keras' default on one GPU) the rows are kept too" in doc
    assert "needs `merge_duplicate_rows=True`" not in doc
    x, y = ref.token_data(64)
    model = ref.embedding_model()
    optimizer = GradientAccumulator(keras.optimizers.Adam(1e-2), 4)
    model.compile(optimizer, "mse", jit_compile=True)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)     # not refused
    assert optimizer.merge_duplicate_rows is False and "rows" in optimizer.gradient_kinds.values()
    assert int(optimizer.iterations.numpy()) == 2


def _unknown_size(dataset):
    """The same batches, of unknown cardinality (as a generator or `.filter` gives)."""
    unknown = dataset.filter(lambda *_: True)
    assert int(unknown.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    return unknown


def _fit(optimizer, dataset, epochs):
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse")
    model.fit(dataset, epochs=epochs, shuffle=False, verbose=0)
    return model


@pytest.mark.filterwarnings("ignore:Your input ran out of data")
def test_keras_fit_on_data_of_unknown_size_counts_one_iteration_more_per_epoch():
    # docs/guide/exact.md: Keras' own fit advances `iterations` once more per epoch than
    # the batches it trained on a dataset of unknown size (that step changes no weight);
    # the accumulator counts its updates, and lands on Keras' large batch over data of
    # known size. When a Keras release stops doing this, the first assertion says so.
    rng = np.random.RandomState(0)
    x = rng.randn(96, 3).astype("float32")
    samples = tf.data.Dataset.from_tensor_slices((x, x.sum(axis=1, keepdims=True)))
    known = _fit(keras.optimizers.Adam(1e-2), samples.batch(32), epochs=2)
    unknown = _fit(keras.optimizers.Adam(1e-2), _unknown_size(samples.batch(32)), epochs=2)
    assert int(known.optimizer.iterations.numpy()) == 6
    assert int(unknown.optimizer.iterations.numpy()) == 6 + 2          # 3 batches, 4 iterations, per epoch
    # The extra count moves Adam's bias correction in the second epoch: Keras' two runs differ.
    keras_gap = ref.max_abs_diff(unknown.get_weights(), known.get_weights())
    assert keras_gap > 1e-4
    # The way out the guide gives: a dataset told its size.
    told = _unknown_size(samples.batch(32)).apply(tf.data.experimental.assert_cardinality(3))
    assert ref.max_abs_diff(_fit(keras.optimizers.Adam(1e-2), told, epochs=2).get_weights(),
                            known.get_weights()) == 0.0

    accumulated = _fit(GradientAccumulator(keras.optimizers.Adam(1e-2), 4), _unknown_size(samples.batch(8)), 2)
    assert int(accumulated.optimizer.iterations.numpy()) == 6
    assert ref.max_abs_diff(accumulated.get_weights(), known.get_weights()) <= 1e-6
    assert ref.max_abs_diff(accumulated.get_weights(), unknown.get_weights()) > 1e2 * 1e-6
