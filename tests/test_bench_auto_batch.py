"""The AutoAccumulation benchmark's analysis on synthetic curves (pure Python, no training)."""

import math

import pytest

from benchmarks import auto_batch_analysis as aba

INF = aba.INF


def curve(points):
    """[(samples, updates, val_loss)] -> the recorded form."""
    return [{"samples": s, "updates": u, "val_loss": v} for s, u, v in points]


def decaying(batch, total=10_000, start=2.0, rate=1.0, floor=0.0, evals=20):
    """A curve whose loss falls with the samples (rate: its speed), evaluated every total/evals samples."""
    return curve([(s, s / batch, floor + (start - floor) * math.exp(-rate * s / total))
                  for s in range(0, total + 1, total // evals)])


def test_first_crossing_interpolates_samples_and_updates_alike():
    c = curve([(0, 0, 2.0), (100, 10, 1.0), (200, 20, 0.5)])
    assert aba.first_crossing(c, 1.5) == {"samples": 50.0, "updates": 5.0}
    assert aba.first_crossing(c, 1.0) == {"samples": 100.0, "updates": 10.0}     # reached at an evaluation
    assert aba.first_crossing(c, 0.75) == {"samples": 150.0, "updates": 15.0}
    assert aba.first_crossing(c, 0.4) is None                                    # never reached
    assert aba.first_crossing(c, 3.0) == {"samples": 0.0, "updates": 0.0}        # reached from the start


def test_first_crossing_is_the_first_not_a_later_one_and_skips_nan():
    c = curve([(0, 0, 2.0), (100, 10, float("nan")), (200, 20, 0.9), (300, 30, 1.4), (400, 40, 0.8)])
    crossing = aba.first_crossing(c, 1.0)
    # Between the last finite point before (0, 2.0) and (200, 0.9): 2.0 -> 0.9 crosses 1.0 at 10/11 of the way.
    assert crossing["samples"] == pytest.approx(200 * (1.0 / 1.1))
    assert crossing["samples"] < 300


def test_smooth_is_a_trailing_mean_that_keeps_samples_and_updates():
    c = curve([(0, 0, 3.0), (10, 1, 1.0), (20, 2, 2.0), (30, 3, float("nan")), (40, 4, 0.0)])
    smoothed = aba.smooth(c, k=3)
    assert [p["val_loss"] for p in smoothed] == pytest.approx([3.0, 2.0, 2.0, 1.5, 1.0])
    assert [(p["samples"], p["updates"]) for p in smoothed] == [(p["samples"], p["updates"]) for p in c]
    # A one-point dip below the target is not a crossing once smoothed.
    dip = curve([(0, 0, 2.0), (10, 1, 2.0), (20, 2, 0.5), (30, 3, 2.0), (40, 4, 2.0)])
    assert aba.first_crossing(dip, 1.0) is not None and aba.first_crossing(aba.smooth(dip), 1.0) is None
    with pytest.raises(ValueError):
        aba.smooth(c, k=0)


def test_target_is_the_lowest_final_loss_of_the_seed_mean_curves():
    fixed = {"fixed 32": [curve([(0, 0, 2.0), (10, 1, 0.5)]), curve([(0, 0, 2.0), (10, 1, 0.9)])],
             "fixed 256": [curve([(0, 0, 2.0), (10, 1, 0.6)]), curve([(0, 0, 2.0), (10, 1, 0.6)])],
             "diverged": [curve([(0, 0, 2.0), (10, 1, float("nan"))])] * 2}
    means = {label: aba.mean_curve(curves) for label, curves in fixed.items()}
    target, source = aba.target(means)
    assert (target, source) == (pytest.approx(0.6), "fixed 256")      # 0.7 mean for 32, despite its 0.5 seed
    with pytest.raises(ValueError):
        aba.target({})


def test_mean_curve_weights_seeds_and_ends_at_every_curve_end():
    a = curve([(0, 0, 2.0), (10, 1, 1.0), (20, 2, 0.0)])
    b = curve([(0, 0, 4.0), (12, 2, 2.0), (22, 4, 1.0), (30, 6, 0.5)])     # one evaluation more
    mean = aba.mean_curve([a, b])
    assert [p["val_loss"] for p in mean] == [3.0, 1.5, 0.25] and mean[-1]["samples"] == 25.0
    weighted = aba.mean_curve([a, b], [3, 1])
    assert weighted[0]["val_loss"] == 2.5 and aba.mean_curve([a, b], [0, 2]) == aba.mean_curve([b])


def test_needs_are_infinite_where_a_seed_does_not_reach():
    runs = [curve([(0, 0, 2.0), (100, 10, 1.0)]), curve([(0, 0, 2.0), (100, 10, 1.6)])]
    need = aba.needs(runs, 1.5)
    assert need["samples"] == [50.0, INF] and need["updates"] == [5.0, INF] and aba.reached(need) == 1


def test_median_counts_inf_as_larger_than_any_number():
    assert aba.median([3.0, 1.0, 2.0]) == 2.0
    assert aba.median([1.0, 2.0, 3.0, 4.0]) == 2.5
    assert aba.median([1.0, 2.0, 3.0, INF]) == 2.5           # one of four missing: still finite
    assert aba.median([1.0, 2.0, INF, INF]) == INF            # half missing: not finite
    assert aba.median([1.0, INF, INF]) == INF
    with pytest.raises(ValueError):
        aba.median([])


def test_ratio_leans_against_the_numerator_when_it_is_infinite():
    assert aba.ratio(2.0, 4.0) == 0.5
    assert aba.ratio(INF, 4.0) == INF and aba.ratio(INF, INF) == INF
    assert aba.ratio(2.0, INF) == 0.0
    assert aba.ratio(0.0, 0.0) == 1.0 and aba.ratio(1.0, 0.0) == INF


def test_quantile_is_linear_and_keeps_inf():
    assert aba.quantile([0.0, 1.0, 2.0, 3.0, 4.0], 0.5) == 2.0
    assert aba.quantile([0.0, 10.0], 0.25) == 2.5
    assert aba.quantile([1.0, 2.0, INF], 0.95) == INF
    assert aba.quantile([1.0, 2.0, INF], 0.25) == 1.5


def test_resampling_is_deterministic_and_draws_every_seed_count():
    a = aba.resample_counts(10, resamples=50, seed=3)
    assert a == aba.resample_counts(10, resamples=50, seed=3) and len(a) == 50
    assert all(len(counts) == 10 and sum(counts) == 10 for counts in a)
    assert a != aba.resample_counts(10, resamples=50, seed=4)


def _task(auto, fixed_by_label, seeds=10):
    """curves_by_label and kinds: every seed of a configuration the same curve."""
    curves = {"auto": [auto] * seeds} if auto is not None else {}
    curves.update({label: [c] * seeds for label, c in fixed_by_label.items()})
    kinds = {label: "auto" if label == "auto" else "fixed" for label in curves}
    return curves, kinds


def test_goals_met_when_auto_is_as_sample_efficient_with_fewer_updates():
    # The target: the small batch's final loss (the lowest); it reaches it at its end.
    small, large = decaying(32, rate=3.0), decaying(256, rate=1.2)
    auto = decaying(128, rate=3.0)        # as fast in samples as the small batch, the updates of 128
    curves, kinds = _task(auto, {"small": small, "large": large})
    a = aba.analyse(curves, kinds, resamples=200)
    assert a["target_from"] == "small" and a["peer"] == "small" and a["reached"]["large"] == 0
    goals = a["goals"]
    assert goals["reach"]["met"] and goals["reach"]["reached"] == 10
    assert goals["updates"]["met"] and goals["updates"]["high"] == pytest.approx(0.25)
    assert goals["samples"]["met"] and goals["samples"]["high"] == pytest.approx(1.0)
    assert goals["pareto"]["met"] and goals["pareto"]["not_excluded"] == []
    assert a["per_seed"] == {"reach": 10, "updates": 10, "samples": 10, "pareto": 10}


def test_goals_missed_on_the_bound_even_where_the_point_meets_them():
    small, large = decaying(32, rate=3.0), decaying(256, rate=1.2)
    # Seed to seed, auto at batch 128 is faster (5 seeds) or slower (5 seeds) than the small batch in samples:
    # the mean curve reaches the target just before its end, but in draws with more slow seeds it never does.
    fast, slow = decaying(128, rate=3.3), decaying(128, rate=2.8)
    curves = {"auto": [fast, slow] * 5, "small": [small] * 10, "large": [large] * 10}
    kinds = {"auto": "auto", "small": "fixed", "large": "fixed"}
    goals = aba.analyse(curves, kinds, resamples=500)["goals"]
    assert goals["updates"]["point"] < aba.FEWER_UPDATES and goals["samples"]["point"] < aba.MORE_SAMPLES
    assert not goals["samples"]["met"] and goals["samples"]["high"] == INF
    assert not goals["updates"]["met"] and goals["updates"]["high"] == INF
    assert not goals["reach"]["met"] and goals["reach"]["reached"] == 5


def test_reach_needs_nine_of_ten_seeds():
    small, large = decaying(32, rate=3.0), decaying(256, rate=1.2)
    good, short = decaying(128, rate=3.3), decaying(128, rate=2.9)      # short: ends just above the target
    for misses, met in ((1, True), (2, False)):
        curves = {"auto": [good] * (10 - misses) + [short] * misses, "small": [small] * 10, "large": [large] * 10}
        goals = aba.analyse(curves, {"auto": "auto", "small": "fixed", "large": "fixed"}, resamples=100)["goals"]
        assert goals["reach"]["met"] is met and goals["reach"]["reached"] == 10 - misses


def test_pareto_missed_when_a_fixed_configuration_needs_fewer_of_both():
    small = decaying(32, rate=3.0)
    auto = decaying(16, total=20_000, rate=4.0)        # reaches at 1.5x the samples, with more updates
    curves, kinds = _task(auto, {"small": small})
    goals = aba.analyse(curves, kinds, resamples=100)["goals"]
    assert not goals["pareto"]["met"] and goals["pareto"]["not_excluded"] == ["small"]
    assert goals["pareto"]["dominated_by"] == ["small"]
    assert not goals["samples"]["met"] and goals["samples"]["point"] == pytest.approx(1.5, rel=0.03)
    # A configuration that never reaches the target needs fewer of nothing, even against an auto that never does.
    curves, kinds = _task(decaying(16, rate=0.5), {"small": small, "never": decaying(256, rate=0.5)})
    pareto = aba.analyse(curves, kinds, resamples=100)["goals"]["pareto"]
    assert pareto["not_excluded"] == ["small"] and pareto["dominated_by"] == ["small"]


def test_updates_limit_is_a_quarter_and_samples_limit_ten_percent():
    small, large = decaying(32, rate=3.0), decaying(256, rate=1.2)
    cases = ((decaying(40, rate=3.0), "updates", False),           # 0.80x the updates
             (decaying(44, rate=3.0), "updates", True),            # 0.73x
             (decaying(128, total=12_000, evals=24, rate=3.0 / 1.06 * 1.2), "samples", True),
             (decaying(128, total=12_000, evals=24, rate=3.0 / 1.15 * 1.2), "samples", False))
    for auto, goal, met in cases:
        curves, kinds = _task(auto, {"small": small, "large": large})
        a = aba.analyse(curves, kinds, resamples=50)
        assert a["peer"] == "small"
        assert a["goals"][goal]["met"] is met, (goal, a["goals"][goal])


def test_hindsight_judges_every_other_schedule_and_names_the_best():
    small, large = decaying(32, rate=3.0), decaying(256, rate=1.2)
    curves = {"auto": [decaying(16, total=20_000, rate=4.0)] * 4, "small": [small] * 4, "large": [large] * 4,
              "ramp": [decaying(128, rate=3.0)] * 4}
    kinds = {"auto": "auto", "small": "fixed", "large": "fixed", "ramp": "ramp"}
    a = aba.analyse(curves, kinds, resamples=100)
    assert set(a["hindsight"]) == {"small", "large", "ramp"}
    assert a["best_in_hindsight"] == "ramp"
    assert all(a["hindsight"]["ramp"][g]["met"] for g in aba.GOALS)
    # A fixed configuration is not judged against itself, and is its own peer (ratio 1).
    assert "small" not in a["hindsight"]["small"]["pareto"]["against"]
    assert a["hindsight"]["small"]["updates"]["point"] == 1.0


def test_peer_is_the_most_sample_efficient_and_none_without_one():
    crossings = {"a": (100.0, 10.0), "b": (100.0, 5.0), "c": (50.0, 50.0), "d": (aba.INF, aba.INF)}
    assert aba.most_sample_efficient(crossings, ["a", "b", "d"]) == "b"
    assert aba.most_sample_efficient(crossings, ["a", "b", "c"]) == "c"
    assert aba.most_sample_efficient(crossings, ["d"]) is None


def test_a_target_half_the_seeds_miss_still_has_a_peer():
    # Seeds spread around the mean: the best fixed configuration's own runs reach its mean final loss on
    # about half the seeds, but its mean curve reaches it at its end.
    fixed = [decaying(32, rate=3.0 * (0.9 + 0.05 * s)) for s in range(5)]
    auto = [decaying(128, rate=3.0 * (0.9 + 0.05 * s)) for s in range(5)]
    a = aba.analyse({"fixed": fixed, "auto": auto}, {"fixed": "fixed", "auto": "auto"}, resamples=200)
    assert a["peer"] == "fixed" and a["crossings"]["fixed"][0] == pytest.approx(10_000)
    assert 0 < a["reached"]["fixed"] < 5
    assert a["goals"]["updates"]["point"] == pytest.approx(0.25) and a["goals"]["updates"]["met"]


def test_analyse_refuses_unpaired_seeds():
    with pytest.raises(ValueError, match="seeds"):
        aba.analyse({"auto": [decaying(32)] * 2, "small": [decaying(32)] * 3}, {"auto": "auto", "small": "fixed"})


def test_along_reads_the_last_trace_point_at_each_fraction():
    traces = [[{"samples": 0, "noise_scale": None}, {"samples": 50, "noise_scale": 10.0},
               {"samples": 100, "noise_scale": 30.0}],
              [{"samples": 40, "noise_scale": 20.0}, {"samples": 90, "noise_scale": 50.0}]]
    assert aba.along(traces, "noise_scale", [0.1, 0.5, 1.0], 100) == [None, 15.0, 40.0]
    assert aba.along(traces, "absent", [1.0], 100) == [None]


def test_goodput_model_recovers_t_micro_and_t_update():
    model = aba.goodput_model({1: 0.003 + 0.010, 2: 0.006 + 0.010, 4: 0.012 + 0.010, 8: 0.024 + 0.010})
    assert model["t_micro"] == pytest.approx(0.003) and model["t_update"] == pytest.approx(0.010)
    with pytest.raises(ValueError):
        aba.goodput_model({1: 0.01})
    per_round = aba.goodput_rounds({1: [0.013, 0.026], 2: [0.016, 0.032], 8: [0.034, 0.068]})
    assert per_round["t_micro"] == pytest.approx([0.003, 0.006]) and per_round["t_update"] == pytest.approx([0.01, 0.02])
    with pytest.raises(ValueError):
        aba.goodput_rounds({1: [0.01], 2: [0.01, 0.02]})


def _run(seed, batch, rate, total=10_000, schedule=None):
    c = decaying(batch, total=total, rate=rate * (1 + 0.02 * seed))
    for p in c:
        p["effective_batch"] = batch
    trace = [{"samples": p["samples"], "updates": p["updates"], "effective_batch": batch, "noise_scale": 50.0 + seed,
              "noise_scale_preconditioned": 40.0, "noise_scale_lower": None if p["samples"] < 3000 else 30.0,
              "target_effective_batch_size": 64} for p in c]
    return {"seed": seed, "curve": c, "trace": trace, "schedule": schedule or {"0": batch // 16}, "seconds": 1.0}


def _fixed(batch, rate, seeds, decay=False, lr=1e-2):
    """A fixed configuration's entry in auto_batch.json, its runs from `_run`."""
    return {"kind": "fixed", "effective_batch": batch, "lr_factor": 1.0, "decay": decay, "lr": lr,
            "runs": [_run(s, batch, rate) for s in seeds]}


def _results(tasks, held_out):
    """An auto_batch.json of `tasks` ({name: runs}), each task the same small one."""
    task = {"description": "a test task", "settings": {"micro": 16, "start": 32, "max": 256, "lr0": 1e-2},
            "budget": 10_000, "train_size": 1000, "held_out": held_out}
    return {"date": "2026-11-25", "versions": {"tensorflow": "x", "keras": "y", "python": "z"}, "cpus": 2,
            "load_at_start": [1.0], "load_at_end": [1.0], "wall_seconds": 60,
            "code": {"commit": "abc", "subject": "s", "dirty": False}, "rule_defaults": {"confidence": 0.95},
            "settings": {"seeds": 4, "quick": True, "lr_scaling": "sqrt"},
            "tasks": {name: {**task, "runs": runs} for name, runs in tasks.items()}}


def test_report_writes_the_verdicts_and_the_plots(tmp_path):
    from benchmarks import auto_batch_report
    pytest.importorskip("matplotlib")
    seeds = range(4)
    runs = {"fixed 32 ×1": _fixed(32, 3.0, seeds),
            "fixed 256 cosine": _fixed(256, 1.2, seeds, decay=True, lr=3e-2),
            "auto": {"kind": "auto", "lr": None, "runs": [_run(s, 128, 3.3, schedule={"0": 2, "30": 8})
                                                          for s in seeds]},
            "ramp": {"kind": "ramp", "lr": None, "runs": [_run(s, 64, 2.9) for s in seeds]}}
    runs["fixed 32 ×1"]["runs"].append(_run(9, 32, 3.0))        # a seed the others lack (a cut run): left out
    results = _results({"pydoc": runs}, held_out=True)
    summary = auto_batch_report.write(results, str(tmp_path))
    text = (tmp_path / "auto_batch.md").read_text()
    assert (tmp_path / "auto_batch.png").exists()
    assert summary["pydoc"]["seeds"] == 4 and summary["pydoc"]["held_out"]
    assert set(summary["pydoc"]["verdicts"]) == set(aba.GOALS)
    assert summary["pydoc"]["verdicts"]["updates"]["met"] and summary["pydoc"]["verdicts"]["reach"]["met"]
    assert "held out" in text and "best schedule in hindsight" in text and "fixed 32 ×1" in text
    assert "B_simple, preconditioned" in text and "the gate's lower bound" in text
    # results.json keeps the summary (strict JSON: no infinities) and report.py states its verdicts.
    import json

    from benchmarks import report
    json.dumps(summary, allow_nan=False)
    targets = []
    report._auto_batch(summary, targets)
    assert len(targets) == 4 and all(t[0].startswith("pydoc (held out): ") for t in targets)


def test_report_judges_a_revised_rule_as_auto_and_skips_tasks_not_started(tmp_path):
    """`--revised_auto` adds the rule at a later commit as "auto (revised)": judged on the same
    goals as auto, not offered as a schedule in hindsight; a cut run's tasks with no runs are left out."""
    from benchmarks import auto_batch_report
    pytest.importorskip("matplotlib")
    seeds = range(4)
    runs = {"fixed 32 ×1": _fixed(32, 3.0, seeds),
            "fixed 256 ×1": _fixed(256, 1.2, seeds, lr=3e-2),
            "auto": {"kind": "auto", "lr": None, "runs": [_run(s, 32, 3.0) for s in seeds]},
            "auto (revised)": {"kind": "auto", "lr": None, "code": {"commit": "def4567890", "subject": "n_eff"},
                               "runs": [_run(s, 128, 3.3, schedule={"0": 2, "30": 8}) for s in seeds]}}
    waiting = {"auto": {"kind": "auto", "lr": None, "runs": []}}
    results = _results({"text": runs, "digits": waiting}, held_out=False)
    summary = auto_batch_report.write(results, str(tmp_path))
    text = (tmp_path / "auto_batch.md").read_text()
    assert "digits" not in summary and set(summary["text"]["revised"]) == {"auto (revised)"}
    assert summary["text"]["revised"]["auto (revised)"]["updates"] and not summary["text"]["verdicts"]["updates"]["met"]
    assert summary["text"]["best_in_hindsight"] != "auto (revised)"
    assert "**auto (revised): " in text
    assert "def4567890" in text
    # Each run of the rule against where it starts (fixed 32 ×1, the same seeds): auto is that run
    # (difference 0, the same updates); the revised one ends higher with fewer updates.
    assert "**auto against fixed 32 ×1**" in text and "final loss +0.0000 [+0.0000 to +0.0000]" in text
    assert "**auto (revised) against fixed 32 ×1**" in text


def test_paired_difference_interval_holds_the_mean():
    d = aba.paired_difference([1.0, 2.0, 3.0, 4.0], [0.5, 1.0, 2.5, 3.0], resamples=500)
    assert d["mean"] == pytest.approx(0.75) and d["low"] <= 0.75 <= d["high"] and d["low"] >= 0.5
