"""The house rules, checked on the source: imports run one way, functions stay short;
and the package's layout: no symbolic link, one module object per library file.

Imports inside functions count: a lazy import that closes a cycle is still a
cycle, only one that fails later. Parsed with `ast`, nothing is imported (but by the
layout's tests at the end).
"""

import ast
import json
import os
import re
import pathlib
import subprocess
import sys

import pytest

from tests import fork_server

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("accumulator", "components", "pipelines", "benchmarks")
INSTALLED = ("accumulator", "components", "pipelines")   # as tfx_gradient_accumulator.<name>
LONGEST_FUNCTION = 120


def _module_name(path):
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] in INSTALLED:
        parts = ("tfx_gradient_accumulator",) + parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _sources(packages=PACKAGES):
    return {_module_name(p): p for package in packages for p in sorted((ROOT / package).rglob("*.py"))}


def import_graph(packages=PACKAGES):
    """{module: {project modules it imports anywhere in its source}}."""
    modules = _sources(packages)
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                # `from package import module` imports the module; `from module import name` the module.
                targets = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules
                           else node.module for alias in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph):
    """One import cycle as a list of modules (first == last), or None."""
    state = {}

    def visit(node, path):
        state[node] = "open"
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        state[node] = "done"
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_the_library_imports_run_one_way():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle():
    # The check above can fail: a lazy import back into a module's importer is a cycle.
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


# The rooms of `accumulator/`, in the order imports may run (DEVELOPERS.md's map): a module
# imports only from its own room or an earlier one. A new module gets a room here.
ROOMS = {
    "foundations": ("flavours", "seam", "validation", "refusals", "options", "noise_scale", "batch_target",
                    "preconditioning",
                    "lr_scaling", "distribute", "contrastive", "micro_batch_changes"),
    "mechanics": ("_tf", "replicas", "lookups", "across_replicas", "cache_passes"),
    "window": ("loop_notes", "custom_loop", "window_rows", "window_saving", "window_noise", "window", "weighting", "forwarding"),
    "schedules": ("callbacks", "auto_batch"),
    "optimizers": ("loss_scaling", "optimizer", "keras2", "keras2.optimizer", "keras2.gradient_cache", "keras2.task_cache",
                   "gradient_cache", "batch_norm"),
    "training": ("backup", "fit_micro_batches", "keras2.fit_micro_batches", "fit_hook", "hooks", "row_room", "micro_batch_workers", "micro_batch", "out_of_memory",
                 "fit_auto_micro_batch"),
    "entry points": ("autowrap", "tuning", "check_report", "check_arguments", "check_runs", "check_compare",
                     "check_arbiter", "check", ""),
}
PACKAGE_ORDER = ("accumulator", "components", "pipelines")   # each imports only from itself and those before


def _room_of():
    prefix = "tfx_gradient_accumulator.accumulator"
    return {f"{prefix}.{m}" if m else prefix: (rank, room)
            for rank, (room, modules) in enumerate(ROOMS.items()) for m in modules}


def imports_against_the_rooms(graph, room_of):
    """Imports that run backwards: a module importing one of a later room, or of a later package."""
    wrong = []
    for module, imported in graph.items():
        if module.startswith("tfx_gradient_accumulator.accumulator") and module in room_of:
            wrong += [f"{module} ({room_of[module][1]}) imports {target} ({room_of[target][1]})"
                      for target in sorted(imported) if target in room_of and room_of[target][0] > room_of[module][0]]
        parts = module.split(".")
        if parts[0] == "tfx_gradient_accumulator" and len(parts) > 1 and parts[1] in PACKAGE_ORDER:
            rank = PACKAGE_ORDER.index(parts[1])
            wrong += [f"{module} imports {target}" for target in sorted(imported)
                      if target.split(".")[1:2] and target.split(".")[1] in PACKAGE_ORDER
                      and PACKAGE_ORDER.index(target.split(".")[1]) > rank]
    return wrong


def test_every_library_module_has_a_room():
    room_of = _room_of()
    modules = [m for m in import_graph(INSTALLED) if m.startswith("tfx_gradient_accumulator.accumulator")]
    assert sorted(m for m in modules if m not in room_of) == []
    assert sorted(m for m in room_of if m not in modules) == []


def test_imports_run_from_the_later_rooms_to_the_earlier():
    assert imports_against_the_rooms(import_graph(), _room_of()) == []


def test_the_rooms_check_can_fail():
    room_of = {"tfx_gradient_accumulator.accumulator.a": (0, "first"), "tfx_gradient_accumulator.accumulator.b": (1, "second")}
    graph = {"tfx_gradient_accumulator.accumulator.a": {"tfx_gradient_accumulator.accumulator.b"},
             "tfx_gradient_accumulator.accumulator.b": {"tfx_gradient_accumulator.accumulator.a"},
             "tfx_gradient_accumulator.accumulator.c": {"tfx_gradient_accumulator.components.x"}}
    assert imports_against_the_rooms(graph, room_of) == [
        "tfx_gradient_accumulator.accumulator.a (first) imports tfx_gradient_accumulator.accumulator.b (second)",
        "tfx_gradient_accumulator.accumulator.c imports tfx_gradient_accumulator.components.x"]


