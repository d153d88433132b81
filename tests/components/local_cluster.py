"""A training cluster on 127.0.0.1, as Vertex AI runs one for the Trainer.

Each replica runs the container command that TFX's Vertex client generates for
the worker pools (`training_clients...generate_container_command`: run_executor
with the serialized inputs, outputs and exec_properties), with the TF_CONFIG
Vertex sets: pool 0 is the chief, pool 1 the workers. `run_custom_job` plays
Vertex for `tfx_gradient_accumulator.components.cloud.VertexExecutor`: it runs a CustomJob's pools here.

Each replica is forked by a server of its own (`tests/fork_server.py`, slot = its
index) that has imported TensorFlow, Keras and TFX's `run_executor` (about 15 s of CPU
a replica would spend on them); this library is imported by the replica itself.
"""

import json
import os
import subprocess
import sys
import time

import portpicker
from tfx.extensions.google_cloud_ai_platform import training_clients

from tests import fork_server

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXECUTOR = "tfx_gradient_accumulator.components.executor.Executor"
PRELOAD = (*fork_server.PRELOAD, "tfx.scripts.run_executor")


def container_command(inputs, outputs, properties, executor=EXECUTOR):
    """What TFX puts in each worker pool's `container_spec.command`."""
    return training_clients.VertexJobClient.generate_container_command(None, inputs, outputs, properties, executor)


def start(command, workers, tmp, env=None):
    """Starts `workers` replicas of `command` (chief first); returns them (`fork_server.Forked`).

    `env`: {replica index: extra environment} (a value None unsets the variable). Each replica's TMPDIR is its own
    folder under `tmp`, so a test can see what it leaves there. Output goes to
    files beside it (`replica<i>.out`, `.err`): a pipe nobody reads while the
    others run fills up and blocks its writer, and then its peers wait on it.
    """
    assert command[:3] == ["python", "-m", "tfx.scripts.run_executor"], command[:3]
    ports = [portpicker.pick_unused_port() for _ in range(workers)]
    cluster = {"chief": [f"127.0.0.1:{ports[0]}"]}
    if workers > 1:
        cluster["worker"] = [f"127.0.0.1:{p}" for p in ports[1:]]
    procs = []
    for index in range(workers):
        task = {"type": "chief", "index": 0} if index == 0 else {"type": "worker", "index": index - 1}
        tmpdir = os.path.join(str(tmp), f"replica{index}")
        os.makedirs(tmpdir, exist_ok=True)
        replica_env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TMPDIR=tmpdir, PYTHONPATH=ROOT,
                           TF_CONFIG=json.dumps({"cluster": cluster, "task": task, "environment": "cloud"}))
        for name, value in ((env or {}).get(index) or {}).items():     # None: not set
            replica_env.pop(name, None) if value is None else replica_env.__setitem__(name, str(value))
        with open(f"{tmpdir}.out", "w") as out, open(f"{tmpdir}.err", "w") as err:
            proc = fork_server.popen(
                [sys.executable, "-m", "tests.components.replica_process", *command[3:], "--write-outputs-stdout"],
                env=replica_env, cwd=ROOT, stdout=out, stderr=err, slot=index, preload=PRELOAD)
        proc.logs = tmpdir
        procs.append(proc)
    return procs


def wait(procs, timeout=600):
    """[(returncode, stdout, stderr)] once all have ended; kills them all at `timeout`."""
    deadline = time.time() + timeout
    results = []
    for proc in procs:
        try:
            proc.wait(timeout=max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        with open(f"{proc.logs}.out") as out, open(f"{proc.logs}.err") as err:
            results.append((proc.returncode, out.read(), err.read()))
    return results


def run(command, workers, tmp, env=None, timeout=600):
    return wait(start(command, workers, tmp, env), timeout)


def published(stdout):
    """The output artifacts a replica's executor ended with (run_executor's last stdout line)."""
    from tfx.types import artifact_utils
    return artifact_utils.parse_artifact_dict(stdout.strip().splitlines()[-1])


def custom_properties(artifact):
    """What the executor recorded on `artifact` (its ML Metadata custom properties), by name."""
    return {name: getattr(value, value.WhichOneof("value"))
            for name, value in artifact.mlmd_artifact.custom_properties.items()}


def run_custom_job(training_job, tmp, timeout=600):
    """Runs a Vertex CustomJob's worker pools here, as Vertex would; raises as
    TFX's launcher does when the job fails."""
    pools = training_job["job_spec"]["worker_pool_specs"]
    commands = [pool["container_spec"]["command"] for pool in pools]
    assert all(c == commands[0] for c in commands), "every pool runs the same executor"
    workers = sum(pool.get("replica_count", 1) for pool in pools)
    results = run(commands[0], workers, tmp, timeout=timeout)
    failed = [i for i, (code, _, _) in enumerate(results) if code != 0]
    if failed:
        raise RuntimeError(f"Job failed: replicas {failed}: " + results[failed[0]][2][-2000:])
    return results
