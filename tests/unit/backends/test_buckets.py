"""One bucket-size setting for every stack (unified_dist.backends.buckets): what it resolves to, what DDP
and Horovod get, and the refusals. Under the real launchers, the contract's accum suite is launched
with UNIFIED_DIST_BUCKET_MB=0.25 and asserts the bucket cap (262,144 bytes) and bucket count of the
DDP that torch's backend and Accelerate built, and Horovod's HOROVOD_FUSION_THRESHOLD
(tests/launchers/test_contract_under_launchers.py -k accum-bucket); bench/network/network.py's tuning rows time them."""
import os

import pytest

from unified_dist.backends.buckets import CPU_CYCLE_MS, HOROVOD_CYCLE_VAR, HOROVOD_VAR, ddp_kwargs, horovod_env
from unified_dist.errors import UnifiedDistError
from unified_dist.settings import TABLE, resolve

ENV_VAR, VIEW_ENV = TABLE["bucket_mb"].variable, TABLE["bucket_view"].variable


def resolve_bucket_mb(given, env):
    return resolve("bucket_mb", given, env)


def resolve_bucket_view(env):
    return resolve("bucket_view", None, env)


def test_explicit_beats_the_variable_and_none_keeps_the_stacks_default():
    assert resolve_bucket_mb(None, {}) is None
    assert resolve_bucket_mb(None, {ENV_VAR: " "}) is None
    assert resolve_bucket_mb(None, {ENV_VAR: "4"}) == 4.0
    assert resolve_bucket_mb(8, {ENV_VAR: "4"}) == 8.0
    assert ddp_kwargs(None) == {"gradient_as_bucket_view": True}
    assert ddp_kwargs(2.5) == {"gradient_as_bucket_view": True, "bucket_cap_mb": 2.5}


def test_bucket_views_are_on_unless_the_variable_turns_them_off():
    assert resolve_bucket_view({}) is True and resolve_bucket_view({VIEW_ENV: "1"}) is True
    assert resolve_bucket_view({VIEW_ENV: "0"}) is False and resolve_bucket_view({VIEW_ENV: " off "}) is False
    assert ddp_kwargs(None, False) == {"gradient_as_bucket_view": False}


@pytest.mark.parametrize("bad", ["many", "0", "-1", "nan"])
def test_a_bad_size_is_one_line(bad):
    with pytest.raises(UnifiedDistError) as info:
        resolve_bucket_mb(None, {ENV_VAR: bad})
    assert "MiB" in str(info.value) and "\n" not in str(info.value)


def test_horovod_gets_its_fusion_buffer_in_bytes_and_a_contradiction_is_refused():
    assert horovod_env(None, {HOROVOD_VAR: "123"}) == {}
    assert horovod_env(4, {}) == {HOROVOD_VAR: str(4 * 2 ** 20)}
    assert horovod_env(4, {HOROVOD_VAR: str(4 * 2 ** 20)}) == {HOROVOD_VAR: str(4 * 2 ** 20)}
    with pytest.raises(UnifiedDistError, match="fusion-threshold-mb"):
        horovod_env(4, {HOROVOD_VAR: "67108864"})


def test_horovod_cycles_slower_on_cpu_hosts_unless_the_user_set_a_cycle():
    cycle = {HOROVOD_CYCLE_VAR: str(CPU_CYCLE_MS)}
    assert horovod_env(None, {}, on_cpu=True) == cycle
    assert horovod_env(4, {}, on_cpu=True) == {**cycle, HOROVOD_VAR: str(4 * 2 ** 20)}
    assert horovod_env(None, {HOROVOD_CYCLE_VAR: "1"}, on_cpu=True) == {}  # horovodrun --cycle-time-ms 1 wins
    assert horovod_env(None, {HOROVOD_CYCLE_VAR: " "}, on_cpu=True) == cycle
    assert horovod_env(None, {}, on_cpu=False) == {}  # GPU hosts keep Horovod's own 1 ms


@pytest.mark.parametrize("cuda, users_own_init, cycle", [(False, False, str(CPU_CYCLE_MS)), (True, False, None),
                                                          (False, True, None)])
