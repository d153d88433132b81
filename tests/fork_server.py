"""Starts the tests' own processes by forking them from one that has imported TensorFlow.

Many tests run code in a process of their own: a cluster's workers, a load in a fresh
process, the check CLI, a docs block, TFX's `run_executor` as a Vertex replica. Each
would spend about 9 s of CPU importing TensorFlow and Keras (about 45 such processes in
`make test`). A server (`python tests/fork_server.py MODULE...`) imports the modules
once and forks a process per request, concurrently: the child is what `python -m
module`, `python -c code` or `python script` would be, with those modules imported and
nothing else: no TensorFlow device or eager context, no Keras model, none of this
library's hooks (importing initialises none of them; a child that imports the library
installs its hooks in its own process, as a user's program does).

Where a fork would differ from a fresh interpreter, and how each is kept apart:

- What the interpreter reads at its start (`PYTHONPATH`, `PYTHONHASHSEED`, ...) and
  TensorFlow at its import (`TF_USE_LEGACY_KERAS`, `KERAS_BACKEND`, ...): a request
  goes to a server started with the same values of those (`STARTUP`); the child gets
  the request's whole environment. (Keras finds its folder, `~/.keras`, at its import:
  the server's `HOME`, not the child's, unless `KERAS_HOME` is set.)
- The hash seed, one per server: the processes of one cluster come from different
  servers (`slot`), so that they differ as fresh ones would and a set iterated in a
  different order on each worker is not hidden.
- numpy's global random state: reseeded in each child (Python's `random` reseeds
  itself at a fork). `tempfile`'s folder: forgotten, so `TMPDIR` is read again.

`popen` and `run` take a `subprocess` command line whose first item is this
interpreter; `popen` answers a `Forked`, which waits, polls and kills as a `Popen` does.

The protocol, a line of JSON each way: the client writes {"id", "argv", "cwd", "env",
"stdout", "stderr"} (the two: paths; stderr may be "stdout"; stdin is /dev/null); the server
answers {"id", "pid"} once the child has started and {"id", "exit"} once it has ended
(negative: killed by that signal). At the end of its input the server kills the
children still running and ends.
"""

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

PRELOAD = ("numpy", "tensorflow", "keras")     # tf_keras for keras, where TF_USE_LEGACY_KERAS is set
STARTUP = ("PYTHONPATH", "PYTHONHASHSEED", "PYTHONHOME", "PYTHONSAFEPATH", "PYTHONWARNINGS",
           "PYTHONPYCACHEPREFIX", "PYTHONDONTWRITEBYTECODE", "TF_USE_LEGACY_KERAS", "KERAS_BACKEND",
           "KERAS_HOME", "TF_CPP_MIN_LOG_LEVEL", "TF_ENABLE_ONEDNN_OPTS", "CUDA_VISIBLE_DEVICES",
           "ACCUMULATOR_KERAS_HOOKS")
SERVER = os.path.abspath(__file__)


# The server's side.

