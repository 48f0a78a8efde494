"""The gradient-compression switch: how it is resolved, what each launcher passes on, what Horovod refuses.

Its effect on training (N ranks' parameters against one process within the format's
precision, and different from uncompressed) is checked under every launcher by the ``bf16``
suite of tests/launchers/workers/contract_worker.py.
"""
import importlib.util

import pytest

import unified_dist as ud
from unified_dist.backends.base import Config
from unified_dist.cli import launch
from unified_dist.settings import TABLE, resolve

ENV_VAR = TABLE["gradient_compression"].variable


def resolve_gradient_compression(given, env):
    return resolve("gradient_compression", given, env)


def test_init_argument_wins_over_the_variable():
    assert resolve_gradient_compression(None, {}) is None
    assert resolve_gradient_compression(None, {ENV_VAR: "BF16"}) == "bf16"
    assert resolve_gradient_compression("fp16", {ENV_VAR: "bf16"}) == "fp16"
    assert resolve_gradient_compression("none", {ENV_VAR: "bf16"}) is None
    assert resolve_gradient_compression(None, {ENV_VAR: "none"}) is None


@pytest.mark.parametrize("bad", ["fp8", "int8", "powersgd"])
def test_unknown_format_is_a_one_line_error(bad):
    for explicit, env in ((bad, {}), (None, {ENV_VAR: bad})):
        with pytest.raises(ud.UnifiedDistError, match="unknown gradient compression") as err:
            resolve_gradient_compression(explicit, env)
        assert "\n" not in str(err.value) and "bf16, fp16" in str(err.value)


@pytest.mark.parametrize("backend", launch.BACKENDS)
def test_launch_passes_the_switch_to_the_script_under_every_launcher(backend):
    plan = launch.Plan(backend=backend, script="train.py", nproc=2, settings={"gradient_compression": "bf16"})
    command = launch.build(plan, environ={})
    assert command.env[ENV_VAR] == "bf16"
    assert command.line().startswith(f"{ENV_VAR}=bf16 ")
    assert ENV_VAR not in launch.build(launch.Plan(backend=backend, script="train.py"), environ={}).env


@pytest.mark.skipif(importlib.util.find_spec("horovod") is None, reason="horovod is not installed")
def test_horovod_refuses_bf16_before_joining_and_names_fp16():
    from unified_dist.backends.horovod_backend import HorovodBackend

    with pytest.raises(ud.UnifiedDistError, match="gradient_compression='fp16'") as err:
        HorovodBackend(None, Config(gradient_compression="bf16"))
    assert "\n" not in str(err.value)


def test_single_process_accepts_either_format_and_sends_nothing():
    import torch

    from unified_dist.backends.single import SingleProcessBackend

    backend = SingleProcessBackend(None, Config(gradient_compression="bf16"))
    model = torch.nn.Linear(2, 2)
    assert backend.prepare_model(model) is model


def test_sharding_and_compression_together_are_refused():
    try:
        with pytest.raises(ud.UnifiedDistError, match="reduce-scatters instead") as err:
            ud.init(sharding="fsdp", gradient_compression="bf16")
        assert "\n" not in str(err.value)
    finally:
        ud.shutdown()
