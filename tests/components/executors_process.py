"""Several Trainer executions in one process, one after the other, each as TFX's
`run_executor` runs it (`python -m tfx.scripts.run_executor ...`: its flags, its
parsing, its executor context), the Keras session cleared between them.

`python -m tests.components.executors_process COMMANDS.json`, where the file holds a
list of container commands (`local_cluster.container_command`); the last line of
stdout is the last execution's output artifacts (`--write-outputs-stdout`).

Why one process: a Keras 2 module's first `fit` spends much of its time converting
Keras' and the module's Python code with AutoGraph; a second execution in the same
process reuses those conversions, and the imports (TFX's taxi module: 168 s of CPU for
both runs, against 203 s in a process each).
"""

import json
import sys


def _executions(argv):
    from tfx.scripts import run_executor

    with open(argv[1]) as f:
        commands = json.load(f)
    for index, command in enumerate(commands):
        assert command[:3] == ["python", "-m", "tfx.scripts.run_executor"], command[:3]
        if index:
            import tensorflow as tf
            tf.keras.backend.clear_session()        # the next model's layers are named as in a fresh process
        flags = command[3:] + (["--write-outputs-stdout"] if index == len(commands) - 1 else [])
        args, beam_args = run_executor.parse_flags([run_executor.__file__, *flags])
        run_executor._run_executor(args, beam_args)
        sys.stdout.flush()


def main():
    from absl import app

    app.run(_executions)


if __name__ == "__main__":
    main()
