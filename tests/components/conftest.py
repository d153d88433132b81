"""Fixtures the Trainer's tests share: the regression examples the test module file reads."""

import pytest

from tests.components import fixtures


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """384 training and 64 evaluation examples (`fixtures.write_examples`), written once per
    test module; a module that trains on other data (interactions) defines its own."""
    return fixtures.write_examples(str(tmp_path_factory.mktemp("examples")))
