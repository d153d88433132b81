"""Runs docs blocks in processes forked from one that has imported TensorFlow and Keras.

`tests/test_docs.py` runs each python block of the docs in a process of its own. Most
blocks start with `import tensorflow` or `import keras`: about 9 s of CPU each. This
server (`python tests/docs_block.py`, started with a block's environment) imports
both once (`PRELOAD`) and forks a process per block: the block starts with them
imported and nothing else, no Keras model, no TensorFlow device or eager context
(importing initialises neither), none of this library's hooks (a block that imports
the library installs them in its own process, as a user's program does).

The protocol, a line of JSON each way: the test writes {"script", "cwd", "env",
"stdout", "stderr"}; the server answers {"pid"} when the block's process has started
and {"exit"} when it has ended (negative: killed by that signal; the test kills a
block that runs past its time). One block at a time per server.
"""

import atexit
import json
import os
import runpy
import sys
import traceback

PRELOAD = ("numpy", "tensorflow", "keras")


def _run_block(request):
    """In the forked child: `python script` in `cwd` with `env`, output into the two files."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    sys.stdin = open(os.devnull)
    sys.argv = [request["script"]]
    sys.path[0] = os.path.dirname(request["script"])    # as `python script` puts it
    code = 0
    try:
        runpy.run_path(request["script"], run_name="__main__")
    except SystemExit as done:        # as the interpreter reads it: None 0, a number, else printed and 1
        if done.code is None or isinstance(done.code, int):
            code = done.code or 0
        else:
            print(done.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve():
    answers = os.fdopen(os.dup(1), "w")     # the answers' own descriptor: whatever an import
    os.dup2(2, 1)                            # prints to stdout goes to stderr, not into them
    requests = sys.stdin
    for module in PRELOAD:
        __import__(module)
    for line in requests:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_block(request)
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        status = os.waitpid(pid, 0)[1]
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        answers.write(json.dumps({"exit": code}) + "\n")
        answers.flush()


if __name__ == "__main__":
    serve()
