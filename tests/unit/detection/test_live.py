"""Adopting a stack the process started itself (unified_dist/detection/live.py), and ud.launch's error choice.

In process: a real one-rank gloo group joined with ``file://`` (any init method counts), and
fake Horovod/Accelerate modules for the probe's order. The multi-process versions run under the
real launchers and mp.spawn in test_contract_under_launchers.py and test_launch_from_python.py.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
import types

import pytest
import torch
import torch.distributed as dist

import unified_dist as ud
from unified_dist import spawn
from unified_dist.detection import LAUNCHER_VARIABLE_PREFIXES, TORCH_VARIABLES, Live, live as live


@pytest.fixture
def clean_env(monkeypatch):
    for key in list(os.environ):
        if key.startswith(LAUNCHER_VARIABLE_PREFIXES) or key in TORCH_VARIABLES:
            monkeypatch.delenv(key)
    yield
    ud.shutdown()


def test_nothing_running_is_none(clean_env):
    assert live.probe() is None


def test_a_group_joined_with_file_init_is_adopted_and_left_running(clean_env, tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        assert live.probe() == Live("torch", 1, 0, None)
        ud.init()
        assert (ud.backend_name(), ud.launcher(), ud.world_size(), ud.local_rank()) == ("torch", "existing", 1, 0)
        assert ud.all_reduce(torch.ones(2), "sum").tolist() == [1.0, 1.0]
        ud.shutdown()
        assert dist.is_initialized(), "ud.shutdown() destroyed a group it did not create"
    finally:
        dist.destroy_process_group()


def test_a_one_process_session_refuses_a_group_started_after_it(clean_env, tmp_path):
    """A ud call before init_process_group started one process; once the group exists, the next ud call
    (init or any other) is refused in one line instead of answering for this rank alone; after
    ud.shutdown() the group is adopted."""
    assert ud.world_size() == 1 and ud.backend_name() == "single"
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        for call in (ud.init, lambda: ud.all_reduce(torch.ones(2), "sum"), ud.is_main):
            with pytest.raises(ud.UnifiedDistError, match=r"started as one process .* torch was initialised after "
                               r"it with 1 process\(es\); call ud.init\(\) after torch's init") as caught:
                call()
            assert "\n" not in str(caught.value)
        ud.shutdown()
        ud.init()
        assert ud.backend_name() == "torch"
        assert isinstance(ud.prepare(torch.nn.Linear(2, 2)), torch.nn.parallel.DistributedDataParallel)
        ud.shutdown()
    finally:
        dist.destroy_process_group()


def test_probe_order_horovod_then_accelerate_then_torch(clean_env, monkeypatch):
    hvd = types.SimpleNamespace(is_initialized=lambda: True, size=lambda: 4, rank=lambda: 2, local_rank=lambda: 0)
    state = types.SimpleNamespace(num_processes=3, process_index=1, local_process_index=1)
    partial = type("PartialState", (), {"_shared_state": {"x": 1}, "__new__": lambda cls: state})
    monkeypatch.setitem(sys.modules, "accelerate.state", types.SimpleNamespace(PartialState=partial))
    assert live.probe() == Live("accelerate", 3, 1, 1)
    monkeypatch.setitem(sys.modules, "horovod.torch", hvd)
    assert live.probe() == Live("horovod", 4, 2, 0)
    hvd.is_initialized = lambda: False
    partial._shared_state = {}
    assert live.probe() is None


def _error_file(directory, rank, summary, secondary):
    path = directory / f"error-{rank}.pkl"
    path.write_bytes(pickle.dumps((summary, f"Traceback ...\n{summary}\n", secondary)))
    written = len(list(directory.glob("error-*.pkl")))  # distinct modification times, in the order written,
    os.utime(path, (time.time(), 1_700_000_000 + written))  # whatever the file system's clock resolution


def test_launch_reports_the_root_cause_not_a_peers_reaction(tmp_path):
    _error_file(tmp_path, 0, "PeerLost: rank 1 is gone", True)  # written first, but only a reaction
    _error_file(tmp_path, 1, "ValueError: bad", False)
    _error_file(tmp_path, 2, "KeyError: 'x'", False)
    failure = spawn._failure(tmp_path, RuntimeError("process 0 exited with 1"))
    assert failure.rank == 1 and str(failure) == "rank 1 raised ValueError: bad"
    assert "ValueError: bad" in failure.remote_traceback


def test_launch_reports_a_worker_that_died_without_raising(tmp_path):
    failure = spawn._failure(tmp_path, RuntimeError("process 1 terminated with signal SIGKILL\nmore"))
    assert failure.rank is None and "SIGKILL" in str(failure) and "\n" not in str(failure)
    assert spawn._failure(tmp_path, None) is None


@pytest.fixture
def accelerate_reset():
    yield
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def test_a_users_accelerator_is_adopted_with_its_precision(clean_env, accelerate_reset):
    from accelerate import Accelerator
    from accelerate.state import PartialState

    Accelerator(cpu=True, mixed_precision="bf16")
    ud.init()
    assert ((ud.backend_name(), ud.launcher(), ud.world_size(), ud.mixed_precision())
            == ("accelerate", "existing", 1, "bf16"))
    ud.shutdown()
    assert PartialState._shared_state, "ud.shutdown() reset an Accelerate state it did not create"


def test_asking_a_running_accelerator_for_another_precision_is_one_line(clean_env, accelerate_reset):
    from accelerate import Accelerator

    Accelerator(cpu=True)
    with pytest.raises(ud.UnifiedDistError,
                       match="already runs in this process and Accelerate cannot change it") as info:
        ud.init(mixed_precision="bf16")
    assert "\n" not in str(info.value)