def test_the_private_names_module_imports_nothing_of_the_library():
    # but the public Keras-flavour detection, itself a leaf.
    graph = import_graph()
    assert graph["tfx_gradient_accumulator.accumulator.seam"] <= {"tfx_gradient_accumulator.accumulator.flavours"}
    assert graph["tfx_gradient_accumulator.accumulator.flavours"] == set()


def test_the_hooks_leave_the_private_names_module():
    # seam reaches past Keras' API; hooks changes Keras; the two jobs live apart.
    graph = import_graph()
    assert "tfx_gradient_accumulator.accumulator.hooks" in graph["tfx_gradient_accumulator.accumulator"]       # `import accumulator` installs them
    assert "tfx_gradient_accumulator.accumulator.fit_hook" not in graph["tfx_gradient_accumulator.accumulator.seam"] | graph["tfx_gradient_accumulator.accumulator.window"]


# What the library never imports: TFX and what comes with it, and the component and pipelines
# built on the library (the component's own changes to Keras live in components/run_fn_swaps.py).
TFX_NAMES = ("tfx", "tfx_bsl", "ml_metadata", "tensorflow_transform", "tensorflow_model_analysis",
             "tensorflow_data_validation", "apache_beam", "tfx_gradient_accumulator.components",
             "tfx_gradient_accumulator.pipelines")


def _tfx_imports(source):
    """The imports of TFX (or of the component) in `source`, anywhere in it: one name per import statement."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [n for n in names if any(n == t or n.startswith(t + ".") for t in TFX_NAMES)][:1]
    return found


def test_the_library_never_imports_tfx():
    found = {name: _tfx_imports(path.read_text()) for name, path in _sources(("accumulator",)).items()}
    assert not {name: imports for name, imports in found.items() if imports}


def test_the_tfx_import_finder_finds_one():
    assert _tfx_imports("import tfx") == ["tfx"]
    assert _tfx_imports("def f():\n    from tfx.types import standard_component_specs") == ["tfx.types"]
    assert _tfx_imports("from tfx_gradient_accumulator import components") == ["tfx_gradient_accumulator.components"]
    assert _tfx_imports("import tfx_gradient_accumulator.accumulator\nimport tensorflow") == []


def _functions(packages=PACKAGES):
    for name, path in _sources(packages).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("packages", [PACKAGES, ("tests",)], ids=["code", "tests"])
def test_no_function_is_longer_than_the_limit(packages):
    long = sorted(f"{where} ({lines} lines)" for where, lines in _functions(packages) if lines > LONGEST_FUNCTION)
    assert not long, f"functions over {LONGEST_FUNCTION} lines:\n" + "\n".join(long)


LONGEST_LIBRARY_CODE = 60   # accumulator/: a function's code, its docstring (the API reference) left out


def _code_lines(node):
    body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
    return node.end_lineno - body[0].lineno + 2     # the `def` line and the code


def test_no_library_function_has_more_code_than_the_limit():
    long = []
    for path in sorted((ROOT / "accumulator").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > LONGEST_LIBRARY_CODE:
                long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({_code_lines(node)} lines)")
    assert not long, f"functions with over {LONGEST_LIBRARY_CODE} lines of code:\n" + "\n".join(long)
    long_one = ast.parse('def f():\n    """Doc."""\n' + "    x = 1\n" * 70).body[0]
    assert _code_lines(long_one) == 71        # the check can fail


def _old_top_level_imports(text):
    return re.findall(r"(?m)^\s*(?:>>> )?(?:from (?:accumulator|components|pipelines|src)[.\s]|import (?:accumulator|components|pipelines|src)\b).*",
                      text)


def _checkout_files(suffixes):
    """The checkout's files with these suffixes, but under a folder named ".*", "site", "work" or
    "build", and those named ".*": skipped folders are not walked (the make targets' virtual
    environments, .venv*, hold some 200,000 files)."""
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = sorted(d for d in subfolders if not d.startswith(".") and d not in ("site", "work", "build"))
        yield from (pathlib.Path(folder) / f for f in sorted(files)
                    if not f.startswith(".") and os.path.splitext(f)[1] in suffixes)


def test_everything_imports_the_package_by_its_installed_name():
    """`accumulator`, `components` and `pipelines` are importable from a checkout's root,
    but the wheel installs them only as `tfx_gradient_accumulator.*`: an import by the
    folder's name would fail for users, and beside the installed name it would load a
    second copy (other classes, hooks installed twice)."""
    found = {}
    for path in _checkout_files((".py", ".md")):
        hits = _old_top_level_imports(path.read_text(encoding="utf-8"))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found
    assert _old_top_level_imports("x = 1\nfrom components import AccumulatingTrainer\n")   # the check can fail


# ------------------------------------------------------------------- the package's layout
# setup.py's `package_dir`: `tfx_gradient_accumulator` is src/tfx_gradient_accumulator/ (its
# `__init__.py` alone), `tfx_gradient_accumulator.<folder>` the top-level folder. No folder at
# the root is named `tfx_gradient_accumulator`, so from a checkout's root (the current
# directory first on sys.path) the installed package's finder, not the directory, finds it.
PACKAGE_INIT = ROOT / "src" / "tfx_gradient_accumulator" / "__init__.py"
SKIPPED = {".git", "site", "work", "build", "dist", "__pycache__"}


def _assigned(path, name):
    """The literal a module's top level assigns to `name` (read with `ast`)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} assigns no {name}")


