"""Builds what the user's run_fn sees when it trains with accumulation.

`for_accumulation` turns the stock Trainer's `FnArgs` into the run_fn's:
`train_steps` in `fit` steps, training datasets batched at the micro-batch (at the
effective batch with `gradient_cache` or `micro_batch_size`: each `fit` step is then one
update; sharded by data on a cluster), and the settings in `custom_config`.
"""

from __future__ import annotations

import copy

import tensorflow as tf
from tfx.components.trainer import fn_args_utils as tfx_fn_args_utils

from tfx_gradient_accumulator.components.settings import AccumulationSettings


def _is_training_pattern(file_pattern, train_files):
    """Whether `file_pattern` (one or several) names training files only."""
    patterns = [file_pattern] if isinstance(file_pattern, str) else list(file_pattern)
    return bool(patterns) and set(patterns) <= set(train_files)


def _sharded_by_data(dataset):
    """`dataset` with auto-shard policy DATA, unless the run_fn chose a policy itself."""
    policy = tf.data.experimental.AutoShardPolicy
    if dataset.options().experimental_distribute.auto_shard_policy != policy.AUTO:
        return dataset      # the run_fn's own choice
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy.DATA
    return dataset.with_options(options)


def micro_batched_accessor(data_accessor, train_files: list, micro_batch: int | None, workers: int = 1):
    """A DataAccessor whose training datasets come batched at `micro_batch`.

    Only datasets of the training files change: evaluation datasets keep the
    batch the run_fn asks for. On a cluster, a dataset whose auto-shard policy
    is left at AUTO gets DATA: every worker reads the files and keeps its part
    of each batch (FILE would give each worker other files, other batches).

    Args:
        data_accessor: the stock Trainer's `DataAccessor` (None: returned as is).
        train_files: the training file patterns (`fn_args.train_files`).
        micro_batch: the batch of one `fit` step (the effective batch with
            `gradient_cache` or `micro_batch_size`); None: the run_fn's own.
        workers: the processes that train.

    Returns:
        A `DataAccessor` whose `tf_dataset_factory` does the above, or
        `data_accessor` itself when there is nothing to change.
    """
    if (micro_batch is None and workers == 1) or data_accessor is None:
        return data_accessor
    make_dataset = data_accessor.tf_dataset_factory

    def tf_dataset_factory(file_pattern, dataset_options, schema=None):
        if micro_batch is not None and _is_training_pattern(file_pattern, train_files):
            dataset_options = dataset_options._replace(batch_size=micro_batch)
        dataset = make_dataset(file_pattern, dataset_options, schema)
        return _sharded_by_data(dataset) if workers > 1 else dataset

    return data_accessor._replace(tf_dataset_factory=tf_dataset_factory)


def for_accumulation(
    fn_args: tfx_fn_args_utils.FnArgs, settings: AccumulationSettings, workers: int = 1
) -> tfx_fn_args_utils.FnArgs:
    """The `FnArgs` the user's run_fn gets.

    Args:
        fn_args: the stock Trainer's `FnArgs`; not changed.
        settings: the resolved accumulation settings.
        workers: the processes that train.

    Returns:
        A copy whose `train_steps` counts `fit` steps (`TrainArgs.num_steps`
        updates times `steps_per_update` micro-steps, so
        `fit(steps_per_epoch=fn_args.train_steps)` makes exactly `num_steps`
        updates), whose `data_accessor` is `micro_batched_accessor`'s, and
        whose `custom_config["accumulation"]` describes the settings.
    """
    result = copy.copy(fn_args)
    if fn_args.train_steps is not None:
        result.train_steps = fn_args.train_steps * settings.steps_per_update
    result.data_accessor = micro_batched_accessor(
        fn_args.data_accessor, fn_args.train_files or [], settings.train_batch, workers
    )
    custom_config = dict(fn_args.custom_config or {})
    custom_config["accumulation"] = {
        **settings.as_properties(),
        "optimizer_updates": fn_args.train_steps,
    }
    result.custom_config = custom_config
    return result
