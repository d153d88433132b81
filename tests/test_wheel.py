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
import re
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


# One TensorFlow: the wheel's metadata names none outside an extra, and each TensorFlow
# extra names exactly one distribution, on every platform TensorFlow ships wheels for.

TENSORFLOWS = {"tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel", "tensorflow-macos",
               "tensorflow-aarch64", "tensorflow-cpu-aws", "tf-nightly", "tf-nightly-cpu"}
CHOOSING = {"tensorflow": "tensorflow", "cpu": "tensorflow-cpu", "and-cuda": "tensorflow"}
PLATFORMS = {   # (sys_platform, platform_system, platform_machine): where each has wheels
    "linux-x86_64": ("linux", "Linux", "x86_64"), "windows": ("win32", "Windows", "AMD64"),
    "macos-arm64": ("darwin", "Darwin", "arm64"), "linux-aarch64": ("linux", "Linux", "aarch64"),
    "macos-x86_64": ("darwin", "Darwin", "x86_64")}


def _metadata(wheel):
    import email.parser

    archive = zipfile.ZipFile(wheel)
    [name] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
    return email.parser.Parser().parsestr(archive.read(name).decode())


def _requirements(wheel):
    from packaging.requirements import Requirement

    return [Requirement(line) for line in _metadata(wheel).get_all("Requires-Dist")]


def _chosen(requirements, extra, platform, python="3.11"):
    """The requirements an install with `extra` ("" for none) takes on `platform`."""
    from packaging.markers import default_environment

    sys_platform, system, machine = PLATFORMS[platform]
    environment = dict(default_environment(), sys_platform=sys_platform, platform_system=system,
                       platform_machine=machine, python_version=python, python_full_version=f"{python}.0",
                       extra=extra)
    return [r for r in requirements if r.marker is None or r.marker.evaluate(environment)]


def _name(requirement):
    from packaging.utils import canonicalize_name

    return canonicalize_name(requirement.name)


def test_no_tensorflow_outside_an_extra(wheel):
    """`pip install tfx-gradient-accumulator tensorflow-cpu` must not bring `tensorflow` too."""
    requirements = _requirements(wheel)
    assert {_name(r) for r in requirements} & TENSORFLOWS, "no extra names TensorFlow"
    for platform in PLATFORMS:
        bare = {_name(r) for r in _chosen(requirements, "", platform)}
        assert not bare & TENSORFLOWS, (platform, bare)
        assert "keras" in bare, (platform, bare)


def test_each_tensorflow_extra_names_exactly_one_tensorflow_on_every_platform(wheel):
    from packaging.specifiers import SpecifierSet

    requirements = _requirements(wheel)
    assert set(CHOOSING) <= set(_metadata(wheel).get_all("Provides-Extra"))
    ranges = set()
    for extra, expected in CHOOSING.items():
        for platform in PLATFORMS:
            for python in ("3.9", "3.13"):
                tensorflows = [r for r in _chosen(requirements, extra, platform, python) if _name(r) in TENSORFLOWS]
                assert len(tensorflows) == 1, (extra, platform, python, [str(r) for r in tensorflows])
                [tensorflow] = tensorflows
                ranges.add(str(tensorflow.specifier))
                # tensorflow-cpu has x86-64 wheels only: elsewhere `[cpu]` takes the one build there.
                x86 = PLATFORMS[platform][2] in ("x86_64", "AMD64")
                assert _name(tensorflow) == (expected if x86 or extra != "cpu" else "tensorflow"), (extra, platform)
                assert tensorflow.extras == ({"and-cuda"} if extra == "and-cuda" else set()), (extra, tensorflow)
    # One range for all three, the range make test runs (test_seam.py checks the pins against it).
    [specifier] = ranges
    assert {"2.15.0", "2.21.0"} <= set(SpecifierSet(specifier).filter(["2.14.1", "2.15.0", "2.21.0", "2.22.0"]))
    assert not {"2.14.1", "2.22.0"} & set(SpecifierSet(specifier).filter(["2.14.1", "2.22.0"]))


def test_the_other_extras_bring_no_tensorflow_of_their_own(wheel):
    """Only `tfx` does, through TFX (its own `tensorflow`), and no TensorFlow extra goes with it."""
    requirements = _requirements(wheel)
    bare = {str(r) for r in _chosen(requirements, "", "linux-x86_64")}
    for extra in set(_metadata(wheel).get_all("Provides-Extra")) - set(CHOOSING):
        added = [r for r in _chosen(requirements, extra, "linux-x86_64") if str(r) not in bare]
        assert added, extra
        assert not {_name(r) for r in added} & TENSORFLOWS, (extra, [str(r) for r in added])


