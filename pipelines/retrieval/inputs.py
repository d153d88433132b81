"""What both retrieval module files read (`model.py`, Keras 3; `tfrs_model.py`,
TensorFlow Recommenders): the examples' two id features, and their datasets.

No label: the other rows of a batch are each row's negatives, so the batch is all
a model sees of the loss.
"""

from typing import List

import tensorflow as tf
from tfx import v1 as tfx
from tfx_bsl.public import tfxio

from tfx_gradient_accumulator.pipelines.retrieval.data import ITEM_KEY, USER_KEY


def feature_spec() -> dict:
    """The examples' features: `user_id` and `item_id`, one int64 each."""
    return {key: tf.io.FixedLenFeature([1], tf.int64) for key in (USER_KEY, ITEM_KEY)}


def schema():
    """`feature_spec` as a TFMD schema."""
    from tensorflow_transform.tf_metadata import schema_utils
    return schema_utils.schema_from_feature_spec(feature_spec())


def input_fn(file_pattern: List[str], data_accessor: tfx.components.DataAccessor,
             batch_size: int, shuffle: bool = True) -> tf.data.Dataset:
    """The examples as {user_id, item_id} batches, repeated.

    Args:
        file_pattern: the files (`fn_args.train_files` or `eval_files`).
        data_accessor: the Trainer's `DataAccessor` (it replaces a training
            batch by the effective batch when one is set).
        batch_size: the run_fn's own batch.
        shuffle: shuffle (seeded) or keep the files' order.

    Returns:
        The dataset.
    """
    return data_accessor.tf_dataset_factory(
        file_pattern,
        tfxio.TensorFlowDatasetOptions(batch_size=batch_size, shuffle=shuffle, shuffle_seed=1),
        schema=schema(),
    ).repeat()
