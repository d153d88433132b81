"""Runs a 2-worker MultiWorkerMirroredStrategy cluster on 127.0.0.1 for a test.

Each worker is forked by a server of its own (`tests/fork_server.py`, slot = its index):
TensorFlow's import is paid once per server, not once per worker, and the workers'
hash seeds differ as fresh processes' would.
"""

import json
import os
import subprocess
import sys

import numpy as np
import portpicker

from tests import fork_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = 2


def start_cluster(out, *args, module="tests.accumulator.multiworker_worker"):
    ports = [portpicker.pick_unused_port() for _ in range(WORKERS)]
    cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
    procs = []
    for index in range(WORKERS):
        env = dict(
            os.environ,
            TF_CPP_MIN_LOG_LEVEL="3",
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
        )
        procs.append(fork_server.popen(
            [sys.executable, "-m", module, "--out", str(out), *map(str, args)],
            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, slot=index,
        ))
    return procs


def run_cluster(out, *args, timeout=300, module="tests.accumulator.multiworker_worker"):
    """Returns (exit codes, combined output, chief's weights or None); `module` is the
    worker's program (it writes `load_result`'s file)."""
    procs = start_cluster(out, *args, module=module)
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
    codes = [p.returncode for p in procs]
    return codes, "\n".join(outputs), load_result(out, 0)


def load_result(out, index):
    path = f"{out}.{index}.npz"
    if not os.path.exists(path):
        return None
    data = np.load(path)
    weights = [data[f"w{i}"] for i in range(len([k for k in data.files if k.startswith("w")]))]
    return weights, int(data["iterations"])
