"""`benchmarks/kernel_count.py` (a part of `make bench`): kernels counted from real profiler traces of a tiny model."""

import json

import pytest

from benchmarks import kernel_count, parts


@pytest.fixture(scope="module")
def results():
    return kernel_count.run(["dense"], [2], ["off"], ["keras_builtin", "accumulator"])


def test_it_is_a_part_of_make_bench():
    assert "kernel_count" in parts.PARTS


def test_counts_are_positive_and_a_closing_step_runs_more_kernels(results):
    assert [(c["contender"], c["accum"], c["xla"]) for c in results["cells"]] == [
        ("keras_builtin", 2, "off"), ("accumulator", 2, "off")]
    for cell in results["cells"]:
        assert "error" not in cell, cell.get("error")
        non_closing, closing = cell["non_closing"], cell["closing"]
        assert non_closing["kernels"] > 0 and closing["kernels"] > non_closing["kernels"]
        # The count is the sum of the kernels by op type, and the step's backward pass is in it.
        assert closing["kernels"] == sum(closing["by_op"].values()) and 0 < closing["launching"] < closing["kernels"]
        assert non_closing["by_op"].get("MatMul", 0) >= 4
        assert non_closing["xla_runs"] == 0
        # The MLP has no sparse gradient: nothing is credited to a sparse update.
        assert closing["sparse"] == 0


def test_the_report_has_its_goals_and_tables(results, tmp_path):
    goals = results["goals"]
    assert [(g["step"], g["contender"]) for g in goals] == [("non_closing", "accumulator"), ("closing", "accumulator")]
    for goal in goals:
        assert goal["met"] == (goal["count"] <= goal["bound"]) and goal["count"] > 0
    kernel_count.write(results, str(tmp_path))
    stored = json.loads((tmp_path / "kernel_count.json").read_text())
    assert stored["goals"] == goals and stored["method"] == kernel_count.METHOD
    page = (tmp_path / "kernel_count.md").read_text()
    assert page.startswith("# Kernels per step") and "## Goals" in page and "## Kernels per step, XLA off" in page
    assert f"{len(goals) - sum(not g['met'] for g in goals)} of {len(goals)} goals met" in page
    assert page.count("| dense | 2 |") == len(goals) + 2       # a row per goal and per cell


def test_the_goals_compare_against_keras_and_the_noise_scale_bound():
    step = {"kernels": 10, "launching": 4, "sparse": 3, "xla_thunks": 5, "xla_runs": 1}
    cells = [{"model": "m", "accum": 2, "xla": "on", "contender": name,
              "non_closing": dict(step, kernels=k), "closing": dict(step, kernels=2 * k)}
             for name, k in (("keras_builtin", 10), ("accumulator", 11), ("accumulator_noise_scale", 14))]
    found = {(g["step"], g["contender"]): g for g in kernel_count.goals(cells)}
    # Under XLA the thunks count too: ours 11 + 5 against Keras' 10 + 5.
    assert (found["non_closing", "accumulator"]["count"], found["non_closing", "accumulator"]["bound"]) == (16, 15)
    assert not found["non_closing", "accumulator"]["met"]
    # Closing: Keras' plus the sparse update's own kernels (3): 27 <= 25 + 3.
    assert found["closing", "accumulator"]["met"] and found["closing", "accumulator"]["bound"] == 28
    assert found["non_closing", "accumulator_noise_scale"]["bound"] == 20.0
    assert found["non_closing", "accumulator_noise_scale"]["met"]       # 19 <= 1.25 x 16
    # Launching kernels alike: 4 + 5 for each, so ours meets Keras' there.
    assert found["non_closing", "accumulator"]["launching_count"] == 9 and found["non_closing", "accumulator"][
        "launching_met"]
