"""Resolving accumulation settings: hyperparameters, then parameters, then defaults."""

import pytest

from components.settings import resolve


def test_defaults():
    s = resolve(None, None, None, replicas=1)
    assert (s.accum_steps, s.effective_batch_size, s.micro_batch, s.partial_window) == (1, None, None, "apply")
    assert s.sources == {"accum_steps": "default", "effective_batch_size": "default"}


def test_precedence():
    hp = {"space": [], "values": {"accum_steps": 8, "learning_rate": 0.1}}
    s = resolve(hp, 2, 64, replicas=2)
    assert (s.accum_steps, s.effective_batch_size, s.micro_batch, s.micro_batch_per_replica) == (8, 64, 8, 4)
    assert s.sources == {"accum_steps": "hyperparameters", "effective_batch_size": "component parameter"}
    assert s.as_properties() == {"accum_steps": 8, "micro_batch_size": 8, "replicas": 2, "effective_batch_size": 64}


@pytest.mark.parametrize(
    "hp, accum, effective, replicas, message",
    [
        (None, 0, None, 1, "accum_steps"),
        ({"values": {"accum_steps": "4"}}, None, None, 1, "accum_steps"),
        (None, 4, 0, 1, "effective_batch_size"),
        (None, 4, 32, 3, r"4\) x replicas \(3\) = 12"),
        ({"values": {"effective_batch_size": 30}}, 4, 64, 1, "from hyperparameters"),
    ],
)
def test_errors_name_the_value_and_its_source(hp, accum, effective, replicas, message):
    with pytest.raises((ValueError, TypeError), match=message):
        resolve(hp, accum, effective, replicas)


def test_partial_window_is_one_of_the_modes():
    assert resolve(None, 2, None, replicas=1, partial_window="drop").partial_window == "drop"
    with pytest.raises(ValueError, match=r"`partial_window` must be one of \('apply', 'carry', 'drop'\)"):
        resolve(None, 2, None, replicas=1, partial_window="flush")
