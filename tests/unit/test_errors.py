"""Every documented error is one actionable line (single process; backends faked by absence)."""
import subprocess
import sys

import pytest
import torch

import unified_dist as ud
from unified_dist.session import config_from
from unified_dist.testing.launchers import ROOT, child_env


@pytest.fixture(autouse=True)
def fresh_facade():
    ud.shutdown()
    yield
    ud.shutdown()


def one_line(exc_info):
    text = str(exc_info.value)
    assert text and "\n" not in text, text
    return text


def test_unknown_backend():
    with pytest.raises(ValueError) as info:
        ud.init(backend="nccl")
    assert "unknown backend 'nccl'" in one_line(info)


@pytest.mark.parametrize("backend,module,hint", [
    ("accelerate", "accelerate", "pip install unified_dist[accelerate]"),
    ("horovod", "horovod", "make setup"),
])
def test_backend_not_installed_says_how_to_install(backend, module, hint):
    code = (f"import sys; sys.modules[{module!r}] = None\n"
            "import unified_dist as ud\n"
            f"try:\n    ud.init(backend={backend!r})\n"
            "except ud.BackendNotInstalled as exc:\n    print('ERR', exc)\n")
    out = subprocess.run([sys.executable, "-c", code], env=child_env(), cwd=ROOT, capture_output=True,
                         text=True, timeout=120).stdout
    assert out.startswith("ERR ") and hint in out and out.count("\n") == 1, out


def test_non_tensor_and_unknown_op():
    with pytest.raises(ud.CollectiveError) as info:
        ud.all_reduce([torch.ones(1), 2.0])
    assert "x[1] is float" in one_line(info)
    with pytest.raises(ud.CollectiveError) as info:
        ud.all_reduce(torch.ones(1), op="avg")
    assert "use one of sum, mean, max, min" in one_line(info)
    with pytest.raises(ud.CollectiveError):
        ud.all_gather("text")


def test_fp16_on_cpu_is_refused_with_the_alternative():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; fp16 is allowed")
    with pytest.raises(ud.PrecisionError) as info:
        ud.init(mixed_precision="fp16")
    assert "bf16" in one_line(info)
    with pytest.raises(ud.PrecisionError):
        resolve_mixed_precision(None, {"ACCELERATE_MIXED_PRECISION": "fp16"}, cuda=False)
    with pytest.raises(ud.PrecisionError, match="unknown mixed precision"):
        resolve_mixed_precision("fp8x", {}, cuda=True)


def resolve_mixed_precision(explicit, env, cuda):
    return config_from({"mixed_precision": explicit}, env, cuda).mixed_precision


def test_precision_resolution_order():
    assert resolve_mixed_precision(None, {}, cuda=False) == "no"
    assert resolve_mixed_precision(None, {"ACCELERATE_MIXED_PRECISION": "bf16"}, cuda=False) == "bf16"
    assert resolve_mixed_precision("bf16", {"ACCELERATE_MIXED_PRECISION": "no"}, cuda=False) == "bf16"  # its default
    assert resolve_mixed_precision(None, {"UNIFIED_DIST_MIXED_PRECISION": "BF16"}, cuda=False) == "bf16"
    assert resolve_mixed_precision("no", {"UNIFIED_DIST_MIXED_PRECISION": "bf16"}, cuda=False) == "no"


def test_the_code_contradicting_the_launcher_is_refused():
    with pytest.raises(ud.LaunchError) as info:
        resolve_mixed_precision("no", {"ACCELERATE_MIXED_PRECISION": "bf16"}, cuda=False)
    assert one_line(info) == ("init(mixed_precision='no') contradicts accelerate launch --mixed_precision "
                              "(ACCELERATE_MIXED_PRECISION=bf16); drop one of them")


def test_bad_init_arguments():
    with pytest.raises(ud.UnifiedDistError, match="gradient_accumulation_steps must be an integer >= 1"):
        ud.init(gradient_accumulation_steps=0)
    with pytest.raises(ud.UnifiedDistError, match="positive number of seconds"):
        ud.init(timeout=-1)


def test_init_is_idempotent_and_refuses_a_second_backend():
    ud.init()
    ud.init()
    assert ud.backend_name() == "single"
    with pytest.raises(ud.UnifiedDistError, match="call ud.shutdown"):
        ud.init(backend="torch")


def test_prepare_rejects_unknown_objects_and_backward_non_tensor():
    with pytest.raises(ud.UnifiedDistError, match="prepare\\(\\) got a str"):
        ud.prepare("model")
    with pytest.raises(ud.UnifiedDistError, match="expects the loss tensor, got float"):
        ud.backward(1.0)


def test_unbatched_stream_and_batch_sampler_loaders_are_refused():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ud.UnifiedDistError, match="batch_size=...; a stream batched by the dataset"):
        ud.prepare(torch.utils.data.DataLoader(Stream(), batch_size=None))
    sampler = torch.utils.data.BatchSampler(range(4), batch_size=2, drop_last=False)
    with pytest.raises(ud.UnifiedDistError, match="batch_size"):
        ud.prepare(torch.utils.data.DataLoader(list(range(4)), batch_sampler=sampler))


def test_every_exception_class_of_the_library_is_a_unified_dist_error():
    """Errors keep their promise: ``except ud.UnifiedDistError`` catches whatever the library defines."""
    import importlib
    import inspect
    import pkgutil

    # a carrier of a worker's traceback text, only ever attached as WorkerFailed's __cause__; and the signal
    # unified-dist plan's worker raises to stop the user's script after its first step and catches itself
    # (a BaseException, so that the script's `except Exception` cannot swallow it)
    carriers = {"unified_dist.spawn.RemoteTraceback", "unified_dist.checks.plan_worker._Planned"}
    foreign = []
    for info in pkgutil.walk_packages(ud.__path__, "unified_dist."):
        if info.name == "unified_dist.__main__":
            continue
        module = importlib.import_module(info.name)
        for _name, cls in inspect.getmembers(module, inspect.isclass):
            qualified = f"{cls.__module__}.{cls.__qualname__}"
            if (cls.__module__ == module.__name__ and issubclass(cls, BaseException)
                    and not issubclass(cls, ud.UnifiedDistError) and qualified not in carriers):
                foreign.append(qualified)
    assert not foreign, f"exception classes that are not UnifiedDistError: {foreign}"
