"""Held-out recall@k of the retrieval pipeline's trained model, against the known structure.

Reads the held-out interactions (the `eval` split of the ExampleGen's
examples) and the exported model's `query` and `candidate` signatures, scores
every item for each interaction's user by dot product, and counts how often
the true item is among the top k. The same interactions ranked by the
generating distribution (`data.oracle_recall_at_k`) give the most a model
can expect, and k / ITEMS what guessing gets: the model's recall is read
between the two. Items the user met in training are not filtered out (the
clusters make repeats expected).
"""

import glob
import os

import numpy as np
import tensorflow as tf

from tfx_gradient_accumulator.pipelines.retrieval.data import ITEM_KEY, ITEMS, USER_KEY, oracle_recall_at_k, recall_at_k


def read_split(examples_uri: str, split: str = "eval") -> tuple:
    """The interactions of one split of an Examples artifact (gzipped TFRecords).

    Args:
        examples_uri: the Examples artifact's folder.
        split: the split's name.

    Returns:
        `(user ids, item ids)`, two int64 arrays.

    Raises:
        FileNotFoundError: the artifact has no such split.
    """
    files = sorted(glob.glob(os.path.join(examples_uri, f"Split-{split}", "*")))
    if not files:
        raise FileNotFoundError(f"No `{split}` split under {examples_uri!r}.")
    spec = {key: tf.io.FixedLenFeature([], tf.int64) for key in (USER_KEY, ITEM_KEY)}
    users, items = [], []
    for batch in tf.data.TFRecordDataset(files, compression_type="GZIP").batch(1024):
        parsed = tf.io.parse_example(batch, spec)
        users.append(parsed[USER_KEY].numpy())
        items.append(parsed[ITEM_KEY].numpy())
    return np.concatenate(users), np.concatenate(items)


def held_out_recall(serving_model_dir: str, examples_uri: str, k: int = 10) -> dict:
    """The exported model's recall@k on the eval split, beside the oracle's and chance's.

    Args:
        serving_model_dir: the exported model (its `query` and `candidate` signatures).
        examples_uri: the Examples artifact's folder.
        k: how many of the top-scored items count.

    Returns:
        `{"recall_at_k", "oracle_recall_at_k", "chance_recall_at_k", "k", "interactions"}`.
    """
    users, items = read_split(examples_uri)
    model = tf.saved_model.load(serving_model_dir)
    queries = model.query(tf.constant(users, tf.int64)).numpy()
    candidates = model.candidate(tf.range(ITEMS, dtype=tf.int64)).numpy()
    return {
        "recall_at_k": recall_at_k(queries @ candidates.T, items, k),
        "oracle_recall_at_k": oracle_recall_at_k(users, items, k),
        "chance_recall_at_k": k / ITEMS,
        "k": k,
        "interactions": int(len(users)),
    }
