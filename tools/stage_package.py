"""Copies the package, as the wheel holds it, into a folder: for a Python that cannot
install this checkout (the lent GPU machine: no network, no known setuptools).

    python -m tools.stage_package /tmp/tfx-package
    export PYTHONPATH=/tmp/tfx-package${PYTHONPATH:+:$PYTHONPATH}

A checkout's root has no `tfx_gradient_accumulator/` folder (setup.py's `package_dir` maps
the package to src/tfx_gradient_accumulator/ and its sub-packages to the top-level
folders), so `import tfx_gradient_accumulator` needs an install (`pip install -e .`) or
this copy. It holds what the wheel holds (`tests/test_wheel.py` compares them): the
package's `__init__.py` and the `.py` files of accumulator/, components/, pipelines/.
Standard library only; the folder is replaced.
"""

import ast
import pathlib
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = "tfx_gradient_accumulator"


def installed_folders():
    """setup.py's INSTALLED (read, not run)."""
    for node in ast.parse((ROOT / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "INSTALLED" for t in node.targets):
            return ast.literal_eval(node.value)
    raise RuntimeError("setup.py assigns no INSTALLED")


def stage(destination):
    """Writes destination/tfx_gradient_accumulator/...; returns the files' paths in it."""
    package = pathlib.Path(destination) / PACKAGE
    if package.exists():
        shutil.rmtree(package)
    sources = {pathlib.Path("__init__.py"): ROOT / "src" / PACKAGE / "__init__.py"}
    for folder in installed_folders():
        for source in sorted((ROOT / folder).rglob("*.py")):
            if "__pycache__" not in source.parts:
                sources[source.relative_to(ROOT)] = source
    for inside, source in sources.items():
        (package / inside).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, package / inside)
    return sorted(f"{PACKAGE}/{inside.as_posix()}" for inside in sources)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    print(f"{len(stage(sys.argv[1]))} files in {pathlib.Path(sys.argv[1]) / PACKAGE}")
