"""The wheel, as a user installs it into an environment that already has TFX.

Built from this checkout (`pip wheel --no-deps`), installed `--no-deps` into a folder of
its own, and used from a project folder outside the repository that has its own
`components/` and `pipelines/` packages and its own `accumulator.py`: the project's
names and ours both import, the module files the demos' Trainers load lie in the
installed package, and (in `make test-apart`) the retrieval demo pipeline runs from the
wheel alone (its TFX components, our Trainer, the module file it ships) on the Beam
DirectRunner.

The sources hold no symbolic link (setup.py's `package_dir` maps the top-level folders
into the package): the wheel's files are this checkout's files, byte for byte; the sdist
holds no link and no tests (on purpose, setup.py says why), and builds the same wheel.
"""

import os
import pathlib
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
INSTALLED = ("accumulator", "components", "pipelines")
PACKAGE_INIT = ROOT / "src" / "tfx_gradient_accumulator" / "__init__.py"


def _wheel_of(source, folder):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(folder), str(source)],
                   check=True, capture_output=True, timeout=300)
    [built] = folder.glob("tfx_gradient_accumulator-*.whl")
    return built


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    return _wheel_of(ROOT, tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """The sdist, by setuptools' PEP 517 hook (what `python -m build --sdist` calls)."""
    folder = tmp_path_factory.mktemp("sdist")
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, str(folder)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return folder / out.stdout.strip().splitlines()[-1]


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
    # One version: the distribution's is the library's `__version__` (setup.py reads it).
    from tfx_gradient_accumulator.accumulator import __version__
    assert wheel.name.startswith(f"tfx_gradient_accumulator-{__version__}-")


def test_the_wheels_files_are_the_checkouts_files(wheel):
    """setup.py's package_dir, not links: each file of the package is one file here."""
    archive = zipfile.ZipFile(wheel)
    files = [n for n in archive.namelist() if n.startswith("tfx_gradient_accumulator/")]
    for name in files:
        inside = pathlib.PurePosixPath(name).relative_to("tfx_gradient_accumulator")
        source = PACKAGE_INIT if str(inside) == "__init__.py" else ROOT / inside
        assert not any(p.is_symlink() for p in [source, *source.parents]), source
        assert archive.read(name) == source.read_bytes(), name


def test_the_staged_copy_for_the_gpu_machine_is_the_wheels_package(wheel, tmp_path):
    """`tools/stage_package.py` (a Python that cannot install the checkout) copies what the wheel holds."""
    from tools import stage_package
    staged = stage_package.stage(tmp_path)
    archive = zipfile.ZipFile(wheel)
    assert staged == sorted(n for n in archive.namelist() if n.startswith("tfx_gradient_accumulator/"))
    assert all((tmp_path / name).read_bytes() == archive.read(name) for name in staged)


def test_the_sdist_has_no_link_no_tests_and_builds_the_same_wheel(sdist, wheel, tmp_path):
    with tarfile.open(sdist) as archive:
        members = archive.getmembers()
        assert not [m.name for m in members if m.issym() or m.islnk()]
        top = members[0].name.split("/")[0]
        names = {m.name[len(top) + 1:] for m in members if m.isfile()}
        archive.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    assert not [n for n in names if n.startswith("tests/")]          # MANIFEST.in: prune tests
    assert {"setup.py", "pyproject.toml", "README.md", "MANIFEST.in",
            "src/tfx_gradient_accumulator/__init__.py"} <= names
    again = _wheel_of(tmp_path / top, tmp_path / "wheel")
    ours, theirs = zipfile.ZipFile(wheel), zipfile.ZipFile(again)
    assert sorted(ours.namelist()) == sorted(theirs.namelist())
    assert all(ours.read(n) == theirs.read(n) for n in ours.namelist() if not n.endswith("RECORD"))


def test_a_project_with_its_own_components_and_pipelines_imports_ours_and_its_own(site, tmp_path):
    code = ("import components, pipelines, accumulator\n"
            "import tfx_gradient_accumulator as ours\n"
            "from tfx_gradient_accumulator import GradientAccumulator, GradientCache\n"
            "from tfx_gradient_accumulator.components import AccumulatingTrainer\n"
            "import tfx_gradient_accumulator.pipelines.digits.pipeline\n"
            "print(components.MINE, pipelines.MINE, accumulator.MINE)\n"
            "print(ours.__file__)\n"
            "print(GradientAccumulator.__module__, AccumulatingTrainer.__module__)\n"
            # One module object per file of the package, all under its name.
            "import collections, os, sys\n"
            "files = collections.defaultdict(list)\n"
            "for name, module in list(sys.modules.items()):\n"
            "    where = getattr(module, '__file__', None) or ''\n"
            "    if where.startswith(os.path.dirname(ours.__file__)):\n"
            "        files[os.path.realpath(where)].append(name)\n"
            "print(all(len(n) == 1 and n[0].startswith('tfx_gradient_accumulator') for n in files.values()),"
            " len(files))\n"
            # The demos' module files, which TFX's Trainer loads by path: inside the installed package.
            "from tfx_gradient_accumulator.pipelines.retrieval import pipeline as retrieval\n"
            "from tfx_gradient_accumulator.pipelines.digits import pipeline as digits\n"
            "paths = list(retrieval.MODULE_FILES.values()) + [digits.MODULE_FILE]\n"
            "print(all(os.path.isfile(p) and p.startswith(os.path.dirname(ours.__file__)) for p in paths), len(paths))\n")
    out = _python(site, _project(tmp_path), "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    mine, where, modules, one_each, module_files = out.stdout.strip().splitlines()[-5:]
    assert mine == "components pipelines accumulator"
    assert where.startswith(str(site))
    assert modules == ("tfx_gradient_accumulator.accumulator.optimizer "
                       "tfx_gradient_accumulator.components.component")
    single, count = one_each.split()
    assert single == "True" and int(count) > 20, one_each
    assert module_files == "True 3", module_files


@pytest.mark.apart      # 70-100 s; the wheel's package and module files are checked above, the demo in tests/pipelines
@pytest.mark.timeout(900)
def test_the_retrieval_demo_runs_from_the_wheel_outside_the_repository(site, tmp_path):
    project = _project(tmp_path)
    out = _python(site, project, "-m", "tfx_gradient_accumulator.pipelines.run_local", "--pipeline=retrieval",
                  f"--output_dir={tmp_path / 'work'}", "--train_updates=4", "--max_trials=0", timeout=840)
    assert out.returncode == 0, out.stderr[-5000:]
    assert '"optimizer_updates": 4' in out.stdout and "held-out recall@10" in out.stdout, out.stdout[-3000:]
