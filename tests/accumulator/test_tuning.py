"""KerasTuner: each trial trains with its own accum_steps and micro-batch (or, with
`gradient_cache`, its own GradientCache accum_steps and effective batch)."""

import pytest

keras_tuner = pytest.importorskip("keras_tuner")     # not in the oldest environment
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfx_gradient_accumulator.accumulator import GradientAccumulator, GradientCache  # noqa: E402
from tfx_gradient_accumulator.accumulator.tuning import AccumulatingHyperModel, declare_accumulation  # noqa: E402
from tests.accumulator import contrastive_models as cm  # noqa: E402
from tests.accumulator import reference as ref  # noqa: E402


def test_declare_refuses_choices_that_do_not_divide():
    with pytest.raises(ValueError, match="divide evenly"):
        declare_accumulation(keras_tuner.HyperParameters(), accum_steps=(1, 3), effective_batch_sizes=(32,))
    with pytest.raises(ValueError, match=r"`accum_steps\[0\]` must be a positive integer"):
        declare_accumulation(keras_tuner.HyperParameters(), accum_steps=(0, 2))
    with pytest.raises(TypeError, match=r"`effective_batch_sizes\[1\]` .* received '64'"):
        declare_accumulation(keras_tuner.HyperParameters(), accum_steps=(1,), effective_batch_sizes=(32, "64"))


class SampleCount(keras.metrics.Metric):
    """Counts the samples trained on (to see each trial's micro-batch at work)."""

    def __init__(self, name="samples", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), "zeros", dtype="float32", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(tf.cast(tf.shape(y_true)[0], "float32"))

    def result(self):
        return self.total


def _build(hp):
    model = ref.mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", metrics=[SampleCount()])
    return model


# A dataset's trials apart (49 s): arrays and a dataset reach the trial's fit alike.
@pytest.mark.parametrize("as_dataset", [pytest.param(True, marks=pytest.mark.apart), False])
def test_each_trial_accumulates_with_its_own_micro_batch(tmp_path, as_dataset):
    x, y = ref.regression_data(512)
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            self.batches = batch + 1

        def on_epoch_end(self, epoch, logs=None):
            opt = self.model.optimizer
            seen.append((opt.accum_steps, int(opt.iterations.numpy()), self.batches, int(logs["samples"])))

    # 4 trials: accum_steps 1 (no window) and 4, each effective batch: 4 micro-batches of
    # 16, 32, 4 and 8 samples, each trial's own.
    tuner = keras_tuner.GridSearch(
        AccumulatingHyperModel(_build, accum_steps=(1, 4), effective_batch_sizes=(16, 32)),
        objective="loss", directory=str(tmp_path), project_name="p", max_trials=4,
    )
    data = dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(100).repeat()) if as_dataset else dict(x=x, y=y)
    tuner.search(**data, steps_per_epoch=5, epochs=1, verbose=0, callbacks=[Probe()])
    # 5 updates per trial whatever accum_steps: 5 x accum micro-steps of
    # effective / accum samples, so 5 x effective samples.
    assert sorted(seen) == sorted((a, 5, 5 * a, 5 * b) for a in (1, 4) for b in (16, 32))
    best = tuner.get_best_hyperparameters()[0]
    assert best.get("accum_steps") in (1, 4) and best.get("effective_batch_size") in (16, 32)


def test_trial_with_accumulation_equals_the_big_batch(tmp_path):
    """One trial: accum 4 × micro 8 trains like batch 32 (same weights)."""
    x, y = ref.regression_data(256)
    hp = keras_tuner.HyperParameters()
    hp.Fixed("accum_steps", 4)
    hp.Fixed("effective_batch_size", 32)
    hypermodel = AccumulatingHyperModel(_build, accum_steps=(4,), effective_batch_sizes=(32,))
    model = hypermodel.build(hp)
    assert isinstance(model.optimizer, GradientAccumulator) and model.optimizer.accum_steps == 4
    hypermodel.fit(hp, model, tf.data.Dataset.from_tensor_slices((x, y)).batch(50), verbose=0)
    expected = ref.fit_large_batch(ref.mlp(), keras.optimizers.SGD(0.05), x, y, 32)
    assert ref.max_abs_diff(model.get_weights(), expected.get_weights()) <= 1e-6


# ------------------------------------------- losses that couple the batch: GradientCache

def _build_gradient_cache(hp):
    model = GradientCache(cm.built("two_tower"), accum_steps=1)
    model.compile(optimizer=keras.optimizers.Adam(1e-2))
    return model


