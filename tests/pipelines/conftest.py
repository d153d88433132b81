"""Fixtures the pipelines' tests share."""

import pytest
from absl import flags


@pytest.fixture
def command_line():
    """Parses a command line into absl's flags for the test; restores them after."""
    yield lambda *arguments: flags.FLAGS(["run_local", *arguments])
    flags.FLAGS.unparse_flags()
