"""`benchmarks/kernel_count.py` (a part of `make bench`): kernels counted from real profiler traces of a tiny model."""

import json
import os
import platform
import subprocess
import sys

import pytest

from benchmarks import kernel_count, parts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COUNT = ("import json, sys; from benchmarks import kernel_count; "
          "json.dump(kernel_count.run(['dense'], [2], ['off'], ['keras_builtin', 'accumulator']), sys.stdout)")


# Both kinds of CPU on any x86 machine: oneDNN (on by default where the CPU has AVX-512)
# renames and fuses the kernels; TF_ENABLE_ONEDNN_OPTS, read when TensorFlow loads, sets it,
# so each count runs in a process of its own.
@pytest.fixture(scope="module", params=["0", "1"], ids=["onednn-off", "onednn-on"])
def results(request):
    env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS=request.param, KERAS_BACKEND="tensorflow")
    out = subprocess.run([sys.executable, "-c", _COUNT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    if platform.machine() in ("x86_64", "AMD64"):
        assert found["cpu"]["onednn"] == (request.param == "1")
    return found


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
        # Four Dense layers' products, whatever the CPU names them (oneDNN: `_MklMatMul`, fused).
        assert non_closing["by_family"].get("MatMul", 0) >= 4
        assert non_closing["xla_runs"] == 0
        # The MLP has no sparse gradient: nothing is credited to a sparse update.
        assert closing["sparse"] == 0


def test_op_names_are_counted_as_the_op_they_compute():
    assert [kernel_count.op_family(op) for op in ("MatMul", "_MklMatMul", "_MklNativeFusedMatMul", "_FusedMatMul",
                                                   "_MklFusedBatchMatMulV2", "_Retval", "AddV2")] == [
        "MatMul", "MatMul", "MatMul", "MatMul", "BatchMatMulV2", "_Retval", "AddV2"]
    assert kernel_count.by_family({"MatMul": 2, "_MklMatMul": 3, "BiasAdd": 1}) == {"MatMul": 5, "BiasAdd": 1}


def test_the_report_names_the_kind_of_cpu_it_ran_on(results):
    machine = results["cpu"]
    ran = {op for c in results["cells"] for op in c["non_closing"]["by_op"]}
    # oneDNN is on exactly where its kernels ran, and the page says so.
    assert machine["onednn"] == any(op.startswith("_Mkl") for op in ran)
    assert ("oneDNN on" if machine["onednn"] else "oneDNN off") in kernel_count.markdown(results)
    assert "AVX-512 " + ("yes" if machine["avx512"] else "no") in kernel_count.markdown(results)


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
