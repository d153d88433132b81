"""The GradientCache benchmark's report judges its targets both ways (made-up results, no training).

`benchmarks.gradient_cache.report` turns measured peaks, step times and recalls into
verdicts; these tests feed it results built to meet every target, then to miss
each one, so that a report saying "met" is known to be able to say "missed".
"""

import json

from benchmarks import gradient_cache as gc

REPEATS = 3


def _memory(cached_over_micro):
    """Peaks (MiB) per contender and repeat; the cached peaks are `cached_over_micro` × their
    micro-batch's peak plus the representations."""
    micro = {"plain_b128": 40.0, "plain_b64": 24.0, "plain_b128_eager": 90.0}
    peaks = {"large_batch": 200.0, **micro}
    for cached, peer in gc.MICRO_PEER.items():
        peaks[cached] = cached_over_micro * (micro[peer] + gc.representation_mb())
    return {"param_mb": 0.9, "runs": {name: [{"peaks_mb": [peak, peak + 0.01 * r]} for r in range(REPEATS)]
                                      for name, peak in peaks.items()}}


def _time(cached_over_large):
    return {"runs": {name: [{"step_seconds": [seconds * (1 + 0.01 * r)] * 4} for r in range(REPEATS)]
                     for name, seconds in (("large_batch", 0.5), ("cached_N4", 0.5 * cached_over_large),
                                           ("cached_N8", 0.5 * cached_over_large), ("plain_b128", 0.12))}}


def _quality(cached_minus_large):
    seeds = []
    for seed in (0, 1):
        recall = {"plain_accumulation": {str(b): 0.40 for b in gc.QUALITY_BATCHES},
                  "large_batch": {str(b): 0.40 + 0.01 * k + 0.001 * seed for k, b in enumerate(gc.QUALITY_BATCHES)}}
        recall["cached"] = {b: v + cached_minus_large for b, v in recall["large_batch"].items()}
        seconds = {name: {b: 2.0 for b in recall["large_batch"]} for name in recall}
        seeds.append({"seed": seed, "recall": recall, "oracle": 0.9, "seconds": seconds})
    return {"seeds": seeds}


def _results(cached_over_micro, cached_over_large, cached_minus_large):
    return {"machine": {"date": "2026-11-23", "device_name": "CPU (2 cores, x86_64)", "python": "/venv/bin/python",
                        "versions": {"tensorflow": "2.16.2", "keras": "3.15.1", "python": "3.11.7"}},
            "memory": _memory(cached_over_micro), "time": _time(cached_over_large),
            "quality": _quality(cached_minus_large)}


def _line(text, start):
    return next(line for line in text.splitlines() if line.startswith(start))


def test_the_report_says_met_when_every_target_is_met(tmp_path):
    text = gc.report(_results(1.05, 1.2, 0.0), str(tmp_path))
    assert "cached_N4: **met** (1.05" in text and "cached_N8: **met**" in text
    assert "**met** (1.20" in _line(text, "Target: ≤ 1.35")
    assert "| cached_N4 | 0.606 [0.600–0.612] | 1.20" in text
    assert "Plain `fit` at the micro-batch takes 0.96 [0.96–0.96]× the large batch's time at b = 128" in text  # 4 × 0.12 s
    assert "the cached step costs 1.25 [1.25–1.25]× (cached_N4)" in text
    assert "Exactness: cached and the large batch coincide" in text and "**met** (largest difference 0.0000)" in text
    assert "at 512, cached is higher than plain accumulation (0.040 [0.040–0.041])" in text
    assert "Run eagerly (`run_eagerly=True`, both sides)" in text and "recall@10 = 0.900: the ceiling." in text
    assert "the ceiling. Training seconds at 512 (5 epochs): plain accumulation 2.0" in text
    assert "\n\n![recall@10 against the effective batch](gradient_cache_recall.png)\n" in text
    for name in ("gradient_cache.md", "gradient_cache.json", "gradient_cache.png", "gradient_cache_recall.png"):
        assert (tmp_path / name).exists(), name
    assert json.loads((tmp_path / "gradient_cache.json").read_text())["time"]["runs"]["large_batch"]


def test_the_report_says_missed_when_every_repeat_misses(tmp_path):
    text = gc.report(_results(2.0, 1.6, 0.05), str(tmp_path))
    assert "cached_N4: **missed** (2.00" in text and "cached_N8: **missed**" in text
    assert "**missed** (1.60" in _line(text, "Target: ≤ 1.35")
    assert "**missed** (largest difference 0.0500)" in text
    assert "over its own micro-batches run plainly, the cached step costs" in text


def test_a_target_missed_by_the_median_but_reached_by_one_repeat_is_within_noise():
    results = _results(1.0, 1.0, 0.0)
    large = results["time"]["runs"]["large_batch"]
    results["time"]["runs"]["cached_N4"] = [{"step_seconds": [r["step_seconds"][0] * ratio]}
                                            for r, ratio in zip(large, (1.3, 1.4, 1.5))]
    assert gc.time_figures(results["time"])["cached_N4"]["verdict"] == "within noise"


def test_a_part_run_alone_keeps_the_other_parts(tmp_path):
    gc.report(_results(1.05, 1.2, 0.0), str(tmp_path))
    again = {"machine": {"date": "2026-11-24"}, "part_seconds": {"quality": 1.0}, "quality": _quality(0.05)}
    merged = gc._merged(str(tmp_path), again)
    assert merged["memory"] == _memory(1.05) and merged["quality"] == _quality(0.05)
    assert merged["machine"]["date"] == "2026-11-24" and merged["machine"]["versions"]["keras"] == "3.15.1"
