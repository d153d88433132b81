"""`benchmarks/effective_batch.py` (a part of `make bench`): `micro_batch_size=b` against its peers.

Its smoke run (`--quick`, real training of a tiny model in three processes) writes the JSON
and the page; the figures mean nothing there, so nothing here is timed: the structure, ratios
that are finite and positive, the goals' verdicts as `stats.verdict` gives them, and the
goals in the `make bench` report."""

import json
import math
import os
import subprocess
import sys

from benchmarks import effective_batch, parts, report, stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _quick_run(folder):
    out = subprocess.run([sys.executable, "-m", "benchmarks.effective_batch", "--quick", f"--out={folder}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600,
                         env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", KERAS_BACKEND="tensorflow"))
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads((folder / "effective_batch.json").read_text()), (folder / "effective_batch.md").read_text()


def _finite_positive(value):
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_the_smoke_run_measures_every_contender_and_judges_every_goal(tmp_path):
    results, page = _quick_run(tmp_path)
    measured = results["measured"]
    assert results["quick"] is True and (results["micro"], results["accum"], results["effective"]) == (32, 4, 128)
    # Steady: every contender timed in every round, over the same samples.
    steady = measured["steady"]
    assert sorted(steady["seconds"]) == sorted(effective_batch.STEADY)
    assert {len(s) for s in steady["seconds"].values()} == {2}
    assert steady["segment_samples"] == steady["segment_updates"] * results["effective"]
    # First epoch under XLA: ours trains an update per step of E, the others a step of b.
    epochs = measured["first_epoch"]
    assert sorted(epochs) == sorted(effective_batch.FIRST_EPOCH)
    updates = 2 * results["epoch_updates"]
    assert epochs["effective"][0]["updates"] == epochs["keras_builtin"][0]["updates"] == updates
    assert epochs["plain_b"][0]["updates"] == results["accum"] * updates
    assert all(_finite_positive(r["first_epoch_seconds"]) for runs in epochs.values() for r in runs)
    # Memory: the allocator's figures (oneDNN on in that process), the input of E in bytes.
    memory = measured["memory"]
    assert sorted(memory) == sorted(effective_batch.MEMORY)
    assert all(_finite_positive(r["growth_mb"]) and r["onednn"] == "1" for runs in memory.values() for r in runs)
    assert memory["effective"][0]["input_e_mb"] == results["effective"] * (16 * 16 * 3 * 4 + 4) / 2**20
    # Every goal: a ratio per round, finite and positive, judged as stats.verdict judges it.
    assert [g["key"] for g in results["goals"]] == list(effective_batch.GOALS)
    for goal in results["goals"]:
        ratio = goal["ratio"]
        assert ratio["n"] >= 1 and all(_finite_positive(ratio[k]) for k in ("median", "min", "max")), goal
        assert goal["verdict"] == stats.verdict(ratio, goal["target"], goal["higher_is_better"])
        assert goal["label"] in page
    # Auto, with the allocator's retry and without: below the cliff, after at least one error.
    assert sorted(results["auto"]) == ["off", "on"]
    for setting, auto in results["auto"].items():
        runs = measured["auto"][setting]
        assert runs["auto"][0]["onednn"] == ("1" if setting == "on" else "0")
        if not auto["available"]:
            assert "micro_batch_size" in auto["why"] and "not measured" in page
            continue
        assert all(b < results["cliff"] for b in auto["micro_batches"]), auto
        assert auto["out_of_memory_errors"]["min"] >= 1 and auto["seconds_lost"]["min"] >= 0.0
        assert runs["fixed"][0]["micro_batch"] == runs["auto"][0]["micro_batch"]
        assert _finite_positive(auto["epoch_ratio"]["median"])
    assert "smoke run" in page and "## Goals" in page

    # `make bench`'s report: the part is one of its parts, and its goals join the targets.
    assert "effective_batch" in parts.PARTS
    summary = {k: results[k] for k in ("goals", "auto", "quick", "micro", "accum", "effective")}
    report.write({"date": results["date"], "device": "CPU", "versions": results["versions"], "cpus": 2,
                  "parts_run": ["effective_batch"], "part_seconds": {"effective_batch": 50.0},
                  "effective_batch": summary}, str(tmp_path))
    written = (tmp_path / "results.md").read_text()
    assert "[effective_batch.md](effective_batch.md)" in written
    assert sum(line.startswith("| effective batch: ") for line in written.splitlines()) == len(results["goals"])
