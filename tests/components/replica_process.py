"""One replica of a training cluster: TFX's `run_executor`, as a Vertex AI
worker pool's container runs it (`python -m tfx.scripts.run_executor ...`).

For the preemption tests, `DIE_AFTER_STEPS=n` makes the process SIGKILL itself
after its n-th `fit` step (a callback added to every Keras 3 and Keras 2 `fit`, so
the module file stays unchanged): a preempted machine, mid-window.
"""

import functools
import inspect
import os
import signal
import sys


def _die_after(steps):
    import importlib.util

    import keras

    seen = [0]      # over every fit call of the process

    def patch(package):
        class Die(package.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                seen[0] += 1
                if seen[0] == steps:
                    os.kill(os.getpid(), signal.SIGKILL)

        original = package.Model.fit
        signature = inspect.signature(inspect.unwrap(original))

        @functools.wraps(original)
        def fit(self, *args, **kwargs):
            bound = signature.bind(self, *args, **kwargs)
            bound.arguments["callbacks"] = list(bound.arguments.get("callbacks") or []) + [Die()]
            return original(*bound.args, **bound.kwargs)

        package.Model.fit = fit

    patch(keras)
    if importlib.util.find_spec("tf_keras") is not None:        # Keras 2 models too
        import tf_keras
        patch(tf_keras)


def main():
    if int(os.environ.get("DIE_AFTER_STEPS", "0")):
        _die_after(int(os.environ["DIE_AFTER_STEPS"]))
    from absl import app
    from tfx.scripts import run_executor

    sys.argv[0] = run_executor.__file__
    app.run(run_executor.main, flags_parser=run_executor.parse_flags)


if __name__ == "__main__":
    main()