def test_keras_asks_for_no_tensorflow_tf_keras_and_tfx_for_the_full_one():
    """What the install docs say of the other requirements, read from the installed distributions:
    Keras 3 (the one requirement) brings no TensorFlow; tf_keras (the `keras2` extra) and TFX
    (the `tfx` extra) ask for the full `tensorflow`, hence the docs' `--no-deps` beside tensorflow-cpu."""
    from importlib import metadata

    from packaging.requirements import Requirement

    def tensorflows(distribution):
        found = [Requirement(line) for line in metadata.requires(distribution) or []]
        return {_name(r) for r in found if r.marker is None} & TENSORFLOWS

    assert tensorflows("keras") == set()
    assert tensorflows("tf_keras") == {"tensorflow"}
    assert tensorflows("tfx") == {"tensorflow"}
    install = (ROOT / "docs" / "install.md").read_text()
    assert re.search(r"pip install --no-deps .tf_keras", install), "docs/install.md: tf_keras beside tensorflow-cpu"


def _stub_wheel(folder, name, version, requires=(), extras=()):
    """A wheel of metadata only, for pip's resolver (which reads nothing else with --dry-run)."""
    stem = f"{name.replace('-', '_')}-{version}"
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"]
    lines += [f"Provides-Extra: {extra}" for extra in extras] + [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(folder / f"{stem}-py3-none-any.whl", "w") as archive:
        archive.writestr(f"{stem}.dist-info/METADATA", "\n".join(lines) + "\n")
        archive.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\n"
                                                     "Tag: py3-none-any\n")
        archive.writestr(f"{stem}.dist-info/RECORD", "")


@pytest.fixture(scope="module")
def index(wheel, tmp_path_factory):
    """A folder of wheels pip resolves from offline: ours, and stand-ins for TensorFlow's
    distributions (tf_keras with its installed version's real TensorFlow requirement)."""
    from importlib import metadata

    folder = tmp_path_factory.mktemp("index")
    (folder / wheel.name).write_bytes(wheel.read_bytes())
    tensorflow = metadata.version("tensorflow")
    _stub_wheel(folder, "tensorflow", tensorflow, ['nvidia-cudnn-cu12; extra == "and-cuda"'], extras=["and-cuda"])
    _stub_wheel(folder, "tensorflow-cpu", tensorflow)
    _stub_wheel(folder, "nvidia-cudnn-cu12", "9.3.0.75")
    _stub_wheel(folder, "keras", metadata.version("keras"))
    _stub_wheel(folder, "tf-keras", metadata.version("tf_keras"), metadata.requires("tf_keras"))
    return folder


def _resolve(index, tmp_path, *requirements):
    """What `pip install` would install (pip's own resolver, --dry-run, this folder only)."""
    report = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "pip", "--isolated", "install", "--dry-run", "--ignore-installed",
                    "--no-index", "--find-links", str(index), "--report", str(report), "-q", *requirements],
                   check=True, capture_output=True, text=True, timeout=300)
    import json
    return {item["metadata"]["name"] for item in json.loads(report.read_text())["install"]}


@pytest.mark.parametrize("requirements, tensorflows", [
    (["tfx-gradient-accumulator", "tensorflow-cpu"], {"tensorflow-cpu"}),   # the user's own, beside the package
    (["tfx-gradient-accumulator[cpu]"], {"tensorflow-cpu"}),
    (["tfx-gradient-accumulator[and-cuda]"], {"tensorflow"}),
    (["tfx-gradient-accumulator[tensorflow]"], {"tensorflow"}),
    (["tfx-gradient-accumulator"], set()),
    (["tfx-gradient-accumulator[tensorflow,keras2]"], {"tensorflow"}),
    # tf_keras asks for the full `tensorflow`: why the docs install it --no-deps beside tensorflow-cpu.
    (["tfx-gradient-accumulator[cpu,keras2]"], {"tensorflow-cpu", "tensorflow"}),
])
def test_pip_installs_exactly_the_tensorflow_asked_for(index, tmp_path, requirements, tensorflows):
    installed = _resolve(index, tmp_path, *requirements)
    assert "tfx-gradient-accumulator" in installed and "keras" in installed, installed
    assert installed & TENSORFLOWS == tensorflows, installed
    assert ("nvidia-cudnn-cu12" in installed) == ("[and-cuda]" in requirements[0]), installed
    assert ("tf-keras" in installed) == ("keras2" in requirements[0]), installed


def test_importing_without_tensorflow_names_the_extras(site, tmp_path):
    """An environment with no TensorFlow at all (`-S`: no site-packages, only the wheel's folder):
    a clear ImportError naming the extras, raised before anything imports Keras."""
    code = ("import sys\n"
            "try:\n"
            "    import tfx_gradient_accumulator\n"
            "except ImportError as error:\n"
            "    print(type(error).__name__, error.name, 'keras' in sys.modules)\n"
            "    print(error)\n")
    out = _python(site, tmp_path, "-S", "-c", code)
    assert out.returncode == 0, out.stderr[-3000:]
    kind, message = out.stdout.strip().split("\n", 1)
    assert kind == "ImportError tensorflow False", out.stdout
    extras = set(re.findall(r'"tfx-gradient-accumulator\[([\w-]+)\]"', message))
    assert extras == set(CHOOSING), message
    assert "2.15 to 2.21" in message and "tensorflow-cpu" in message, message
