"""The fork server starts what `python -m`, `python -c` and `python script` would start.

Most cases preload `json` alone, not TensorFlow: what is checked here is the child's
start and end; `tests/test_docs.py` checks a child with TensorFlow and Keras imported.
"""

import json
import os
import signal
import subprocess
import sys

import pytest

from tests import fork_server

LIGHT = ("json",)
REPORT = ("import json, os, sys, tempfile; print(json.dumps({'argv': sys.argv, 'path0': sys.path[0], "
          "'name': __name__, 'cwd': os.getcwd(), 'env': os.environ.get('FORKED'), "
          "'tmp': tempfile.gettempdir(), 'stdin': sys.stdin.read()}))")


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    return dict(env, **extra)


def _report(args, tmp_path):
    done = fork_server.run([sys.executable, *args], cwd=tmp_path, env=_env(FORKED="yes", TMPDIR=str(tmp_path)),
                           capture_output=True, timeout=60, preload=LIGHT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.splitlines()[-1])


def test_the_child_has_the_argv_path_folder_and_environment_python_would_give_it(tmp_path):
    (tmp_path / "probe_module.py").write_text(REPORT + "\n")
    script = tmp_path / "sub" / "probe_script.py"
    script.parent.mkdir()
    script.write_text(REPORT + "\n")
    common = {"name": "__main__", "cwd": str(tmp_path), "env": "yes", "tmp": str(tmp_path), "stdin": ""}
    assert _report(["-c", REPORT, "a", "1"], tmp_path) == dict(common, argv=["-c", "a", "1"], path0="")
    assert _report(["-m", "probe_module", "b"], tmp_path) == dict(
        common, argv=[str(tmp_path / "probe_module.py"), "b"], path0=str(tmp_path))
    assert _report([str(script), "c"], tmp_path) == dict(common, argv=[str(script), "c"], path0=str(script.parent))


def test_exit_statuses_errors_and_kills_come_back_as_a_popen_shows_them(tmp_path):
    def run(code, timeout=60):
        return fork_server.run([sys.executable, "-c", code], env=_env(), capture_output=True, timeout=timeout,
                               preload=LIGHT)

    assert run("import sys; sys.exit(3)").returncode == 3
    assert run("import sys; sys.exit('no')").returncode == 1
    failed = run("def f():\n    raise ValueError('boom')\nf()")
    assert failed.returncode == 1
    assert failed.stderr.splitlines()[:2] == ["Traceback (most recent call last):", '  File "<string>", line 3, in <module>']
    assert failed.stderr.splitlines()[-1] == "ValueError: boom"
    merged = fork_server.popen([sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr)"],
                               env=_env(), stderr=subprocess.STDOUT, preload=LIGHT)
    assert merged.communicate(60) == ("out\nerr\n", None) and merged.returncode == 0
    sleeping = fork_server.popen([sys.executable, "-c", "import time; time.sleep(600)"], env=_env(), preload=LIGHT)
    assert sleeping.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeping.wait(0.5)
    sleeping.kill()
    assert sleeping.wait(60) == -signal.SIGKILL
    with pytest.raises(subprocess.TimeoutExpired):
        run("import time; time.sleep(600)", timeout=1)


def test_children_differ_in_their_random_state_and_slots_in_their_hash_seeds():
    code = "import numpy; print(numpy.random.randint(1 << 30), hash('seed'))"

    def draw(slot):
        done = fork_server.run([sys.executable, "-c", code], env=_env(), capture_output=True, timeout=120,
                               slot=slot, preload=("numpy",))
        return [int(n) for n in done.stdout.split()]

    first, second, other_slot = draw(0), draw(0), draw(1)
    assert first[0] != second[0]            # numpy reseeded in each child
    assert first[1] == second[1]            # one server, one hash seed
    assert first[1] != other_slot[1]        # another server: another seed, as a fresh process has


def test_a_server_whose_input_ends_kills_its_children_and_ends(tmp_path):
    server = fork_server._Server(sys.executable, _env(), LIGHT)
    forked = fork_server.Forked(["sleep"], {})
    server.start(forked, dict(argv=["-c", "import time; time.sleep(600)"], cwd=str(tmp_path), env=_env(),
                              stdout=os.devnull, stderr=os.devnull))
    server.close()
    assert server.process.returncode == 0
    assert forked.wait(60) == -signal.SIGKILL
    with pytest.raises(ProcessLookupError):
        os.kill(forked.pid, 0)


def test_what_it_cannot_fork_is_refused_before_anything_starts():
    with pytest.raises(ValueError, match=r"args: \[sys.executable"):
        fork_server.popen(["python3", "-c", "pass"])
    with pytest.raises(ValueError, match=r"args: \[sys.executable"):
        fork_server.popen([sys.executable, "-W", "error", "-c", "pass"])
    with pytest.raises(ValueError, match="stdout: PIPE, DEVNULL"):
        fork_server.popen([sys.executable, "-c", "pass"], stdout=7)