def test_gradient_cache_trial_equals_keras_large_batch(tmp_path):
    """One trial of a two-tower (in-batch softmax): GradientCache in 4 micro-batches of 8,
    fed batches of 32, trains like Keras' own fit at batch 32."""
    data = cm.interactions(256)
    hp = keras_tuner.HyperParameters()
    hp.Fixed("accum_steps", 4)
    hp.Fixed("effective_batch_size", 32)
    hypermodel = AccumulatingHyperModel(_build_gradient_cache, accum_steps=(4,), effective_batch_sizes=(32,),
                                        gradient_cache=True)
    model = hypermodel.build(hp)
    assert isinstance(model, GradientCache) and model.accum_steps == 4
    assert type(model.optimizer) is keras.optimizers.Adam
    # Batched at 50 (re-batched at 32 by the trial), repeated: 8 updates are the 256 samples once.
    hypermodel.fit(hp, model, tf.data.Dataset.from_tensor_slices(data).batch(50).repeat(), steps_per_epoch=8,
                   verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 8
    expected = cm.built("two_tower")
    expected.compile(optimizer=keras.optimizers.Adam(1e-2))
    expected.fit(data, batch_size=32, shuffle=False, verbose=0)
    assert ref.max_abs_diff(model.model.get_weights(), expected.get_weights()) <= 1e-5
    assert ref.max_abs_diff(expected.get_weights(), cm.built("two_tower").get_weights()) > 1e-2


# Apart (36 s): the Trainer's GradientCache tuning runs in make test's TFX lane, and the trials'
# accum_steps and effective batch by the Keras model's trials above.
@pytest.mark.apart
def test_each_gradient_cache_trial_has_its_accum_steps_and_effective_batch(tmp_path):
    data = cm.interactions(256)
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append((self.model.accum_steps, int(self.model.optimizer.iterations.numpy())))

    tuner = keras_tuner.GridSearch(
        AccumulatingHyperModel(_build_gradient_cache, accum_steps=(2, 4), effective_batch_sizes=(32, 64),
                               gradient_cache=True),
        objective="loss", directory=str(tmp_path), project_name="p", max_trials=4,
    )
    tuner.search(data, epochs=1, verbose=0, callbacks=[Probe()])
    # One update per batch of the effective batch: 256 / b updates, whatever accum_steps.
    assert sorted(seen) == sorted((a, 256 // b) for a in (2, 4) for b in (32, 64))
    # steps_per_epoch counts updates, as TrainArgs.num_steps does.
    hp = tuner.get_best_hyperparameters()[0]
    model = tuner.hypermodel.build(hp)
    tuner.hypermodel.fit(hp, model, tf.data.Dataset.from_tensor_slices(data).repeat().batch(100),
                         steps_per_epoch=3, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 3


def test_gradient_cache_hypermodel_refuses_a_model_that_does_not_match():
    hp = keras_tuner.HyperParameters()
    with pytest.raises(ValueError, match="must wrap its model in accumulator.GradientCache"):
        AccumulatingHyperModel(_build, accum_steps=(2,), effective_batch_sizes=(32,), gradient_cache=True).build(hp)
    with pytest.raises(ValueError, match="without gradient_cache=True.*AccumulatingHyperModel"):
        AccumulatingHyperModel(_build_gradient_cache, accum_steps=(2,), effective_batch_sizes=(32,)).build(hp)
    with pytest.raises(ValueError, match="`gradient_cache` must be True or False; received 'yes'"):
        AccumulatingHyperModel(_build, gradient_cache="yes")


def test_auto_trials_start_from_their_effective_batch_grow_and_hand_auto_to_the_trainer(tmp_path, easy_auto):
    """accum_steps="auto": each trial starts at 2 micro-batches of half its effective batch
    and grows with the noise scale; the best hyperparameters say "auto" and the limit, which
    the Trainer's settings read (tests/components/test_auto_accumulation_trainer.py)."""
    x, y = ref.regression_data(512)
    seen = []

    class Probe(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.first_accum = self.model.optimizer.accum_steps

        def on_epoch_end(self, epoch, logs=None):
            opt = self.model.optimizer
            seen.append((self.first_accum, int(logs["samples"]), dict(opt.auto_accumulation.schedule),
                         int(opt.iterations.numpy())))

    tuner = keras_tuner.GridSearch(
        AccumulatingHyperModel(_build, accum_steps="auto", effective_batch_sizes=(4, 8),
                               max_effective_batch_size=32),
        objective="loss", directory=str(tmp_path), project_name="p", max_trials=2,
    )
    tuner.search(x=x, y=y, steps_per_epoch=40, epochs=1, verbose=0, callbacks=[Probe()])
    # 40 updates at the starting batch: 80 micro-batches of E/2, so 40 x E samples; grown,
    # the run makes fewer updates.
    assert sorted((a, s) for a, s, _, _ in seen) == [(2, 160), (2, 320)]
    for _, _, schedule, updates in seen:
        assert schedule[0] == 2 and len(schedule) >= 2 and updates <= 40
    assert min(updates for _, _, _, updates in seen) < 40
    best = tuner.get_best_hyperparameters()[0]
    assert (best.get("accum_steps"), best.get("max_effective_batch_size")) == ("auto", 32)


@pytest.mark.parametrize("kwargs, message", [
    (dict(accum_steps="auto"), "needs `max_effective_batch_size`"),
    (dict(accum_steps="auto", max_effective_batch_size=4), "`max_effective_batch_size` must be an integer >= 8"),
    (dict(accum_steps="auto", max_effective_batch_size=32, effective_batch_sizes=(5, 8)), "must be even"),
    (dict(accum_steps="auto", max_effective_batch_size=32, gradient_cache=True), "gradient_cache=True"),
    (dict(accum_steps=(1, 2), max_effective_batch_size=32), "the limit of `accum_steps='auto'`"),
])
def test_bad_auto_tuning_arguments_are_refused_before_any_trial(kwargs, message):
    kwargs.setdefault("effective_batch_sizes", (4, 8))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        AccumulatingHyperModel(_build, **kwargs)
