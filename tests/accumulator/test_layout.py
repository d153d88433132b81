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


# The rooms of `accumulator/` are its folders: each sub-package is a room, and the modules at
# the top (the public fronts) are the room "accumulator". Each room's `__init__.py` says in its
# docstring which rooms it may import ("May import: core, rows."); the order the rooms come
# in is read from those lines (DEVELOPERS.md's map). The package's face,
# `accumulator/__init__.py`, imports what it re-exports and is left out.
LIBRARY = ROOT / "accumulator"
LIBRARY_NAME = "tfx_gradient_accumulator.accumulator"
TOP_ROOM = "accumulator"
PACKAGE_ORDER = ("accumulator", "components", "pipelines")   # each imports only from itself and those before


def _may_import(init_source, room):
    """The rooms an `__init__.py`'s docstring says its room may import (a set; "nothing ..." is empty)."""
    doc = ast.get_docstring(ast.parse(init_source)) or ""
    found = re.findall(r"(?m)^May import: ([^\n]*?)\.?$", doc)
    assert len(found) == 1, f"{room}/__init__.py: its docstring needs one line 'May import: <rooms>.'"
    return set() if found[0].startswith("nothing") else {r.strip() for r in found[0].split(",")}


def declared_rooms(library=LIBRARY):
    """{room: the rooms it may import}, from the folders: every sub-folder holding Python is a room."""
    rooms = {}
    for folder in sorted(p for p in library.iterdir() if p.is_dir() and any(p.glob("*.py"))):
        init = folder / "__init__.py"
        assert init.exists(), f"{folder.name}/ holds modules but no __init__.py"
        rooms[folder.name] = _may_import(init.read_text(), folder.name)
    rooms[TOP_ROOM] = _may_import((library / "__init__.py").read_text(), TOP_ROOM)
    return rooms


def room_order(rooms):
    """The rooms in an order where each comes after every room it may import; a cycle fails."""
    cycle = find_cycle({room: set(allowed) for room, allowed in rooms.items()})
    assert cycle is None, "rooms that may import each other: " + " -> ".join(cycle)
    order, placed = [], set()
    while len(order) < len(rooms):
        ready = sorted(r for r, allowed in rooms.items() if r not in placed and allowed <= placed)
        order += ready
        placed |= set(ready)
    return order


def room_of_module(module):
    """The room of a library module's dotted name (None for the package's face)."""
    rest = module[len(LIBRARY_NAME):].lstrip(".").split(".")
    if rest == [""]:
        return None
    return rest[0] if len(rest) > 1 or (LIBRARY / rest[0]).is_dir() else TOP_ROOM


def imports_against_the_rooms(graph, rooms, room_of=room_of_module):
    """Imports a room's docstring does not allow (between rooms), and imports of a later package."""
    wrong = []
    for module, imported in graph.items():
        if module.startswith(LIBRARY_NAME) and room_of(module) is not None:
            mine = room_of(module)
            wrong += [f"{module} ({mine}) imports {target} ({room_of(target)})" for target in sorted(imported)
                      if target.startswith(LIBRARY_NAME) and room_of(target) not in (mine, None)
                      and room_of(target) not in rooms[mine]]
        parts = module.split(".")
        if parts[0] == "tfx_gradient_accumulator" and len(parts) > 1 and parts[1] in PACKAGE_ORDER:
            rank = PACKAGE_ORDER.index(parts[1])
            wrong += [f"{module} imports {target}" for target in sorted(imported)
                      if target.split(".")[1:2] and target.split(".")[1] in PACKAGE_ORDER
                      and PACKAGE_ORDER.index(target.split(".")[1]) > rank]
    return wrong


def test_every_room_says_what_it_may_import_and_the_rooms_have_an_order():
    rooms = declared_rooms()
    assert {"core", "window", "batch", "keras2", "check", TOP_ROOM} <= set(rooms)
    unknown = {room: sorted(allowed - set(rooms)) for room, allowed in rooms.items() if allowed - set(rooms)}
    assert not unknown, f"rooms named in 'May import' lines that are no folder: {unknown}"
    order = room_order(rooms)
    assert order[0] == "core" and order[-1] == "check", order


def test_imports_run_from_the_later_rooms_to_the_earlier():
    assert imports_against_the_rooms(import_graph(), declared_rooms()) == []


def test_the_rooms_check_can_fail(tmp_path):
    # An import a room's docstring does not allow is reported, as is one of a later package.
    rooms = {"first": set(), "second": {"first"}}
    graph = {"tfx_gradient_accumulator.accumulator.first.a": {"tfx_gradient_accumulator.accumulator.second.b"},
             "tfx_gradient_accumulator.accumulator.second.b": {"tfx_gradient_accumulator.accumulator.first.a"},
             "tfx_gradient_accumulator.accumulator.first.c": {"tfx_gradient_accumulator.components.x"}}
    assert imports_against_the_rooms(graph, rooms) == [
        "tfx_gradient_accumulator.accumulator.first.a (first) imports tfx_gradient_accumulator.accumulator.second.b (second)",
        "tfx_gradient_accumulator.accumulator.first.c imports tfx_gradient_accumulator.components.x"]
    # The rooms are read from the folders: one without a 'May import' line, or two rooms
    # that may import each other, fail.
    for name, allowed in (("first", "nothing of the library"), ("second", "first")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f'"""Room {name}.\n\nMay import: {allowed}.\n"""\n')
    (tmp_path / "__init__.py").write_text('"""The face.\n\nMay import: first, second.\n"""\n')
    assert room_order(declared_rooms(tmp_path)) == ["first", "second", TOP_ROOM]
    (tmp_path / "first" / "__init__.py").write_text('"""Room first.\n\nMay import: second.\n"""\n')
    with pytest.raises(AssertionError, match="may import each other"):
        room_order(declared_rooms(tmp_path))
    (tmp_path / "second" / "__init__.py").write_text('"""Room second, silent."""\n')
    with pytest.raises(AssertionError, match="May import"):
        declared_rooms(tmp_path)


