"""The Adam-moment benchmark's plumbing: variants, the rescale at the growth, the figures (no long training)."""

import types

import numpy as np
import pytest

from benchmarks import adam_moment as am
from benchmarks import auto_batch_analysis as aba

SETTINGS = {"micro": 16, "start": 32, "max": 256, "lr0": 1e-2, "epochs": 5}


def task(budget=40_960):
    return types.SimpleNamespace(settings=dict(SETTINGS), budget=budget)


def test_the_growth_comes_after_a_third_of_the_samples_and_doubles_the_batch():
    t = task()
    growth = am.growth_update(t)
    assert growth * SETTINGS["start"] == pytest.approx(t.budget / 3, abs=SETTINGS["start"])
    keep, rescale = am.variant_config(t, "keep", growth), am.variant_config(t, "rescale", growth)
    assert keep["schedule"] == rescale["schedule"] == {0: 2, growth: 4}
    assert (keep["rescale"], rescale["rescale"]) == (False, True)
    assert am.variant_config(t, "fixed_a", growth)["effective_batch"] == 32
    assert am.variant_config(t, "fixed_2a", growth)["effective_batch"] == 64
    with pytest.raises(ValueError, match="variant"):
        am.variant_config(t, "reset", growth)


def test_the_all_noise_arithmetic():
    assert am.theory_excess(0, 400) == pytest.approx(2.0)
    assert am.old_share(10, 400) == pytest.approx((0.999 ** 10 - 0.999 ** 410) / (1 - 0.999 ** 410))
    assert am.theory_excess(10_000, 400) == pytest.approx(1.0, abs=1e-4)


def test_recalibrated_after_needs_the_excess_to_stay_low():
    assert am.recalibrated_after([10, 20, 30, 40], [1.5, 1.05, 1.2, 1.08]) == 40
    assert am.recalibrated_after([10, 20], [1.5, 1.3]) is None


def test_bootstrap_mean_of_paired_differences():
    out = aba.bootstrap_mean([0.01, 0.02, 0.03, 0.015, 0.025])
    assert out["low"] > 0 and out["low"] <= out["mean"] <= out["high"] and out["positive"] == 5
    mixed = aba.bootstrap_mean([-0.02, 0.02, -0.01, 0.01, 0.0])
    assert mixed["low"] < 0 < mixed["high"]
    assert "no difference" in am.verdict(mixed) and "lowers" in am.verdict({"low": -2, "high": -1})