def test_horovod_backend_sets_the_cycle_before_its_own_init_on_cpu_hosts_only(monkeypatch, cuda, users_own_init,
                                                                             cycle):
    """What ``hvd.init()`` sees: the CPU cycle on CPU hosts; nothing on GPU hosts or where the user's
    own ``hvd.init()`` already ran (that Horovod keeps its cycle)."""
    import types

    import torch

    from unified_dist.backends import horovod_backend
    from unified_dist.backends.base import Config
    from unified_dist.detection import Detection

    seen = {}
    fake = types.SimpleNamespace(Compression=types.SimpleNamespace(none=None, fp16=None),
                                 is_initialized=lambda: users_own_init, local_rank=lambda: 0,
                                 init=lambda: seen.setdefault("cycle", os.environ.get(HOROVOD_CYCLE_VAR)))
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != HOROVOD_CYCLE_VAR})  # not leaked
    monkeypatch.setattr(horovod_backend, "_import_horovod", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    horovod_backend.HorovodBackend(Detection(backend="horovod", launcher="horovodrun", reason="test"), Config())
    assert seen == {"cycle": cycle}


def test_torch_backend_builds_ddp_with_the_bucket_size(monkeypatch):
    import torch

    from unified_dist.backends.base import Config
    from unified_dist.backends.torch_ddp import TorchBackend

    seen = {}

    class FakeDDP(torch.nn.Module):
        def __init__(self, module, **kwargs):
            super().__init__()
            self.module = module
            seen.update(kwargs)

    backend = TorchBackend.__new__(TorchBackend)
    backend.config = Config(bucket_mb=3.0)
    backend._fsdp = type("NoFsdp", (), {"enabled": False})()
    backend._ddp = type("Tracker", (), {"track": staticmethod(lambda m: m)})()
    monkeypatch.setattr(TorchBackend, "device", torch.device("cpu"))
    monkeypatch.setattr(torch.nn.parallel, "DistributedDataParallel", FakeDDP)
    monkeypatch.setattr(TorchBackend, "apply_compression", lambda self, m: m)
    backend.prepare_model(torch.nn.Linear(2, 2))
    assert seen["bucket_cap_mb"] == 3.0


def test_launch_passes_the_size_to_the_script_as_the_variable():
    from unified_dist.cli.launch import Plan, build

    command = build(Plan(backend="torch", script="train.py", nproc=2, settings={"bucket_mb": 4.0}), cuda=False)
    assert command.env[ENV_VAR] == "4"


@pytest.mark.parametrize("switch, views", [(None, True), ("1", True), ("0", False)])
def test_ddp_gradients_are_bucket_views_unless_switched_off(monkeypatch, tmp_path, switch, views):
    """In process, through the facade (a one-rank gloo group it adopts): DDP's gradients share their
    bucket's storage (one bucket for this small model), or own one each with the switch off."""
    import torch
    import torch.distributed as dist

    import unified_dist as ud
    from unified_dist.detection import LAUNCHER_VARIABLE_PREFIXES, TORCH_VARIABLES

    for key in list(os.environ):
        if key.startswith(LAUNCHER_VARIABLE_PREFIXES) or key in TORCH_VARIABLES:
            monkeypatch.delenv(key)
    monkeypatch.delenv(VIEW_ENV, raising=False)
    if switch is not None:
        monkeypatch.setenv(VIEW_ENV, switch)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        ud.init()
        model = ud.prepare(torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)))
        assert isinstance(model, torch.nn.parallel.DistributedDataParallel)
        ud.backward(model(torch.ones(3, 5)).sum())
        storages = {p.grad.untyped_storage().data_ptr() for p in ud.unwrap(model).parameters()}
        assert len(storages) == (1 if views else 4), storages
    finally:
        ud.shutdown()
        dist.destroy_process_group()


def test_horovod_backend_sets_the_fusion_buffer_before_its_init_and_refuses_a_contradiction(monkeypatch):
    """docs/multinode.md (On a slow network): bucket_mb becomes Horovod's HOROVOD_FUSION_THRESHOLD (bytes)
    before hvd.init; a different
    value already set there is refused, before init."""
    import types

    import torch

    from unified_dist.backends import horovod_backend
    from unified_dist.backends.base import Config
    from unified_dist.detection import Detection
    seen = []
    fake = types.SimpleNamespace(Compression=types.SimpleNamespace(none=None, fp16=None),
                                 is_initialized=lambda: False, local_rank=lambda: 0,
                                 init=lambda: seen.append(os.environ.get("HOROVOD_FUSION_THRESHOLD")))
    monkeypatch.setattr(horovod_backend, "_import_horovod", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    detection = Detection(backend="horovod", launcher="horovodrun", reason="test")
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    horovod_backend.HorovodBackend(detection, Config(bucket_mb=4.0))
    assert seen == [str(4 * 2 ** 20)]
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(64 * 2 ** 20))
    with pytest.raises(UnifiedDistError, match="fusion-threshold-mb"):
        horovod_backend.HorovodBackend(detection, Config(bucket_mb=4.0))
    assert len(seen) == 1


