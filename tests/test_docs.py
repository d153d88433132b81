"""The docs prove themselves: the manual builds, and every python block in it runs.

Conventions for README.md and docs/**/*.md (DEVELOPERS.md, "Docs"):

- Every ```python fenced block is a test case, id `file:line` (the line of its opening
  fence). It runs in a process of its own (this interpreter: the TFX venv in `make
  test`), because Keras' global state and the hooks `import accumulator` installs make
  running blocks in one process unsafe: forked from a server that has imported
  TensorFlow and Keras and nothing more (`tests/fork_server.py`: it saves each block
  their import, about 9 s of CPU), or a fresh interpreter for a standalone block and
  for one that sets `TF_USE_LEGACY_KERAS`. The process runs in an empty
  temporary directory (write files there, relative), with `PYTHONPATH` = the
  repository first, `KERAS_BACKEND=tensorflow`, `TF_CPP_MIN_LOG_LEVEL=2`, no
  `TF_USE_LEGACY_KERAS` (a Keras 2 block sets it itself, before importing
  TensorFlow), and a timeout of `SNIPPET_TIMEOUT` seconds. The blocks run side by
  side, `DOCS_TEST_WORKERS` at a time (default 2), each test waiting for its own.
- A block is self-contained, or its page declares a shared setup that the reader
  sees: a python block directly preceded by the line `<!-- docs-test: setup -->`
  (blank lines between are fine) is prepended to every later python block of the
  same page (and runs on its own only when no python block follows it). A python block
  directly preceded by `<!-- docs-test: standalone -->` runs without the page's setup:
  a program that must start its own process its own way (a Keras 2 one sets
  `TF_USE_LEGACY_KERAS` before importing TensorFlow, which a Keras 3 setup has imported).
- Where a block claims something (the same weights as the large batch, a refusal),
  it asserts it: `np.testing.assert_allclose(..., atol=1e-5)`, so the docs prove
  their own claims. Keep blocks small: tiny synthetic data, a few steps, seconds.
- Shell commands go in ```bash blocks, output in ```text blocks: neither runs. Every
  fence names its language, so a python block cannot slip past unlabelled.

`test_docs_build_strict` builds the site with `mkdocs build --strict` into a
temporary folder: a broken link or anchor, a page missing from the nav, or an API
name mkdocstrings cannot find fails it (`make docs` builds the same into site/).
"""

import os
import re
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import fork_server

ROOT = Path(__file__).resolve().parent.parent
SETUP_MARK = "<!-- docs-test: setup -->"
STANDALONE_MARK = "<!-- docs-test: standalone -->"
# Before a block (or before its other mark): the block takes a minute or more and a test
# of `make test` shows its claim too, so it runs in `make test-apart` (marker apart).
APART_MARK = "<!-- docs-test: apart -->"
SNIPPET_TIMEOUT = 240
MIN_BLOCKS = 20            # the docs hold more; fewer means the collector lost some
# Pages whose claims are shown by running examples: each must keep at least one.
PAGES_WITH_EXAMPLES = (
    "README.md", "docs/guide/index.md", "docs/guide/weighting.md", "docs/guide/partial-windows.md",
    "docs/guide/batch-norm.md", "docs/guide/schedules.md", "docs/guide/micro-batch.md", "docs/guide/mixed-precision.md",
    "docs/guide/keras-builtin.md", "docs/guide/embeddings.md", "docs/noise-scale.md", "docs/keras2.md",
    "docs/distributed.md", "docs/keras-changes.md", "docs/tfx.md", "docs/cluster.md", "docs/guide/check.md",
)
LANGUAGES = {"python", "bash", "text", "json", "dockerfile", "yaml"}

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def markdown_files(root=ROOT):
    """README.md and every page under docs/ (the generated reports included)."""
    return [root / "README.md"] + sorted((root / "docs").rglob("*.md"))