def _argv_into_main(argv):
    """Runs `python ARGV...` (argv without the interpreter) in this process, as its __main__."""
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = type(sys)("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]     # runpy puts the module's file first
        sys.path[0] = os.getcwd()
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
        runpy.run_path(argv[0], run_name="__main__")


def _child(request):
    """In the forked child: the request's process; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None
        if "numpy" in sys.modules:
            sys.modules["numpy"].random.seed()
        os.chdir(request["cwd"])
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                                (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_APPEND),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)):
            if path == "stdout":
                os.dup2(1, fd)
                continue
            target = os.open(path, flags, 0o644)
            os.dup2(target, fd)
            os.close(target)
        sys.stdin = open(0, closefd=False)
        code = 0
        _argv_into_main(request["argv"])
    except SystemExit as done:      # as the interpreter reads it: None 0, a number, else printed and 1
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException as error:     # its traceback from the child's own code on, as the interpreter's
        frames = error.__traceback__
        while frames is not None and frames.tb_frame.f_code.co_filename in (__file__, runpy.__file__):
            frames = frames.tb_next
        traceback.print_exception(type(error), error, frames)
        code = 1
    try:
        threading._shutdown()       # as the interpreter does: wait for non-daemon threads
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(preload):
    answers = os.fdopen(os.dup(1), "w")     # the answers' own descriptor: what an import
    os.dup2(2, 1)                            # prints to stdout goes to stderr, not into them
    script_folder = sys.path.pop(0)          # this file's folder: not the children's
    for module in preload:
        try:
            __import__(module)
        except ModuleNotFoundError as missing:      # an optional one (tf_keras): not installed here
            if missing.name != module:
                raise
    sys.path.insert(0, script_folder)       # replaced in each child

    def answer(**message):
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    children = {}       # pid: request id
    pending = b""
    reading = True
    while reading or children:
        if reading and select.select([0], [], [], 0.05)[0]:
            chunk = os.read(0, 1 << 16)
            reading = bool(chunk)
            if not reading:
                for pid in children:
                    os.kill(pid, signal.SIGKILL)
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = request["id"]
                answer(id=request["id"], pid=pid)
        elif not reading:
            time.sleep(0.05)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
            answer(id=children.pop(pid), exit=code)


# The client's side.

class Forked:
    """A forked child, as `subprocess.Popen` shows one: pid, poll, wait, kill, communicate."""

    def __init__(self, args, outputs):
        self.args = args
        self.pid = None
        self.returncode = None
        self._outputs = outputs     # {"stdout"/"stderr": a temporary path for PIPE, or None}
        self._started = threading.Event()
        self._ended = threading.Event()

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, signum):
        if self.returncode is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:      # it ended meanwhile
                pass

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout=None):
        """(stdout, stderr) of what went to PIPE, else None; raises TimeoutExpired as Popen does."""
        self.wait(timeout)
        texts = []
        for name in ("stdout", "stderr"):
            path = self._outputs.get(name)
            if path is None:
                texts.append(None)
                continue
            with open(path, encoding="utf-8", errors="replace") as read:
                texts.append(read.read())
            os.remove(path)
            self._outputs[name] = None
        return tuple(texts)


class _Server:
    def __init__(self, executable, env, preload):
        self.log = tempfile.NamedTemporaryFile("w", prefix="fork_server.", suffix=".log", delete=False)
        self.process = subprocess.Popen([executable, SERVER, *preload], env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True,
                                        start_new_session=True)
        self.lock = threading.Lock()
        self.waiting = {}       # request id: Forked
        self.next_id = 0
        threading.Thread(target=self._read_answers, daemon=True).start()

    def start(self, forked, request):
        with self.lock:
            if self.process.poll() is not None:
                raise RuntimeError(f"the fork server ended (exit {self.process.returncode}): see {self.log.name}")
            request["id"] = self.next_id
            self.next_id += 1
            self.waiting[request["id"]] = forked
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
        if not forked._started.wait(600) or forked.pid is None:
            raise RuntimeError(f"the fork server did not start {forked.args!r}: see {self.log.name}")

    def _read_answers(self):
        for line in self.process.stdout:
            message = json.loads(line)
            forked = self.waiting[message["id"]]
            if "pid" in message:
                forked.pid = message["pid"]
                forked._started.set()
            else:
                forked.returncode = message["exit"]
                del self.waiting[message["id"]]
                forked._ended.set()
        for forked in list(self.waiting.values()):      # the server ended: none of them will be answered
            forked._started.set()
            forked.returncode = forked.returncode if forked.returncode is not None else -signal.SIGKILL
            forked._ended.set()

    def close(self):
        self.process.stdin.close()      # it kills what still runs, and ends
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()
        os.remove(self.log.name)


_servers = {}
_servers_lock = threading.Lock()


def _server(env, slot, preload):
    key = (tuple((name, env.get(name)) for name in STARTUP), slot, tuple(preload))
    with _servers_lock:
        if key not in _servers:
            _servers[key] = _Server(sys.executable, env, preload)
        return _servers[key]


@atexit.register
def close_servers():
    with _servers_lock:
        for server in _servers.values():
            server.close()
        _servers.clear()


def _path(target, name):
    """A path for the child's `name` stream, and the temporary path to read it back from, if a pipe."""
    if target == subprocess.PIPE:
        handle, path = tempfile.mkstemp(prefix=f"forked.{name}.")
        os.close(handle)
        return path, path
    if target == subprocess.DEVNULL:
        return os.devnull, None
    if target == subprocess.STDOUT and name == "stderr":
        return "stdout", None
    if isinstance(target, (str, os.PathLike)):
        return os.fspath(target), None
    if hasattr(target, "name") and isinstance(target.name, str) and os.path.exists(target.name):
        target.flush()
        return target.name, None
    raise ValueError(f"{name}: PIPE, DEVNULL, a path or an open file with a name, not {target!r}")


def popen(args, *, env=None, cwd=None, stdout=subprocess.PIPE, stderr=subprocess.PIPE, slot=0, preload=None):
    """`subprocess.Popen(args, ...)` for `args` = [sys.executable, "-m"/"-c"/script, ...], forked
    (its stdin: /dev/null).

    `slot`: which of the servers with the same start-up environment forks it (the
    processes of one cluster take one each: their hash seeds differ). `preload`: the
    modules imported before the fork (by default `PRELOAD`; Keras is `tf_keras` where
    `TF_USE_LEGACY_KERAS` is set, as `tf.keras` would be).
    """
    args = [os.fspath(a) for a in args]
    if args[0] != sys.executable or len(args) < 2 or args[1].startswith("-") and args[1] not in ("-m", "-c"):
        raise ValueError(f"args: [sys.executable, '-m' module | '-c' code | script, ...], not {args[:2]!r}")
    env = dict(os.environ if env is None else env)
    paths, outputs = {}, {}
    for name, target in (("stdout", stdout), ("stderr", stderr)):
        paths[name], outputs[name] = _path(target, name)
    forked = Forked(args, outputs)
    request = dict(argv=args[1:], cwd=os.path.abspath(cwd or os.getcwd()), env=env, **paths)
    legacy = env.get("TF_USE_LEGACY_KERAS", "").lower() in ("1", "true")
    preload = tuple("tf_keras" if legacy and module == "keras" else module for module in preload or PRELOAD)
    _server(env, slot, preload).start(forked, request)
    return forked


def run(args, *, env=None, cwd=None, capture_output=False, stdout=None, stderr=None, timeout=None,
        check=False, text=True, slot=0, preload=None):
    """`subprocess.run(args, ..., text=True)`, forked (`popen`); output not captured goes nowhere."""
    if not text:
        raise ValueError("text: True (the output is read back as text)")
    if capture_output:
        stdout = stderr = subprocess.PIPE
    forked = popen(args, env=env, cwd=cwd, stdout=subprocess.DEVNULL if stdout is None else stdout,
                   stderr=subprocess.DEVNULL if stderr is None else stderr, slot=slot, preload=preload)
    try:
        out, err = forked.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        forked.kill()
        out, err = forked.communicate()
        raise subprocess.TimeoutExpired(args, timeout, output=out, stderr=err)
    done = subprocess.CompletedProcess(args, forked.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    serve(sys.argv[1:] or PRELOAD)