def test_the_repository_holds_no_symbolic_link():
    links = []
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in SKIPPED and not d.startswith(".")]
        links += [os.path.join(folder, f) for f in subfolders + files if os.path.islink(os.path.join(folder, f))]
    assert not links, links


def test_the_package_is_its_init_file_and_the_top_level_folders():
    assert sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "src").rglob("*.py")) == [
        "src/tfx_gradient_accumulator/__init__.py"]
    assert not (ROOT / "tfx_gradient_accumulator").exists()    # it would shadow the installed package
    assert _assigned(ROOT / "setup.py", "INSTALLED") == INSTALLED
    assert _assigned(ROOT / "tools" / "griffe_package_dir.py", "INSTALLED") == INSTALLED   # the API reference


def _library_files(files, folders):
    """{library source file: [names of the modules loaded from it]}, of {module name: file}
    for the files under `folders` (this checkout's, and where the package is installed)."""
    found = {}
    for name, where in files.items():
        if where and any(pathlib.Path(where).resolve().is_relative_to(f.resolve()) for f in folders):
            found.setdefault(str(pathlib.Path(where).resolve()), []).append(name)
    return found


def _check_one_module_per_file(files, folders=()):
    folders = [ROOT / folder for folder in INSTALLED] + [PACKAGE_INIT.parent, *folders]
    library = _library_files(files, folders)
    twice = {f: names for f, names in library.items() if len(names) > 1}
    assert not twice, f"library files loaded as several modules: {twice}"
    foreign = {f: names for f, names in library.items() if names[0].split(".")[0] != "tfx_gradient_accumulator"}
    assert not foreign, f"library files imported by a folder's name (a second copy): {foreign}"


def test_this_session_loads_each_library_file_once_under_the_package_name():
    """`import accumulator` from a checkout's root would load accumulator/ a second time
    (other classes, hooks installed twice): nothing the tests ran so far did."""
    _check_one_module_per_file({n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())})


_IMPORT_EVERYTHING = """
import importlib, json, pkgutil, sys
import tfx_gradient_accumulator as package
skipped = []
for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
    try:
        importlib.import_module(info.name)
    except ImportError as error:   # an extra's package (tfx, tf_keras, keras_tuner) is not installed
        if (error.name or "").startswith("tfx_gradient_accumulator"):
            raise
        skipped.append(info.name)
print(json.dumps({"files": {n: getattr(m, "__file__", None) for n, m in list(sys.modules.items())},
                  "skipped": skipped}))
"""


def test_the_library_imported_from_the_checkout_root_is_one_copy():
    """A process of its own in the repository's root (the current directory first on sys.path,
    as `python -m pytest`) imports every module of the package: each file is one module,
    under the package's name, and the package's files all come from one install: this
    checkout's folders as setup.py maps them (an editable install) or one installed folder."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="3")
    out = fork_server.run([sys.executable, "-c", _IMPORT_EVERYTHING], cwd=ROOT, env=env,     # TensorFlow, Keras imported
                          capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    ours = {n: pathlib.Path(f).resolve() for n, f in report["files"].items()
            if n.split(".")[0] == "tfx_gradient_accumulator" and f}
    assert "tfx_gradient_accumulator.accumulator.window" in ours
    package = ours["tfx_gradient_accumulator"]
    _check_one_module_per_file(report["files"], [package.parent])
    if package == PACKAGE_INIT.resolve():      # this checkout, installed editable
        expected = {f"tfx_gradient_accumulator.{folder}": ROOT / folder for folder in INSTALLED}
    else:                                      # a wheel's folder
        expected = {f"tfx_gradient_accumulator.{folder}": (package.parent / folder).resolve() for folder in INSTALLED}
    for name, where in ours.items():
        top = ".".join(name.split(".")[:2])
        if top in expected:
            assert where.is_relative_to(expected[top]), (name, where, expected[top])


@pytest.mark.parametrize("folder", INSTALLED)
def test_a_folder_imported_by_its_own_name_is_refused(folder):
    """From a checkout's root `import accumulator` would find the folder itself: a second
    copy of the library (other classes, hooks installed twice). It is refused, naming
    the import to use."""
    env = dict(os.environ, KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2")
    out = subprocess.run([sys.executable, "-c", f"import {folder}"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert f"import tfx_gradient_accumulator.{folder} instead" in out.stderr