def _run(seed, variant, growth=20, end=40, final=2.0):
    """A synthetic run: a falling curve and a probe whose v̂ ratio falls after the growth (keep) or halves."""
    offsets = list(range(-10, end + 1))
    ratio = [None] * 10 + [1.0] + [(0.5 if variant == "rescale" else 1.0) * (1 - 0.002 * o) for o in range(1, end + 1)]
    fresh = [None] * 11 + [{"keep": 1.5, "rescale": 0.8}.get(variant, 1.0) - 0.001 * o for o in range(1, end + 1)]
    curve = [{"samples": s, "updates": s // 32, "val_loss": final + 1.0 / (1 + s / 100)} for s in range(0, 2001, 200)]
    return {"seed": seed, "curve": curve, "schedule": {"0": 2},
            "probe": {"offset": offsets, "ratio": ratio, "fresh": fresh, "step": [0.2] * len(offsets),
                      "lr": [0.01] * len(offsets)}}


def test_analyse_and_write_on_synthetic_runs(tmp_path):
    pytest.importorskip("matplotlib")           # the plot (the venvs of the library's lanes may lack it)
    finals = {"keep": 2.0, "rescale": 1.99, "fixed_a": 1.95, "fixed_2a": 2.05}
    results = {"date": "2026-11-26", "plan": {"quick": True}, "code": {"commit": "abc", "subject": "s"},
               "versions": {"tensorflow": "x", "keras": "y", "python": "z"}, "cpus": 2, "load_at_start": [1.0],
               "settings": dict(SETTINGS), "task": {"description": "synthetic", "budget": 2000, "settings": SETTINGS},
               "growth_update": 20, "lr_scaling": "sqrt", "lr_ramp_updates": 50, "beta2": 0.999,
               "runs": {v: [_run(s, v, final=finals[v] + 0.001 * s) for s in range(3)] for v in am.VARIANTS}}
    results["analysis"] = am.analyse(results)
    a = results["analysis"]
    assert a["seeds"] == [0, 1, 2] and a["last_offset"] == 40
    assert a["differences"]["rescale - keep"]["mean"] == pytest.approx(-0.01, abs=1e-9)
    assert a["staleness"]["10"]["excess_keep"]["median"] == pytest.approx(1.49 / 0.99)
    assert a["staleness"]["200"]["keep"] is None                   # past the run's end
    path = am.write(results, str(tmp_path))
    text = open(path).read()
    assert "past the run's end (+40)" in text and "**rescale**" in text
    assert (tmp_path / "adam_moment.png").exists()


def test_the_probe_halves_adam_v_at_the_growth_and_only_with_rescale():
    keras = pytest.importorskip("keras")
    from tfx_gradient_accumulator.accumulator import AccumulationSchedule, GradientAccumulator

    seen = {}

    def spy(name):
        def read(batch, logs):
            optimizer = model.optimizer
            if not optimizer.held_micro_batches and int(optimizer.iterations.numpy()) == 3:
                _, pairs = am.moment_pairs(optimizer, model.trainable_variables)
                seen[name] = np.concatenate([np.asarray(v).ravel() for _, v in pairs])
                seen[name + "_accum"] = optimizer.accum_steps
        return keras.callbacks.LambdaCallback(on_train_batch_end=read)

    x = np.random.RandomState(0).normal(size=(64, 3)).astype("float32")
    y = x.sum(-1, keepdims=True)
    for rescale in (None, 0.5):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile(optimizer=GradientAccumulator(keras.optimizers.Adam(0.01), 1, schedulable=True), loss="mse")
        probe = am._probe_class()(3, rescale, expect_accum=2)
        model.fit(x, y, batch_size=4, epochs=1, verbose=0, shuffle=False,
                  callbacks=[AccumulationSchedule({0: 1, 3: 2}, by="update"), spy("before"), probe, spy("after")])
        assert seen["before_accum"] == 2
        np.testing.assert_allclose(seen["after"], seen["before"] * (rescale or 1.0), rtol=1e-6)
        assert probe.out["offset"][0] == -2            # from the first update (growth - 10 is before it)
        assert 0 in probe.out["offset"] and probe.out["ratio"][probe.out["offset"].index(0)] == 1.0


def test_a_variant_runs_as_auto_batch_s_train_with_the_probe_after_the_ramp():
    """`train_variant` is `auto_batch.train` with the probe among its callbacks: the ramp grows
    the batch first (the rescale refuses a growth that has not happened), the probe then reads it."""
    keras = pytest.importorskip("keras")
    tf = pytest.importorskip("tensorflow")
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()                   # auto_batch's flags at their defaults
    rng = np.random.RandomState(0)
    x = rng.normal(size=(64, 3)).astype("float32")
    y = x.sum(-1, keepdims=True)
    tiny = types.SimpleNamespace(
        settings={"micro": 4, "start": 8, "max": 16, "lr0": 1e-2, "epochs": 1}, budget=160,
        loss=keras.losses.MeanSquaredError(), x_val=x[:16], y_val=y[:16], lr=lambda effective: 1e-2,
        build=lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
        dataset=lambda seed: tf.data.Dataset.from_tensor_slices((x, y)).repeat().batch(4))
    run = am.train_variant(tiny, 0, "rescale", growth=5)
    assert set(run) == {"seed", "curve", "probe", "schedule", "seconds"}
    assert run["schedule"] == {"0": 2, "5": 4}
    assert run["curve"][-1]["samples"] >= 160 and run["curve"][-1]["effective_batch"] == 16   # the budget, at a window end
    offsets = run["probe"]["offset"]
    assert offsets[0] == -4 and 0 in offsets                    # every update from the first, the growth among them
    fixed = am.train_variant(tiny, 0, "fixed_a", growth=5)
    assert fixed["schedule"] == {"0": 2} and fixed["curve"][-1]["effective_batch"] == 8
