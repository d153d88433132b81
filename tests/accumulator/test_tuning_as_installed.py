"""Tuning as installed: `pip install '.[tuning]'` brings what KerasTuner needs, and the
docs' first tuning example runs here (in every Keras 3 environment that has KerasTuner:
the TFX stack and the newest TensorFlow/Keras, whose constraints install the extra).
"""

import ast
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _extras():
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(node for node in ast.walk(tree) if isinstance(node, ast.Call)
                and getattr(node.func, "id", "") == "setup")
    extras = next(k.value for k in call.keywords if k.arg == "extras_require")
    return {ast.literal_eval(key): ast.literal_eval(value) for key, value in zip(extras.keys, extras.values)}


def _name(requirement):
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_the_tuning_extra_installs_tensorboard_and_the_newest_stack_pins_it():
    # KerasTuner imports tensorboard; TensorFlow >= 2.21 no longer depends on it.
    tuning = {_name(r) for r in _extras()["tuning"]}
    assert {"keras-tuner", "tensorboard"} <= tuning
    pinned = {_name(line): line.split("==")[1] for line in
              (ROOT / "constraints" / "tf-latest.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")}
    assert tuning <= set(pinned), "constraints/tf-latest.txt must install the tuning extra"


def _first_tuning_example():
    text = (ROOT / "docs" / "tfx.md").read_text()
    section = text[text.index("## Tuning accumulation"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.timeout(600)
def test_the_docs_tuning_example_runs(tmp_path):
    if importlib.util.find_spec("keras_tuner") is None:
        pytest.skip("KerasTuner is not installed here (the tuning extra)")
    code = _first_tuning_example()
    assert "tuner.search(" in code and "get_best_models()" in code
    env = dict(os.environ, PYTHONPATH=str(ROOT), KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_USE_LEGACY_KERAS", None)
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    # Every trial ran (a trial whose import of tensorboard failed leaves no checkpoint).
    trials = sorted(p.name for p in (tmp_path / "tuning" / "untitled_project").glob("trial_*"))
    assert len(trials) == 2, trials
    for trial in trials:
        assert '"status": "COMPLETED"' in (tmp_path / "tuning" / "untitled_project" / trial
                                           / "trial.json").read_text().replace("'", '"')