def test_bucket_mb_for_a_horovod_the_user_started_is_refused_unless_it_already_has_that_size(monkeypatch):
    """Horovod reads its fusion buffer at hvd.init(): when the user's code ran hvd.init() before the facade,
    bucket_mb can no longer reach it, so it is refused (not silently ignored), unless the variable the
    user's init read already says the same size."""
    import types

    import torch

    from unified_dist.backends import horovod_backend
    from unified_dist.backends.base import Config
    from unified_dist.detection import Detection
    inits = []
    fake = types.SimpleNamespace(Compression=types.SimpleNamespace(none=None, fp16=None),
                                 is_initialized=lambda: True, local_rank=lambda: 0, init=lambda: inits.append(1))
    monkeypatch.setattr(horovod_backend, "_import_horovod", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    detection = Detection(backend="horovod", launcher="horovodrun", reason="test")
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    with pytest.raises(UnifiedDistError, match=r"set HOROVOD_FUSION_THRESHOLD=4194304 before hvd.init\(\)"):
        horovod_backend.HorovodBackend(detection, Config(bucket_mb=4.0))
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", str(4 * 2 ** 20))
    horovod_backend.HorovodBackend(detection, Config(bucket_mb=4.0))  # the size it already has: fine
    horovod_backend.HorovodBackend(detection, Config())  # no bucket_mb: nothing to say
    assert len(inits) == 2


def test_the_variables_set_for_hvd_init_are_put_back_at_shutdown(monkeypatch):
    """The Horovod backend sets HOROVOD_CYCLE_TIME (CPU), HOROVOD_FUSION_THRESHOLD (bucket_mb) and
    HOROVOD_GLOO_TIMEOUT_SECONDS for its hvd.init(); ud.shutdown() puts each back as the launch had it (unset,
    or the user's value), so the next backend of the process (ud.init(backend=...) again) finds no Horovod
    variable it did not have. Found in one launch running two suites: the torch backend's suite saw the cycle."""
    import types

    import torch

    from unified_dist.backends import horovod_backend
    from unified_dist.backends.base import Config
    from unified_dist.detection import Detection
    seen = []
    names = ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_GLOO_TIMEOUT_SECONDS")
    fake = types.SimpleNamespace(Compression=types.SimpleNamespace(none=None, fp16=None),
                                 is_initialized=lambda: False, local_rank=lambda: 0, shutdown=lambda: None,
                                 init=lambda: seen.append({name: os.environ.get(name) for name in names}))
    monkeypatch.setattr(horovod_backend, "_import_horovod", lambda: fake)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    detection = Detection(backend="horovod", launcher="horovodrun", reason="test")
    for name in names:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOROVOD_GLOO_TIMEOUT_SECONDS", "77")  # the user's: hvd.init() reads it, shutdown keeps it
    backend = horovod_backend.HorovodBackend(detection, Config(bucket_mb=4.0))
    assert seen == [{"HOROVOD_CYCLE_TIME": "5", "HOROVOD_FUSION_THRESHOLD": str(4 * 2 ** 20),
                     "HOROVOD_GLOO_TIMEOUT_SECONDS": "77"}]
    backend.shutdown()
    assert {name: os.environ.get(name) for name in names} == {
        "HOROVOD_CYCLE_TIME": None, "HOROVOD_FUSION_THRESHOLD": None, "HOROVOD_GLOO_TIMEOUT_SECONDS": "77"}


def test_a_second_horovod_start_that_would_abort_is_refused_in_one_line(monkeypatch):
    """Horovod 0.28.1 aborted the process (SIGSEGV or SIGABRT, horovodrun -np 2 --gloo, 2026-11-29) in a second
    hvd.init() after one with HOROVOD_CYCLE_TIME set, when that start or the new one had HOROVOD_FUSION_THRESHOLD
    (orders seen: cycle+threshold then nothing, cycle then threshold, cycle then both: abort; cycle then cycle,
    threshold then cycle, nothing then both: fine). The facade sets the cycle on CPU and bucket_mb the threshold,
    so ud.shutdown() then ud.init() again is refused there as a LaunchError before anything is set or joined."""
    import types

    import torch

    from unified_dist.backends import horovod_backend
    from unified_dist.backends.base import Config
    from unified_dist.detection import Detection
    from unified_dist.errors import LaunchError
    inits = []
    fake = types.SimpleNamespace(Compression=types.SimpleNamespace(none=None, fp16=None),
                                 is_initialized=lambda: False, local_rank=lambda: 0, shutdown=lambda: None,
                                 init=lambda: inits.append(1))
    monkeypatch.setattr(horovod_backend, "_import_horovod", lambda: fake)
    monkeypatch.setattr(horovod_backend, "_STARTS", [])  # this process's earlier starts: none
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for name in ("HOROVOD_CYCLE_TIME", "HOROVOD_FUSION_THRESHOLD", "HOROVOD_GLOO_TIMEOUT_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    two = Detection(backend="horovod", launcher="horovodrun", reason="test", world_size=2)
    horovod_backend.HorovodBackend(two, Config()).shutdown()  # on CPU: the cycle, no threshold
    horovod_backend.HorovodBackend(two, Config()).shutdown()  # cycle then cycle: starts again
    with pytest.raises(LaunchError, match=r"^Horovod cannot start again in this process: .*bucket_mb unset$"):
        horovod_backend.HorovodBackend(two, Config(bucket_mb=4.0))  # cycle then threshold: would abort
    assert len(inits) == 2
    assert "HOROVOD_FUSION_THRESHOLD" not in os.environ and "HOROVOD_GLOO_TIMEOUT_SECONDS" not in os.environ
    one = Detection(backend="horovod", launcher="python", reason="test")  # no peers: not seen to abort
    horovod_backend.HorovodBackend(one, Config(bucket_mb=4.0)).shutdown()
    assert len(inits) == 3
