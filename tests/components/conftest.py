"""Fixtures the Trainer's tests share: the regression examples the test module file reads."""

import pytest

from tests.components import fixtures


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """384 training and 64 evaluation examples (`fixtures.write_examples`), written once per
    test module; a module that trains on other data (interactions) defines its own."""
    return fixtures.write_examples(str(tmp_path_factory.mktemp("examples")))


@pytest.fixture(scope="session")
def stock_regression(tmp_path_factory):
    """The stock Trainer on the test module file at its batch of 32, 6 steps, over
    `write_examples`' data (written the same, from a fixed seed, for every test module):
    (outputs, seen, weights), run once for the test files that compare with it."""
    examples = fixtures.write_examples(str(tmp_path_factory.mktemp("stock_examples")))
    return fixtures.run_executor(tmp_path_factory.mktemp("stock_regression"), examples, num_steps=6, stock=True)
