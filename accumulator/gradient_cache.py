"""Exact large batches for losses that couple the batch: gradient caching.

A contrastive loss (in-batch negatives, InfoNCE, CLIP, SimCLR) scores every
sample of a batch against every other: the batch *is* the set of negatives.
Accumulating micro-batch gradients is then wrong by design, not merely
approximate: micro-batches of b give each sample b - 1 negatives, not N·b - 1.
Gradient caching (Gao et al., "Scaling Deep Contrastive Learning Batch Size
under Memory Limited Setup", 2021) makes the large batch exact with one
micro-batch's activations in memory at a time. `GradientCache` does it inside
Keras' `fit`, for every batch `fit` gives it, in three passes:

1. **Represent.** The wrapped model runs over each of the `accum_steps`
   micro-batches without a tape: no activations are kept, only the outputs
   (the representations: small).
2. **Score.** The loss of the whole batch is computed on the concatenated
   representations, under a tape: its gradient with respect to every
   representation (and to any variable the loss itself uses, such as a learned
   temperature, or weight regularization).
3. **Back-propagate.** Each micro-batch runs again under a tape, one after
   another (a `tf.while_loop`), and sends its slice of that gradient back through the model: the
   parameter gradients add up (dense ones summed, sparse embedding rows
   concatenated in sample order) to the large batch's gradient, which the
   optimizer applies once.

So `fit(x, batch_size=N·b)` on `GradientCache(model, accum_steps=N)` trains like
`fit(x, batch_size=N·b)` on `model`, holding the activations of b samples at a
time, for one extra forward pass. Nothing is held between steps, so nothing is
lost when training stops between any two steps: any checkpoint resumes exactly.

What the loss sees is the wrapped model's `compute_loss(x, y, y_pred,
sample_weight)` (its own override, as Keras 3 models that compute a contrastive
loss write it), or else the loss this wrapper was compiled with, with `y_pred` the
representations of the whole batch. Under a `tf.distribute` strategy each
replica computes the loss on its own share of the batch, as Keras' large batch
does under the same strategy: the same negatives.

Refused, before any training, with a message: layers whose training output
mixes the samples of a batch (`BatchNormalization`: it would normalize with
micro-batch statistics) and losses added while the model runs (`add_loss`,
activity regularizers: they would come from one micro-batch). Dropout and other
random layers draw the same numbers in passes 1 and 3 (their seeds are rewound),
but not the numbers the large batch would draw.
"""

import keras
import tensorflow as tf

from tfx_gradient_accumulator.accumulator import lookups, seam
from tfx_gradient_accumulator.accumulator.window import validate_accum_steps


