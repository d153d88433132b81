"""The house rules, checked on the source: imports run one way, functions stay short.

Imports inside functions count: a lazy import that closes a cycle is still a
cycle, only one that fails later. Parsed with `ast`, nothing is imported.
"""

import ast
import re
import pathlib

import pytest

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


def test_the_private_names_module_imports_nothing_of_the_library():
    assert import_graph()["tfx_gradient_accumulator.accumulator.seam"] == set()


def test_the_hooks_leave_the_private_names_module():
    # seam reaches past Keras' API; hooks changes Keras; the two jobs live apart.
    graph = import_graph()
    assert "tfx_gradient_accumulator.accumulator.hooks" in graph["tfx_gradient_accumulator.accumulator"]       # `import accumulator` installs them
    assert "tfx_gradient_accumulator.accumulator.fit_hook" not in graph["tfx_gradient_accumulator.accumulator.seam"] | graph["tfx_gradient_accumulator.accumulator.window"]


def _functions(packages=PACKAGES):
    for name, path in _sources(packages).items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node.end_lineno - node.lineno + 1


@pytest.mark.parametrize("packages", [PACKAGES, ("tests",)], ids=["code", "tests"])
def test_no_function_is_longer_than_the_limit(packages):
    long = sorted(f"{where} ({lines} lines)" for where, lines in _functions(packages) if lines > LONGEST_FUNCTION)
    assert not long, f"functions over {LONGEST_FUNCTION} lines:\n" + "\n".join(long)


def _old_top_level_imports(text):
    return re.findall(r"(?m)^\s*(?:>>> )?(?:from (?:accumulator|components|pipelines)[.\s]|import (?:accumulator|components|pipelines)\b).*",
                      text)


def test_everything_imports_the_package_by_its_installed_name():
    """`accumulator`, `components` and `pipelines` are importable from a checkout's root,
    but the wheel installs them only as `tfx_gradient_accumulator.*`: an import by the
    folder's name would fail for users, and beside the installed name it would load a
    second copy (other classes, hooks installed twice)."""
    found = {}
    for path in sorted(ROOT.rglob("*")):
        if path.suffix not in (".py", ".md") or any(part.startswith(".") or part in ("site", "work", "build")
                                                     for part in path.relative_to(ROOT).parts):
            continue
        hits = _old_top_level_imports(path.read_text(encoding="utf-8"))
        if hits:
            found[str(path.relative_to(ROOT))] = hits
    assert not found, found
    assert _old_top_level_imports("x = 1\nfrom components import AccumulatingTrainer\n")   # the check can fail
