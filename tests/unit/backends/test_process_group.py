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


# ------------------------------------------------------------- GPU placement (fakes: CI has no GPU)
import datetime  # noqa: E402

import torch  # noqa: E402

from unified_dist.backends import process_group  # noqa: E402
from unified_dist.errors import LaunchError  # noqa: E402


@pytest.fixture
def gpus(monkeypatch):
    """Pretend this host has ``n`` CUDA devices; returns a setter."""
    def set_count(n):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return set_count


@pytest.mark.parametrize("env, count, expected", [
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}, 2, 1),
    ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "4"}, 8, 3),
    # a launcher that gives each process its own CUDA_VISIBLE_DEVICES: one visible GPU, local rank 1
    ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "CUDA_VISIBLE_DEVICES": "1"}, 1, 0),
    ({}, 1, 0),
])
def test_cuda_device_for_group(gpus, env, count, expected):
    gpus(count)
    assert process_group.cuda_device_for_group(env) == torch.device("cuda", expected)


def test_more_processes_than_gpus_is_a_launch_error(gpus):
    # seen on an H100 machine: torchrun --nproc_per_node 2 with one GPU died with
    # "CUDA error: invalid device ordinal" on rank 1 before this check
    gpus(1)
    with pytest.raises(LaunchError, match=r"2 processes on this host but 1 visible GPU.*--nproc_per_node 1"):
        process_group.cuda_device_for_group({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})


def test_nccl_group_is_bound_to_the_local_gpu(gpus, monkeypatch):
    gpus(2)
    calls = {}
    monkeypatch.setattr(process_group.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(process_group.dist, "init_process_group", lambda **kw: calls.update(kw))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.update(set_device=d))
    for key, value in {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert process_group.join_default_group(datetime.timedelta(seconds=5), always=True)
    assert calls["backend"] == "nccl"
    assert calls["device_id"] == calls["set_device"] == torch.device("cuda", 1)
