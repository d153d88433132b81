"""The wheel, as a user installs it into an environment that already has TFX.

Built from this checkout (`pip wheel --no-deps`), installed `--no-deps` into a folder of
its own, and used from a project folder outside the repository that has its own
`components/` and `pipelines/` packages and its own `accumulator.py`: the project's
names and ours both import, and the retrieval demo pipeline runs from the wheel alone
(its TFX components, our Trainer, the module file it ships) on the Beam DirectRunner.
"""

import os
import pathlib
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTALLED = ("accumulator", "components", "pipelines")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), str(ROOT)],
                   check=True, capture_output=True, timeout=300)
    [built] = folder.glob("tfx_gradient_accumulator-*.whl")
    return built


@pytest.fixture(scope="module")
def site(wheel, tmp_path_factory):
    """The wheel installed --no-deps into a folder of its own (the TFX stack is this environment's)."""
    folder = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    return folder


def _project(tmp_path):
    """A user's project with packages named as our repository's folders."""
    project = tmp_path / "project"
    for package in ("components", "pipelines"):
        (project / package).mkdir(parents=True)
        (project / package / "__init__.py").write_text(f"MINE = {package!r}\n")
    (project / "accumulator.py").write_text("MINE = 'accumulator'\n")
    return project


def _python(site, cwd, *arguments, timeout=600):
    """This environment's Python with the wheel's folder first and not the repository."""
    env = dict(os.environ, PYTHONPATH=str(site), KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run([sys.executable, *arguments], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_wheel_holds_one_package_with_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"tfx_gradient_accumulator",
                                                     wheel.name.split("-py")[0] + ".dist-info"}
    expected = {f"tfx_gradient_accumulator/{path.relative_to(ROOT).as_posix()}"
                for package in INSTALLED for path in (ROOT / package).rglob("*.py")}
    assert expected - set(names) == set()
    assert "tfx_gradient_accumulator/__init__.py" in names


def test_a_project_with_its_own_components_and_pipelines_imports_ours_and_its_own(site, tmp_path):
    code = ("import components, pipelines, accumulator\n"
            "import tfx_gradient_accumulator as ours\n"
            "from tfx_gradient_accumulator import GradientAccumulator, GradientCache\n"
            "from tfx_gradient_accumulator.components import AccumulatingTrainer\n"
            "import tfx_gradient_accumulator.pipelines.digits.pipeline\n"
            "print(components.MINE, pipelines.MINE, accumulator.MINE)\n"
            "print(ours.__file__)\n"
            "print(GradientAccumulator.__module__, AccumulatingTrainer.__module__)\n")
    out = _python(site, _project(tmp_path), "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    mine, where, modules = out.stdout.strip().splitlines()[-3:]
    assert mine == "components pipelines accumulator"
    assert where.startswith(str(site))
    assert modules == ("tfx_gradient_accumulator.accumulator.optimizer "
                       "tfx_gradient_accumulator.components.component")


@pytest.mark.timeout(900)
def test_the_retrieval_demo_runs_from_the_wheel_outside_the_repository(site, tmp_path):
    project = _project(tmp_path)
    out = _python(site, project, "-m", "tfx_gradient_accumulator.pipelines.run_local", "--pipeline=retrieval",
                  f"--output_dir={tmp_path / 'work'}", "--train_updates=4", "--max_trials=0", timeout=840)
    assert out.returncode == 0, out.stderr[-5000:]
    assert '"optimizer_updates": 4' in out.stdout and "held-out recall@10" in out.stdout, out.stdout[-3000:]
