"""Losses that couple the batch, written on representations: what `GradientCache` is for.

Each takes the representations of a whole batch (row i of one tensor is the
positive of row i of the other; every other row is a negative) and returns the
mean loss over the batch, as a scalar. Use them in a model's `compute_loss`:

```python
def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
    return contrastive.in_batch_softmax(y_pred["query"], y_pred["candidate"])
```
"""

import tensorflow as tf


def in_batch_softmax(query, candidate, temperature=1.0):
    """Retrieval with in-batch negatives (TensorFlow Recommenders' `Retrieval` task):
    each query's softmax over every candidate of the batch, its own as the label."""
    logits = tf.matmul(query, candidate, transpose_b=True) / temperature
    return _cross_entropy_on_the_diagonal(logits)


def symmetric_info_nce(first, second, logit_scale):
    """CLIP's loss: cosine similarities scaled by `exp(logit_scale)` (a learned
    temperature), cross-entropy over rows and over columns, averaged."""
    first, second = tf.math.l2_normalize(first, axis=1), tf.math.l2_normalize(second, axis=1)
    logits = tf.exp(tf.cast(logit_scale, first.dtype)) * tf.matmul(first, second, transpose_b=True)
    return (_cross_entropy_on_the_diagonal(logits) + _cross_entropy_on_the_diagonal(tf.transpose(logits))) / 2


def nt_xent(first_view, second_view, temperature=0.5):
    """SimCLR's loss over two views of each sample: for each of the 2B views, the
    other view of its sample against the other 2B - 2 views."""
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
