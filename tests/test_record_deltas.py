"""`pytest --record-deltas=PATH` writes each test's outcome and its max |Δw| figures.

The GPU run (issue 13) reports these figures per case; this checks, on a real
exactness test run in its own pytest process, that they are the ones compared.
"""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_record_deltas_writes_outcome_and_each_comparison(tmp_path):
    path = tmp_path / "deltas.json"
    chosen = "tests/accumulator/test_exactness.py::test_custom_loop_matches_tape_loop"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--record-deltas={path}",
         "tests/accumulator/test_exactness.py", "-k", "custom_loop and tf_function and adam and not adamw"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    record = json.loads(path.read_text())
    assert record["tensorflow"] and record["python"]
    tests = {entry["test"]: entry for entry in record["tests"]}
    assert tests, record
    for test, entry in tests.items():
        assert test.startswith(chosen + "["), test
        assert entry["outcome"] == "passed"
        # test_custom_loop_matches_tape_loop compares once, within its 1e-6.
        assert len(entry["max_abs_dw"]) == 1 and 0.0 <= entry["max_abs_dw"][0] <= 1e-6, entry
    assert not os.path.exists(str(path) + ".partial")
