"""Which sharding a process runs with, and which blocks FSDP2 shards: pure functions, in process.
The arithmetic of sharded training is checked under torchrun and accelerate launch by the
contract suite (``fsdp_*`` checks)."""
from __future__ import annotations

import pytest
import torch

from unified_dist.errors import LaunchError, UnifiedDistError
from unified_dist.parallel.sharding import Sharding, blocks_to_shard
from unified_dist.session import config_from

ACCELERATE_FSDP2 = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_RESHARD_AFTER_FORWARD": "false"}


def resolve_sharding(explicit, env, reshard_after_forward=None):
    given = {"sharding": explicit, "reshard_after_forward": reshard_after_forward}
    return config_from(given, env, cuda=False).sharding


@pytest.mark.parametrize("explicit,env,expected", [
    (None, {}, "no"),
    ("fsdp", {}, "fsdp"),
    (None, {"UNIFIED_DIST_SHARDING": "FSDP"}, "fsdp"),
    ("no", {"UNIFIED_DIST_SHARDING": "fsdp"}, "no"),
    ("fsdp", {"ACCELERATE_USE_FSDP": "false"}, "fsdp"),  # accelerate's default says nothing
    (None, ACCELERATE_FSDP2, "fsdp"),
    ("fsdp", ACCELERATE_FSDP2, "fsdp"),
])
def test_the_code_wins_then_accelerate_launch_then_the_variable(explicit, env, expected):
    assert resolve_sharding(explicit, env).mode == expected


def test_accelerate_launchs_reshard_setting_is_honoured_and_the_code_may_not_contradict_it():
    assert resolve_sharding(None, ACCELERATE_FSDP2).reshard_after_forward is False
    assert resolve_sharding(None, ACCELERATE_FSDP2, reshard_after_forward=False).reshard_after_forward is False
    with pytest.raises(LaunchError, match="contradicts accelerate launch --fsdp_reshard_after_forward"):
        resolve_sharding(None, ACCELERATE_FSDP2, reshard_after_forward=True)
    accelerate_default = {**ACCELERATE_FSDP2, "FSDP_RESHARD_AFTER_FORWARD": "true"}  # what it exports unasked
    assert resolve_sharding(None, accelerate_default, reshard_after_forward=False).reshard_after_forward is False
    assert resolve_sharding("fsdp", {}).reshard_after_forward is True


@pytest.mark.parametrize("explicit,env,error,words", [
    ("zero3", {}, UnifiedDistError, "unknown sharding 'zero3'"),
    (None, {"ACCELERATE_USE_FSDP": "true"}, LaunchError, "--fsdp_version 2"),
    ("no", ACCELERATE_FSDP2, LaunchError, "contradicts accelerate launch --use_fsdp"),
])
def test_bad_settings_are_one_line_errors(explicit, env, error, words):
    with pytest.raises(error) as info:
        resolve_sharding(explicit, env)
    assert words in str(info.value) and "\n" not in str(info.value)


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.nn.Linear(2, 2)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([Block(), Block()])
        self.head = torch.nn.Linear(2, 1)


def test_default_blocks_are_module_list_children_innermost_first():
    net = Net()
    assert blocks_to_shard(net) == [net.layers[1], net.layers[0]]


def test_hugging_face_no_split_modules_and_explicit_modules_choose_the_blocks():
    net = Net()
    net._no_split_modules = ["Linear"]
    assert blocks_to_shard(net) == [net.head, net.layers[1].inner, net.layers[0].inner]
    assert blocks_to_shard(net, [Block]) == [net.layers[1], net.layers[0]]
    with pytest.raises(UnifiedDistError, match="matches no sub-module"):
        blocks_to_shard(net, ["Conv2d"])


def test_sharding_is_off_by_default():
    assert not Sharding().enabled and Sharding("fsdp").enabled


def test_sharding_under_horovod_is_a_one_line_error_before_horovod_starts(monkeypatch):
    import unified_dist as ud
    from unified_dist.backends.horovod_backend import HorovodBackend

    def must_not_start(*args, **kwargs):
        raise AssertionError("the Horovod backend started before sharding was refused")

    monkeypatch.setattr(HorovodBackend, "__init__", must_not_start)
    monkeypatch.delenv("UNIFIED_DIST_SHARDING", raising=False)
    ud.shutdown()
    with pytest.raises(UnifiedDistError) as info:
        ud.init("horovod", sharding="fsdp")
    message = str(info.value)
    assert "has no sharding" in message and "torchrun, accelerate launch" in message and "\n" not in message


def test_single_process_runs_a_sharded_script_unchanged(monkeypatch):
    import unified_dist as ud

    ud.shutdown()
    ud.init("single", sharding="fsdp", sync_batchnorm=True)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
        prepared = ud.prepare(model)
        assert prepared is model and isinstance(model[1], torch.nn.BatchNorm1d)  # one process: nothing to shard or sync
        assert ud.sharding_mode() == "fsdp"
        state = ud.get_state_dict(prepared)
        assert list(state) == list(model.state_dict()) and all(t.device.type == "cpu" for t in state.values())
    finally:
        ud.shutdown()


@pytest.mark.parametrize("mode,param,reduce", [("no", None, None), ("bf16", torch.bfloat16, torch.float32),
                                               ("fp16", torch.float16, torch.float32)])
def test_mixed_precision_becomes_fsdp2s_policy_with_float32_gradient_reduction(mode, param, reduce):
    from unified_dist.backends.precision import Precision

    policy = Precision(mode).fsdp_policy()
    assert (policy.param_dtype, policy.reduce_dtype) == (param, reduce)



def test_prepare_gives_fully_shard_the_bf16_policy_on_every_block(monkeypatch):
    """docs/fsdp.md: under sharding="fsdp", mixed_precision="bf16" becomes FSDP2's MixedPrecisionPolicy
    (parameters in bf16, gradients reduced in float32): what a backend's FSDP prepare hands fully_shard."""
    import torch.distributed.fsdp as fsdp

    from unified_dist.backends.precision import Precision
    from unified_dist.parallel.sharding import shard_model
    seen = []
    monkeypatch.setattr(fsdp, "fully_shard", lambda module, **options: seen.append((type(module), options)))
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    shard_model(model, Sharding(mode="fsdp", modules=(torch.nn.Linear,)), Precision("bf16"))
    assert [kind for kind, _ in seen] == [torch.nn.Linear, torch.nn.Linear, torch.nn.Sequential], seen
    for _, options in seen:
        policy = options["mp_policy"]
        assert (policy.param_dtype, policy.reduce_dtype) == (torch.bfloat16, torch.float32), policy