def test_the_map_of_the_house_names_every_room_in_order():
    """DEVELOPERS.md draws the rooms as the folders give them: each named, in the derived order."""
    text = (ROOT / "DEVELOPERS.md").read_text()
    section = text[text.index("## The map of the house"):]
    section = section[:section.index("\n## ", 1)]
    headings = re.findall(r"(?m)^### `accumulator/(\w*)/?`", section)
    order = room_order(declared_rooms())
    named = [h or TOP_ROOM for h in headings]
    assert sorted(named) == sorted(order), (named, order)
    assert all(set(declared_rooms()[room]) <= set(named[:i]) for i, room in enumerate(named)), named


def test_the_private_names_module_imports_nothing_of_the_library():
    # but the public Keras-flavour detection, itself a leaf.
    graph = import_graph()
    assert graph["tfx_gradient_accumulator.accumulator.core.seam"] <= {"tfx_gradient_accumulator.accumulator.core.flavours"}
    assert graph["tfx_gradient_accumulator.accumulator.core.flavours"] == set()


def test_the_hooks_leave_the_private_names_module():
    # seam reaches past Keras' API; hooks changes Keras; the two jobs live apart.
    graph = import_graph()
    assert "tfx_gradient_accumulator.accumulator.hooks" in graph["tfx_gradient_accumulator.accumulator"]       # `import accumulator` installs them
    assert "tfx_gradient_accumulator.accumulator.fit_hook" not in graph["tfx_gradient_accumulator.accumulator.core.seam"] | graph["tfx_gradient_accumulator.accumulator.window.window"]


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


LONGEST_LIBRARY_CODE = 59      # a function's code, its docstring (the API reference) left out
LONGEST_CLASS = 399            # lines, docstring included
LONGEST_MODULE = 899           # lines
SHIPPED = ("accumulator", "components")   # the library and the component


def _code_lines(node):
    body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
    return node.end_lineno - body[0].lineno + 2     # the `def` line and the code


def over_the_limits(paths, root=ROOT):
    """What in these files is over the limits: functions by code lines, classes and modules by lines."""
    long = []
    for path in paths:
        source = path.read_text()
        where = path.relative_to(root)
        if len(source.splitlines()) > LONGEST_MODULE:
            long.append(f"{where}: module of {len(source.splitlines())} lines")
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _code_lines(node) > LONGEST_LIBRARY_CODE:
                long.append(f"{where}:{node.lineno} {node.name} ({_code_lines(node)} lines of code)")
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > LONGEST_CLASS:
                long.append(f"{where}:{node.lineno} class {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    return long


def test_the_library_and_the_component_stay_under_the_limits():
    """Every function under 60 lines of code, every class under 400 lines, every module under 900."""
    long = over_the_limits(sorted(p for folder in SHIPPED for p in (ROOT / folder).rglob("*.py")))
    assert not long, "over the limits:\n" + "\n".join(long)


def test_the_limits_check_can_fail(tmp_path):
    source = ('def f():\n    """Doc."""\n' + "    x = 1\n" * 70 + "class C:\n" + "    y = 1\n" * 400
              + "z = 1\n" * 500)
    (tmp_path / "m.py").write_text(source)
    assert [entry.split(" (")[0] for entry in over_the_limits([tmp_path / "m.py"], tmp_path)] == [
        "m.py: module of 973 lines", "m.py:1 f", "m.py:73 class C"]


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
    assert "tfx_gradient_accumulator.accumulator.window.window" in ours
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


def test_the_old_module_paths_import_the_moved_modules_with_a_warning():
    """A module's path from before the rooms (`accumulator.options`) still imports: the same
    module object as at its new path, with a FutureWarning that names the new path."""
    import importlib
    import warnings

    import tfx_gradient_accumulator.accumulator as library

    assert {f"{room}/{name}.py" for name, room in library.MOVED_MODULES.items()
            if not (LIBRARY / room / f"{name}.py").exists()} == set()
    for name in ("options", "window_rows", "fit_micro_batches", "check_report"):
        new = importlib.import_module(f"{LIBRARY_NAME}.{library.MOVED_MODULES[name]}.{name}")
        sys.modules.pop(f"{LIBRARY_NAME}.{name}", None)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            old = importlib.import_module(f"{LIBRARY_NAME}.{name}")
        sys.modules.pop(f"{LIBRARY_NAME}.{name}", None)     # one name per file for the layout tests that follow
        assert old is new
        assert any(issubclass(w.category, FutureWarning) and new.__name__ in str(w.message) for w in caught)
