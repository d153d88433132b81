"""`make bench`: see benchmarks/run.py."""

import os


def child_pythonpath(root):
    """PYTHONPATH for a measuring child process: the repository first, then the parent's
    own entries (where TensorFlow itself comes from a PYTHONPATH, as on the GPU kit)."""
    return os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
