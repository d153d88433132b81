"""Tests against independent references; see tests/conftest.py for the session set-up."""

import os


def child_pythonpath(root):
    """PYTHONPATH for a test's child process: the repository first, then the parent's own
    entries (where TensorFlow itself comes from a PYTHONPATH, as on the GPU kit)."""
    return os.pathsep.join(str(p) for p in (root, os.environ.get("PYTHONPATH")) if p)
