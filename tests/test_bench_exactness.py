"""`python -m benchmarks.exactness_vs_builtin` (README's reproduction command) measures
what the exactness tests check, and runs with the library alone (no pytest)."""

import os
import subprocess
import sys
from pathlib import Path

import keras

from benchmarks import exactness_vs_builtin as bench
from tests.accumulator import test_exactness

ROOT = Path(__file__).resolve().parent.parent


def test_the_benchmark_uses_the_tests_optimizers_and_sizes():
    assert (bench.MICRO_BATCH, bench.ACCUM, bench.UPDATES) == (
        test_exactness.MICRO_BATCH, test_exactness.ACCUM, test_exactness.UPDATES)
    assert sorted(bench.OPTIMIZERS) == sorted(test_exactness.OPTIMIZERS)
    for name, make in bench.OPTIMIZERS.items():
        ours, tests = make().get_config(), test_exactness.OPTIMIZERS[name]().get_config()
        ours.pop("name"), tests.pop("name")
        assert keras.saving.serialize_keras_object(ours) == keras.saving.serialize_keras_object(tests), name


def test_the_benchmark_imports_no_test_tools(tmp_path):
    # pytest made unimportable: the command must still get as far as its first line.
    (tmp_path / "pytest.py").write_text("raise ImportError('no pytest here')\n")
    code = ("import sys; import benchmarks.exactness_vs_builtin as b; "
            "assert 'pytest' not in sys.modules or sys.modules['pytest'] is None; print(b.UPDATES)")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}", KERAS_BACKEND="tensorflow")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "32"
