"""When a restarted torchelastic worker must join through a per-attempt store."""
import pytest

from unified_dist.backends.process_group import needs_attempt_store, restart_count


@pytest.mark.parametrize("env, expected", [
    ({}, False),                                                              # plain python
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}, False),  # first attempt
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "2"}, True),   # static rdzv restart
    ({"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"}, False),  # own store per rank 0
    ({"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "x"}, False),
])
def test_needs_attempt_store(env, expected):
    assert needs_attempt_store(env) is expected


def test_restart_count_defaults_to_zero():
    assert restart_count({}) == 0 and restart_count({"TORCHELASTIC_RESTART_COUNT": "3"}) == 3