@keras.saving.register_keras_serializable(package="accumulator")
class GradientCache(keras.Model):
    """Trains `model` on each batch in `accum_steps` micro-batches with the whole
    batch's loss: exact large batches for losses that couple the batch.

    Args:
        model: a Keras 3 model whose outputs (any structure of tensors whose first
            axis is the batch) are what the loss scores. Unchanged: its
            `compute_loss`, if it overrides one, is the loss.
        accum_steps: micro-batches per batch (positive int). A batch of B samples is
            cut into micro-batches of ceil(B / accum_steps), in order; the last may
            be shorter, which changes nothing (the loss is always the batch's).

    ```python
    model = GradientCache(two_tower, accum_steps=8)
    model.compile(optimizer=keras.optimizers.Adam(1e-3))
    model.fit(dataset.batch(4096))   # in-batch negatives of 4096, activations of 512
    ```
    """

    def __init__(self, model, accum_steps, **kwargs):
        super().__init__(**kwargs)
        self.accum_steps = validate_accum_steps(accum_steps)
        if not isinstance(model, keras.Model) or seam.is_keras2_object(model):
            raise TypeError(f"`model` must be a Keras 3 `keras.Model`; received {type(model).__name__}.")
        self.model = model
        # Built with the model: `fit` never calls the wrapper itself, and saving
        # and loading need it built (the optimizer is restored onto its variables).
        self.built = model.built

    def build(self, input_shape=None):
        if not self.model.built:
            self.model.build(input_shape)
        self.built = True

    def call(self, inputs, training=None):
        return self.model(inputs, training=training)

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        if type(self.model).compute_loss is not keras.Model.compute_loss:
            return self.model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)
        return super().compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self._refuse_what_would_not_be_exact()
        micro_batches = self._micro_batches(x)
        variables = self.trainable_variables
        # What a forward pass changes and pass 3 must replay: random seeds and
        # counters (integers), not frozen weights (BatchNormalization is refused).
        state = [v for v in self.model.variables if not v.trainable and not _is_float(v)]
        saved = [tf.identity(v.value) for v in state]
        # 1. Represent every micro-batch, keeping no activations, one after another.
        representations = []
        for part in micro_batches:
            part = _after(representations[-1:], part)
            representations.append(self.model(part, training=True))
        self._refuse_losses_added_while_running()
        whole = tf.nest.map_structure(lambda *parts: tf.concat(parts, axis=0), *representations)
        # 2. Score the whole batch; its gradient by representation (and by the loss's own variables).
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(whole)
            loss = self.compute_loss(x=x, y=y, y_pred=whole, sample_weight=sample_weight, training=True)
            scaled = self.optimizer.scale_loss(loss)
        by_representation = tape.gradient(scaled, whole, unconnected_gradients=tf.UnconnectedGradients.ZERO)
        grads = tape.gradient(scaled, variables)
        del tape
        # 3. Back-propagate each micro-batch's slice, one micro-batch in memory at a time.
        for v, value in zip(state, saved):
            v.assign(value)
        lookups.note_batch_size(tf.TensorShape(tf.nest.flatten(micro_batches[0])[0].shape)[0],
                                tf.compat.v1.get_default_graph())
        grads = [_add(from_loss, from_model) for from_loss, from_model in zip(grads, _summed_over(
            lambda k: self._backpropagate(x, by_representation, k, variables), self.accum_steps))]
        # The count waits for the gradients: the step Keras runs on a dataset of
        # unknown size that has run out makes no update and counts none.
        with tf.control_dependencies([g.values if isinstance(g, tf.IndexedSlices) else g
                                      for g in grads if g is not None]):
            self.optimizer.apply_gradients(zip(grads, variables))
        seam.loss_tracker(self).update_state(
            loss * tf.distribute.get_strategy().num_replicas_in_sync,
            sample_weight=tf.shape(tf.nest.flatten(x)[0])[0])
        return self.compute_metrics(x, y, whole, sample_weight=sample_weight)

    def _micro_batches(self, x):
        return [self._micro_batch(x, k) for k in range(self.accum_steps)]

    def _micro_batch(self, x, k):
        """Micro-batch `k` (an int or a scalar tensor) of `x`, or of anything whose
        first axis follows the samples (the representations' gradient)."""
        size = tf.shape(tf.nest.flatten(x)[0])[0]
        step = (size + self.accum_steps - 1) // self.accum_steps
        return tf.nest.map_structure(lambda t: t[k * step:(k + 1) * step], x)

    def _backpropagate(self, x, by_representation, k, variables):
        """Pass 3 for micro-batch `k`: its forward under a tape, and the parameter
        gradients its slice of the whole batch's gradient sends back."""
        upstream = self._micro_batch(by_representation, k)
        # Its forward could run any time; not before the scores, or its activations
        # would wait for them beside pass 1's.
        part = _after([upstream], self._micro_batch(x, k))
        with tf.GradientTape() as tape:
            outputs = self.model(part, training=True)
            surrogate = tf.add_n([tf.reduce_sum(o * tf.cast(u, o.dtype)) for o, u in
                                  zip(tf.nest.flatten(outputs), tf.nest.flatten(upstream))])
        return tape.gradient(surrogate, variables)

    def _refuse_what_would_not_be_exact(self):
        for layer in seam.flatten_layers(self.model):
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
                raise ValueError(
                    f"GradientCache: layer {layer.name!r} is a BatchNormalization, whose training "
                    "output depends on the other samples of its batch; it would normalize with "
                    "micro-batch statistics, not the batch's. Use LayerNormalization, or freeze "
                    "the layer (trainable=False).")

    def _refuse_losses_added_while_running(self):
        regularized = sum(1 for v in self.trainable_variables if getattr(v, "regularizer", None) is not None)
        if len(self.losses) > regularized:
            raise ValueError(
                "GradientCache: the model adds losses while it runs (`add_loss`, an "
                "activity_regularizer); they would come from one micro-batch, not the batch. "
                "Put them into `compute_loss`, on the representations, or use weight "
                "regularizers (kernel_regularizer), which GradientCache handles exactly.")

    def get_config(self):
        return {**super().get_config(), "model": keras.saving.serialize_keras_object(self.model),
                "accum_steps": self.accum_steps}

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        model = keras.saving.deserialize_keras_object(config.pop("model"))
        return cls(model, **config)