def fenced_blocks(text):
    """[(line, language, code, mark)] of every fenced block, lines counted from 1; `mark`
    is the docs-test mark on the line before it (blank lines between are fine), or None."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, indent = opening["fence"], opening["indent"]
        language = opening["info"].strip().split()[0] if opening["info"].strip() else ""
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip().startswith(fence[0] * len(fence))
                                      and lines[j].strip().strip(fence[0]) == ""):
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        before = [line.strip() for line in lines[:i] if line.strip() and line.strip() != APART_MARK]
        mark = before[-1] if before and before[-1] in (SETUP_MARK, STANDALONE_MARK) else None
        blocks.append((i + 1, language, textwrap.dedent("\n".join(body)) + "\n", mark))
        i = j + 1
    return blocks


def python_snippets(files=None, root=ROOT):
    """[(id, code)]: each python block with its page's earlier setup blocks before it
    (a standalone block alone).

    A setup block is a case of its own only when no python block follows it (the
    blocks after it run it anyway).
    """
    snippets = []
    for path in files or markdown_files(root):
        setup, page = [], []
        for line, language, code, mark in fenced_blocks(path.read_text(encoding="utf-8")):
            if language != "python":
                continue
            is_setup = mark == SETUP_MARK
            prefix = "" if mark == STANDALONE_MARK else "".join(setup)
            page.append((f"{path.relative_to(root).as_posix()}:{line}", prefix + code, is_setup))
            if is_setup:
                setup.append(code)
        snippets += [(name, code) for i, (name, code, is_setup) in enumerate(page)
                     if not is_setup or i == len(page) - 1]
    return snippets


def apart_blocks(files=None, root=ROOT):
    """The ids ("page:line") of the python blocks an APART_MARK precedes (blank lines and
    one other docs-test mark between are fine)."""
    apart = set()
    for path in files or markdown_files(root):
        text = path.read_text(encoding="utf-8")
        lines = [line.strip() for line in text.splitlines()]
        for line, language, _, _ in fenced_blocks(text):
            before = [text for text in lines[:line - 1] if text][-2:]
            if language == "python" and APART_MARK in before and (
                    before[-1] == APART_MARK or before[-1] in (SETUP_MARK, STANDALONE_MARK)):
                apart.add(f"{path.relative_to(root).as_posix()}:{line}")
    return apart


def standalone_blocks(files=None, root=ROOT):
    """The ids ("page:line") of the python blocks a STANDALONE_MARK precedes."""
    return {f"{path.relative_to(root).as_posix()}:{line}" for path in files or markdown_files(root)
            for line, language, _, mark in fenced_blocks(path.read_text(encoding="utf-8"))
            if language == "python" and mark == STANDALONE_MARK}


SNIPPETS = python_snippets()
APART_SNIPPETS = apart_blocks()
STANDALONE_SNIPPETS = standalone_blocks()


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("TF_USE_LEGACY_KERAS", "ACCUMULATOR_KERAS_HOOKS", "TF_CONFIG")}
    env.update(KERAS_BACKEND="tensorflow", TF_CPP_MIN_LOG_LEVEL="2", PYTHONDONTWRITEBYTECODE="1",
               NO_MKDOCS_2_WARNING="1", MPLBACKEND="Agg", HOME=str(tmp_path),
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    return env


def _needs_a_fresh_interpreter(name, code):
    """A standalone block, or one that sets TF_USE_LEGACY_KERAS (before TensorFlow is imported, it says)."""
    return name in STANDALONE_SNIPPETS or "TF_USE_LEGACY_KERAS" in code


def _run(code, folder, standalone=False, timeout=SNIPPET_TIMEOUT):
    """Runs one block in its own process in `folder`; (exit code or None on timeout, stdout, stderr).

    The process is forked from one that has imported TensorFlow and Keras
    (`tests/fork_server.py`), or, for a standalone block, a fresh interpreter.
    """
    script = folder / "snippet.py"
    script.write_text(code, encoding="utf-8")
    work = folder / "work"
    work.mkdir()
    run = subprocess.run if standalone else fork_server.run
    try:
        done = run([sys.executable, str(script)], cwd=work, env=_env(folder), capture_output=True, text=True,
                   timeout=timeout)
    except subprocess.TimeoutExpired as expired:
        return None, _text(expired.stdout), _text(expired.stderr)
    return done.returncode, done.stdout, done.stderr


def _text(output):
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


def _workers():
    return max(1, int(os.environ.get("DOCS_TEST_WORKERS", min(2, os.cpu_count() or 1))))


@pytest.fixture(scope="session")
def snippet_results(request, tmp_path_factory):
    """{test id: Future}: the selected blocks, started together, DOCS_TEST_WORKERS at a time.

    Each block is its own process, so they run side by side (2 at a time by default,
    the cores of the project's machines); each test then waits for its own.
    """
    pool = ThreadPoolExecutor(_workers())
    items = [item for item in request.session.items if getattr(item, "originalname", None) == "test_snippet_runs"]
    fresh = {item.callspec.id: _needs_a_fresh_interpreter(item.callspec.id, item.callspec.params["code"])
             for item in items}
    futures = {item.callspec.id: pool.submit(_run, item.callspec.params["code"], tmp_path_factory.mktemp("snippet"),
                                             fresh[item.callspec.id])
               for item in items}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("code", [pytest.param(code, id=name, marks=[pytest.mark.apart] * (name in APART_SNIPPETS))
                                  for name, code in SNIPPETS])
def test_snippet_runs(code, request, snippet_results):
    returncode, stdout, stderr = snippet_results[request.node.callspec.id].result()
    if returncode is None:
        pytest.fail(f"the block ran over {SNIPPET_TIMEOUT} s", pytrace=False)
    if returncode:
        numbered = "\n".join(f"{n:4d}  {line}" for n, line in enumerate(code.splitlines(), 1))
        pytest.fail(f"the block failed (exit {returncode}):\n{numbered}\n\n"
                    f"stdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-6000:]}", pytrace=False)


def test_a_forked_block_starts_clean_and_its_end_is_reported(tmp_path):
    """A block forked by the server: TensorFlow and Keras imported, not this library (its hooks
    are the block's to install), the block's folder and environment; its exit status, its
    exception and its output come back, and one that runs over its time is killed."""
    cases = [
        ("import os, sys\nassert 'tensorflow' in sys.modules and 'keras' in sys.modules\n"
         "assert not any(name.startswith('tfx_gradient_accumulator') for name in sys.modules)\n"
         "assert os.getcwd().endswith('work') and __name__ == '__main__' and 'TF_USE_LEGACY_KERAS' not in os.environ\n"
         "print('clean'); sys.exit(3)", 3, "clean"),
        ("raise ValueError('boom')", 1, "ValueError: boom"),
        ("import time; time.sleep(60)", None, ""),
    ]
    for i, (code, expected, said) in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        returncode, stdout, stderr = _run(code, folder, timeout=60 if expected else 3)
        assert returncode == expected, (code, returncode, stdout, stderr[-2000:])
        assert said in stdout + stderr, (code, stdout, stderr[-2000:])
    assert _needs_a_fresh_interpreter("p.md:1", 'os.environ["TF_USE_LEGACY_KERAS"] = "1"\n')
    assert not _needs_a_fresh_interpreter("p.md:1", "import keras\n")


def test_every_block_is_collected():
    """The collector must not go quiet: it finds the blocks, every fence says its language."""
    assert len(SNIPPETS) >= MIN_BLOCKS, [name for name, _ in SNIPPETS]
    unlabelled = []
    for path in markdown_files():
        for line, language, _, _ in fenced_blocks(path.read_text(encoding="utf-8")):
            if language not in LANGUAGES:
                unlabelled.append(f"{path.relative_to(ROOT)}:{line} ({language or 'no language'})")
    assert not unlabelled, f"fences without one of {sorted(LANGUAGES)}: {unlabelled}"
    pages = {name.split(":")[0] for name, _ in SNIPPETS if name not in APART_SNIPPETS}
    missing = sorted(set(PAGES_WITH_EXAMPLES) - pages)
    assert not missing, f"pages with no python block that make test runs: {missing}"


def test_a_block_marked_apart_runs_apart_and_keeps_its_other_mark(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("<!-- docs-test: setup -->\n```python\nx = 1\n```\n\n<!-- docs-test: apart -->\n"
                    "<!-- docs-test: standalone -->\n\n```python\ny = 2\n```\n\n"
                    "<!-- docs-test: apart -->\n```python\nprint(x)\n```\n\n```python\nprint(x + 1)\n```\n",
                    encoding="utf-8")
    assert dict(python_snippets([page], root=tmp_path)) == {
        "docs/page.md:9": "y = 2\n", "docs/page.md:14": "x = 1\nprint(x)\n",
        "docs/page.md:18": "x = 1\nprint(x + 1)\n"}
    assert apart_blocks([page], root=tmp_path) == {"docs/page.md:9", "docs/page.md:14"}
    assert standalone_blocks([page], root=tmp_path) == {"docs/page.md:9"}


def test_setup_blocks_are_prepended(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text(textwrap.dedent("""\
        # A page

        ```python
        a = 1
        ```

        <!-- docs-test: setup -->

        ```python
        b = 2
        ```

        ```bash
        echo not run
        ```

        - a list item:

          ```python
          print(a + b)
          ```

        <!-- docs-test: standalone -->
        ```python
        c = 3
        ```
        """))
    snippets = python_snippets([page], root=tmp_path)
    assert [name for name, _ in snippets] == ["docs/page.md:3", "docs/page.md:19", "docs/page.md:24"]
    assert [code for _, code in snippets] == ["a = 1\n", "b = 2\nprint(a + b)\n", "c = 3\n"]


def test_docs_build_strict(tmp_path):
    """`mkdocs build --strict`: broken links, anchors and API names fail."""
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (
        "mkdocs build --strict failed (needs the `docs` extra: pip install -e '.[docs]'):\n"
        + done.stdout[-3000:] + done.stderr[-6000:])
    site = tmp_path / "site"
    assert (site / "index.html").exists()
    api = (site / "api" / "gradient-accumulator.html").read_text(encoding="utf-8")
    assert "micro_batch_weight" in api and "accum_steps" in api   # rendered from the docstrings
    # Signatures formatted one parameter a line (mkdocstrings needs Ruff or Black for that;
    # without, a long signature is one clipped line): the `docs` extra installs Ruff.
    assert re.search(r'doc-signature.*?GradientAccumulator</span><span class="p">\(</span>\n\s+<span class="n">optimizer',
                     api, re.S), "API signatures are not formatted: is ruff installed (the docs extra)?"
    home = (site / "index.html").read_text(encoding="utf-8")
    assert 'href="guide/contrastive.html"' in home     # every guide page is on the home page


def test_the_exactness_promise_says_what_a_gpu_needs():
    """Where the promise is made (README, the home page), the GPU caveat and its setting."""
    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        text = page.read_text(encoding="utf-8")
        promise = text.index("same weights\nwithin float tolerance")
        assert "on GPUs with TF32 off" in text[promise:promise + 120], page.name
        caveat = text[text.index("### On GPUs"):]
        caveat = caveat[:caveat.index("\n## ")]
        for needed in ("NVIDIA_TF32_OVERRIDE=0", "enable_op_determinism", "9.1e-5", "1.9e-3"):
            assert needed in caveat, (page.name, needed)


# Words about how the project was worked on, and machine paths: not for users' pages,
# generated reports included (fix their generators, then `--report_only`).
FORBIDDEN = {
    "a work-item number": re.compile(r"\b(issue|session)s? #?\d+", re.I),
    "the seed project's name for a reference": re.compile(r"\bseeds' (tape )?(loop|pattern)", re.I),
    "a session's own time": re.compile(r"\bthe session's\b|\bsession had\b", re.I),
    "an absolute machine path": re.compile(r"(?<![\w.~])/(work|root|home|tmp)/[\w.+-]+/"),
}


def users_files(root=ROOT):
    docs = root / "docs"
    return [root / "README.md"] + sorted(p for p in docs.rglob("*") if p.suffix in (".md", ".json", ".yml"))


def test_users_docs_speak_of_the_product_only(tmp_path):
    found = [f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}: {what}: {m.group(0)!r}"
             for path in users_files() for text in [path.read_text(encoding="utf-8")]
             for what, pattern in FORBIDDEN.items() for m in pattern.finditer(text)]
    assert not found, "\n".join(found)
    # Control: each pattern finds what it is for.
    for what, sample in (("a work-item number", "Target (issue 22):"), ("a session's own time", "the session's 30 minutes"),
                         ("the seed project's name for a reference", "| seeds' tape loop |"),
                         ("an absolute machine path", "Python 3.11.7 (/work/main/.venv/bin/python)")):
        assert FORBIDDEN[what].search(sample), what
