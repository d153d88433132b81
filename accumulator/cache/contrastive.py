"""Losses that couple the batch, written on representations: what `GradientCache` is for.

Each takes the representations of a whole batch (row i of one tensor is the
positive of row i of the other; every other row is a negative) and returns the
mean loss over the batch, as a scalar. Use them in a model's `compute_loss`:

```python
def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
    return contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])
```
"""

from __future__ import annotations

import tensorflow as tf


def in_batch_softmax(query: tf.Tensor, candidate: tf.Tensor, temperature: float = 1.0) -> tf.Tensor:
    """Retrieval with in-batch negatives (TensorFlow Recommenders' `Retrieval` task).

    Each query's softmax over every candidate of the batch, its own as the label.

    Args:
        query: `[batch, dim]` query representations.
        candidate: `[batch, dim]` candidate representations; row i is query i's positive.
        temperature: the logits are the dot products divided by it.

    Returns:
        The mean cross-entropy over the batch, a float32 scalar.
    """
    logits = tf.matmul(query, candidate, transpose_b=True) / temperature
    return _cross_entropy_on_the_diagonal(logits)


def symmetric_info_nce(first: tf.Tensor, second: tf.Tensor, logit_scale) -> tf.Tensor:
    """CLIP's loss: cross-entropy over rows and over columns of scaled cosine similarities.

    Args:
        first: `[batch, dim]` representations of one modality.
        second: `[batch, dim]` representations of the other; row i is row i's positive.
        logit_scale: a scalar (often a trainable variable): the similarities are
            multiplied by `exp(logit_scale)`, a learned inverse temperature.

    Returns:
        The two cross-entropies' average, a float32 scalar.
    """
    first, second = tf.math.l2_normalize(first, axis=1), tf.math.l2_normalize(second, axis=1)
    logits = tf.exp(tf.cast(logit_scale, first.dtype)) * tf.matmul(first, second, transpose_b=True)
    return (_cross_entropy_on_the_diagonal(logits) + _cross_entropy_on_the_diagonal(tf.transpose(logits))) / 2


def nt_xent(first_view: tf.Tensor, second_view: tf.Tensor, temperature: float = 0.5) -> tf.Tensor:
    """SimCLR's loss over two views of each sample.

    For each of the 2B views, the other view of its sample is the positive and
    the other 2B - 2 views are the negatives.

    Args:
        first_view: `[batch, dim]` representations of the first views.
        second_view: `[batch, dim]` representations of the second views.
        temperature: the cosine similarities are divided by it.

    Returns:
        The mean cross-entropy over the 2B views, a float32 scalar.
    """
    z = tf.math.l2_normalize(tf.concat([first_view, second_view], axis=0), axis=1)
    size = tf.shape(first_view)[0]
    logits = tf.cast(tf.matmul(z, z, transpose_b=True), tf.float32) / temperature
    itself = tf.cast(tf.eye(2 * size), tf.bool)
    logits = tf.where(itself, tf.constant(-1e9, tf.float32), logits)
    labels = tf.concat([tf.range(size, 2 * size), tf.range(size)], axis=0)
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, logits))


def _cross_entropy_on_the_diagonal(logits):
    labels = tf.range(tf.shape(logits)[0])
    return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels, tf.cast(logits, tf.float32)))