def _summed_over(gradients_of, count):
    """`gradients_of(k)` for k < `count`, added up: dense gradients summed, sparse rows
    (`tf.IndexedSlices`) concatenated in order, as the large batch's gradient has them,
    except the rows of a lookup made once per batch (`accumulator.lookups`: ids that
    do not depend on the sample), which the large batch has once per id position
    with every sample summed into it: those are summed position by position.

    Micro-batch 0 runs first, on its own, to tell which variables get which kind;
    the others run in a `tf.while_loop` with `parallel_iterations=1`: TensorFlow runs
    its iterations one after another and frees each one's activations before the
    next (an unrolled graph, even chained by control dependencies, measured to
    keep about one more micro-batch's activations alive).
    """
    first = gradients_of(0)
    shared = {i for i, g in enumerate(first) if isinstance(g, tf.IndexedSlices)
              and lookups.kind_of_rows(g.indices) == lookups.ONCE_PER_BATCH}
    dense = [i for i, g in enumerate(first) if g is not None and not isinstance(g, tf.IndexedSlices)]
    sparse = [i for i, g in enumerate(first) if isinstance(g, tf.IndexedSlices) and i not in shared]
    shared = sorted(shared)

    def rows_of(g):
        arrays = [tf.TensorArray(part.dtype, size=count, infer_shape=False,
                                 element_shape=tf.TensorShape([None]).concatenate(part.shape[1:]))
                  for part in (g.values, g.indices)]
        return [arrays[0].write(0, g.values), arrays[1].write(0, g.indices)]

    def add(k, totals, rows):
        grads = gradients_of(k)
        return (k + 1, [total + (grads[i] if i in dense else grads[i].values)
                        for total, i in zip(totals, dense + shared)],
                [[values.write(k, grads[i].values), indices.write(k, grads[i].indices)]
                 for (values, indices), i in zip(rows, sparse)])

    _, totals, rows = tf.while_loop(
        lambda k, totals, rows: k < count, add,
        (tf.constant(1), [first[i] for i in dense] + [first[i].values for i in shared],
         [rows_of(first[i]) for i in sparse]),
        parallel_iterations=1)
    summed = [None] * len(first)
    for i, total in zip(dense + shared, totals):
        summed[i] = total if i in dense else tf.IndexedSlices(total, first[i].indices, first[i].dense_shape)
    for i, (values, indices) in zip(sparse, rows):
        summed[i] = tf.IndexedSlices(values.concat(), indices.concat(), first[i].dense_shape)
    return summed


def _is_float(variable):
    return tf.as_dtype(variable.dtype).is_floating


def _after(dependencies, part):
    """`part`, read only once every tensor in `dependencies` exists."""
    tensors = [t.values if isinstance(t, tf.IndexedSlices) else t for t in tf.nest.flatten(dependencies)]
    if not tensors:
        return part
    with tf.control_dependencies(tensors):
        return tf.nest.map_structure(tf.identity, part)


def _add(total, grad):
    """Two micro-batches' gradients as one: sparse rows concatenated in sample order
    (the large batch's `IndexedSlices`), dense ones summed."""
    if total is None or grad is None:
        return grad if total is None else total
    if isinstance(total, tf.IndexedSlices) and isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(tf.concat([total.values, grad.values], 0),
                                tf.concat([total.indices, grad.indices], 0), total.dense_shape)
    return tf.convert_to_tensor(total) + tf.convert_to_tensor(grad)
