"""Builds what the user's run_fn sees when it trains with accumulation.

Starting from the stock Trainer's `FnArgs`:
* `train_steps` counts `fit` steps: `TrainArgs.num_steps` (optimizer updates)
  times `accum_steps` micro-steps, so `fit(steps_per_epoch=fn_args.train_steps)`
  makes exactly `num_steps` updates; with `gradient_cache`, one step is one
  update, so it stays `num_steps`;
* with an effective batch set, datasets made through `data_accessor` for the
  training files come batched at the global micro-batch (with
  `gradient_cache`: at the effective batch, which the `GradientCache` model
  cuts into micro-batches); evaluation datasets keep the batch the run_fn asks for;
* on a cluster (several workers), datasets made through `data_accessor` whose
  auto-shard policy is left at AUTO get DATA: every worker reads the files and
  keeps its part of each batch, so a global batch holds the samples the
  one-machine run's batch holds (FILE sharding would give each worker other
  files: other batches, and an error with fewer files than workers);
* `custom_config["accumulation"]` describes the settings for the curious run_fn.
"""

import copy

import tensorflow as tf
from tfx.components.trainer import fn_args_utils as tfx_fn_args_utils

from tfx_gradient_accumulator.components.settings import AccumulationSettings


def _is_training_pattern(file_pattern, train_files):
    patterns = [file_pattern] if isinstance(file_pattern, str) else list(file_pattern)
    return bool(patterns) and set(patterns) <= set(train_files)


def _sharded_by_data(dataset):
    policy = tf.data.experimental.AutoShardPolicy
    if dataset.options().experimental_distribute.auto_shard_policy != policy.AUTO:
        return dataset      # the run_fn's own choice
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = policy.DATA
    return dataset.with_options(options)


def micro_batched_accessor(data_accessor, train_files, micro_batch, workers=1):
    """A DataAccessor whose training datasets come batched at `micro_batch` (the
    batch of one `fit` step: the effective batch with `gradient_cache`), and
    sharded by data when `workers` > 1."""
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
