"""The close's division and refill of the window's buffers, where they lie.

The refill (`_tf.fill_one_after_another`): in place, one kernel a buffer, where a
traced step runs kernel by kernel; `Empty` and an assignment eagerly and under XLA.
Either way every element gets the value, a non-finite sum included, and the buffer
keeps its shape (a one-row stand-in too). The division (`_tf.divide_in_place`): bitwise
the quotient everywhere; traced, a divide and an assignment a buffer, one after another,
and never a scatter, which would leave the buffer copied at every later read."""

import numpy as np
import pytest
import tensorflow as tf

from tfx_gradient_accumulator.accumulator.core import _tf


def _buffers():
    return [tf.Variable(np.array([[1.0, np.inf], [np.nan, -2.0]], np.float32)),
            tf.Variable(np.full([1, 3], np.inf, np.float32), shape=tf.TensorShape([None, 3])),
            tf.Variable(np.arange(4, dtype=np.float64))]


@pytest.mark.parametrize("how", ["traced", "xla", "eager"])
def test_every_buffer_gets_its_value(how):
    buffers = _buffers()
    values = [0.0, float("-inf"), 0.0]

    def refill():
        _tf.fill_one_after_another(buffers, values)

    if how == "eager":
        refill()
    else:
        tf.function(refill, jit_compile=how == "xla")()
    for buffer, value, shape in zip(buffers, values, [(2, 2), (1, 3), (4,)]):
        np.testing.assert_array_equal(buffer.numpy(), np.full(shape, value, buffer.dtype.as_numpy_dtype))


def test_traced_refill_is_one_kernel_a_buffer_without_allocation():
    buffers = _buffers()
    graph = tf.function(lambda: _tf.fill_one_after_another(buffers, [0.0] * 3)).get_concrete_function().graph
    ops = [op.type for op in graph.get_operations()]
    assert ops.count("ResourceStridedSliceAssign") == 3
    assert "Empty" not in ops and "AssignVariableOp" not in ops


def test_the_count_is_added_on_the_variable_in_one_kernel():
    import keras

    count = keras.Variable(np.int64(2), dtype="int64")
    signal = tf.constant(1.0)
    graph = tf.function(lambda: _tf.assign_add_after(count, 1, after=[signal])).get_concrete_function().graph
    assert [op.type for op in graph.get_operations()].count("AssignAddVariableOp") == 1
    assert "ReadVariableOp" not in [op.type for op in graph.get_operations()]
    tf.function(lambda: _tf.assign_add_after(count, 1, after=[signal]))()
    assert int(count.numpy()) == 3


@pytest.mark.parametrize("how", ["traced", "xla", "eager"])
def test_the_division_writes_each_buffer_bitwise_the_quotient(how):
    buffers = _buffers() + [tf.Variable(np.float32(7.0))]
    expected = [b.numpy() / np.asarray(3.0, b.dtype.as_numpy_dtype) for b in buffers]
    expected[-1] = np.float32(7.0) / np.float32(3.0)
    summed = tf.constant([1.0, 2.0, 3.0])       # the divisor as the close has it: a tensor

    def divide():
        return _tf.divide_in_place(buffers, tf.reduce_sum(summed) / 2.0)

    means = divide() if how == "eager" else tf.function(divide, jit_compile=how == "xla")()
    for buffer, mean, value in zip(buffers, means, expected):
        np.testing.assert_array_equal(buffer.numpy(), value)
        np.testing.assert_array_equal(np.asarray(mean), value)


def test_traced_division_assigns_each_quotient_one_after_another_and_scatters_nothing():
    buffers = _buffers()
    graph = tf.function(lambda: _tf.divide_in_place(buffers, tf.constant(2.0))).get_concrete_function().graph
    ops = graph.get_operations()
    assigns = [op for op in ops if op.type == "AssignVariableOp"]
    assert len(assigns) == 3 and sum(op.type == "RealDiv" for op in ops) == 3
    # Chained: each division waits on the assignment before it, so one temporary at a time.
    divisions = [op for op in ops if op.type in ("ReadVariableOp", "RealDiv")]
    waited_on = [a for a in assigns if any(a in op.control_inputs for op in divisions)]
    assert len(waited_on) == 2      # the second division waits on the first assignment, the third on the second
    # A scatter on a dense buffer (ResourceScatterDiv, which would divide in one kernel)
    # turns the variable copy-on-read: every later read of it copies the whole buffer.
    assert not any(op.type.startswith("ResourceScatter") for op in ops)
    tensor = tf.constant([4.0, 6.0])
    assert np.asarray(_tf.divide_in_place([tensor], 2.0)[0]).tolist() == [2.0, 3.0]
