"""`benchmarks/probe_cost.py` (a part of `make bench`): what the micro-batch probe costs the run it precedes."""

import json

from benchmarks import parts, probe_cost


def test_one_real_measurement_on_a_small_model_and_the_report_of_its_repeats(tmp_path):
    measured = probe_cost.measure_once("tiny_cnn", effective=16, updates=2)
    # 16 fits here: the doubling runs 1, 2, 4, 8, 16 and on to 18 = smallest_taken_whole(16), the
    # end of the search; 18 fits, so with 10% headroom E is taken whole: 16 x 1.
    assert (measured["probe_steps"], measured["micro_batch"], measured["accum_steps"]) == (6, 16, 1)
    assert measured["probe_seconds"] > 0 and measured["update_seconds"] > 0
    slower = dict(measured, probe_seconds=2 * measured["probe_seconds"])
    summary = probe_cost.summarize([measured, slower, measured])
    assert summary["probe_seconds"]["median"] == measured["probe_seconds"]
    assert summary["probe_seconds"]["max"] == slower["probe_seconds"]
    share = summary["share_of_1000"]["median"]
    assert share == measured["probe_seconds"] / (
        measured["probe_seconds"] + measured["start_seconds"] + 1000 * measured["update_seconds"])
    assert summary["share_of_10000"]["median"] < share
    results = {"date": "2026-11-27", "workload": "w", "effective": 16, "repeats_count": 3, "load_1min": [1.0],
               "repeats": [measured, slower, measured], "summary": summary,
               "versions": {"tensorflow": "t", "keras": "k", "python": "p"}}
    probe_cost.write(results, str(tmp_path))
    assert json.loads((tmp_path / "probe_cost.json").read_text())["summary"] == summary
    page = (tmp_path / "probe_cost.md").read_text()
    assert "probe's share of a run of 1,000 updates" in page and f"{share * 100:.1f}%" in page
    assert "probe_cost" in parts.PARTS
