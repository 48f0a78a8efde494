"""The hot path in one process: the non-finite check waits for the optimizer step, and
``init(compile=...)`` compiles prepared models in place (docs/hot-path.md). The launcher proofs
(host syncs and collectives counted per micro-step, compiled vs eager under torchrun, accelerate
launch and horovodrun) are in tests/launchers/test_hotpath_under_launchers.py."""
from __future__ import annotations

import pytest
import torch

import unified_dist as ud
from unified_dist import settings
from unified_dist.cli import launch
from unified_dist.errors import LaunchError, SettingError, UnifiedDistError
from unified_dist.session import config_from


@pytest.fixture
def single():
    ud.shutdown()
    yield
    ud.shutdown()


# ---------------------------------------------------------------------- the setting
@pytest.mark.parametrize("text,value", [("1", "inductor"), ("on", "inductor"), ("0", None), ("off", None),
                                        ("aot_eager", "aot_eager"), ("Inductor", "inductor")])
def test_the_compile_variable_reads(text, value):
    assert config_from({}, {"UNIFIED_DIST_COMPILE": text}, cuda=False).compile == value


def test_compile_in_code_reads_true_false_and_names():
    assert config_from({"compile": True}, {}, cuda=False).compile == "inductor"
    assert config_from({"compile": False}, {"UNIFIED_DIST_COMPILE": "1"}, cuda=False).compile is None
    assert config_from({"compile": "eager"}, {}, cuda=False).compile == "eager"
    assert config_from({}, {}, cuda=False).compile is None  # off unless asked


def test_accelerate_launch_dynamo_backend_is_honoured_and_its_default_says_nothing():
    """accelerate launch --dynamo_backend inductor exports ACCELERATE_DYNAMO_BACKEND=INDUCTOR; its
    default (NO) leaves the setting to the variable."""
    assert config_from({}, {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, cuda=False).compile == "inductor"
    assert config_from({}, {"ACCELERATE_DYNAMO_BACKEND": "NO", "UNIFIED_DIST_COMPILE": "1"},
                       cuda=False).compile == "inductor"
    assert config_from({}, {"ACCELERATE_DYNAMO_MODE": "max-autotune", "ACCELERATE_DYNAMO_BACKEND": "inductor"},
                       cuda=False).compile_mode == "max-autotune"
    with pytest.raises(LaunchError, match="contradicts accelerate launch --dynamo_backend"):
        config_from({"compile": False}, {"ACCELERATE_DYNAMO_BACKEND": "INDUCTOR"}, cuda=False)


@pytest.mark.parametrize("given,message", [
    ({"compile": "no_such_backend"}, "compile='no_such_backend' is not a torch.compile backend here; use one of"),
    ({"compile": "eager", "compile_mode": "max-autotune"}, "compile_mode='max-autotune' is inductor's"),
])
def test_a_compile_that_cannot_run_is_refused_at_init_in_one_line(given, message):
    with pytest.raises(UnifiedDistError, match=message) as info:
        config_from(given, {}, cuda=False)
    assert "\n" not in str(info.value)


def test_a_compile_value_that_does_not_read_is_a_setting_error():
    with pytest.raises(SettingError, match="UNIFIED_DIST_COMPILE='in ductor' is not a torch.compile backend"):
        config_from({}, {"UNIFIED_DIST_COMPILE": "in ductor"}, cuda=False)
    with pytest.raises(SettingError, match=r"init\(compile=3\) takes True, False or a torch.compile backend"):
        config_from({"compile": 3}, {}, cuda=False)


def test_unified_dist_launch_hands_compile_to_accelerate_launch_as_its_own_flags():
    plan = launch.Plan(backend="accelerate", nproc=2, script="t.py", settings={"compile": "inductor",
                                                                               "compile_mode": "max-autotune"})
    command = launch.build(plan, environ={})
    argv = list(command.argv)
    assert argv[argv.index("--dynamo_backend") + 1] == "inductor"
    assert argv[argv.index("--dynamo_mode") + 1] == "max-autotune"
    assert "UNIFIED_DIST_COMPILE" not in command.env
    plain = list(launch.build(launch.Plan(backend="accelerate", nproc=2, script="t.py"), environ={}).argv)
    assert plain[plain.index("--dynamo_backend") + 1] == "no" and "--dynamo_mode" not in plain
    torchrun = launch.build(launch.Plan(backend="torch", nproc=2, script="t.py", settings={"compile": "inductor"}),
                            environ={})
    assert torchrun.env["UNIFIED_DIST_COMPILE"] == "inductor"
    assert settings.flag_name("compile") == "--compile"


# ---------------------------------------------------------------------- compiling in place
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(4, 8)
        self.norm = torch.nn.BatchNorm1d(8)
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.norm(self.body(x))))


def _train(model, opt, steps=3):
    g = torch.Generator().manual_seed(3)
    losses = []
    for _ in range(steps):
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        loss = model(x).pow(2).mean()
        ud.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_prepare_compiles_in_place_and_keeps_state_dict_keys(single, tmp_path):
    """compile="eager" runs dynamo (graphs captured) without inductor's C++ build: the model keeps its
    class and keys, trains as the uncompiled one does, and checkpoints cross both ways."""
    import torch._dynamo

    torch._dynamo.reset()
    torch.manual_seed(0)
    reference = Net().double()
    compiled = Net().double()
    compiled.load_state_dict(reference.state_dict())
    ud.init(backend="single", compile="eager")
    model, opt = ud.prepare(compiled, torch.optim.SGD(compiled.parameters(), lr=0.1))
    assert type(model) is Net and hasattr(vars(model)["forward"], "_torchdynamo_orig_callable")
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(6, 4, generator=g, dtype=torch.float64)
        loss = reference(x).pow(2).mean()
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append(loss.item())
    assert _train(model, opt) == pytest.approx(expected, rel=1e-12, abs=0)
    frames = torch._dynamo.utils.counters["frames"]
    assert frames["ok"] >= 1, dict(frames)
    keys = list(ud.unwrap(model).state_dict())
    assert keys == list(Net().state_dict())
    ud.save({"model": model}, str(tmp_path / "c.pt"))
    plain = Net().double()
    plain.load_state_dict(torch.load(tmp_path / "c.pt")["model"], strict=True)
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), ud.unwrap(model).state_dict().values()))
    other = Net().double()
    torch.save({"model": other.state_dict()}, tmp_path / "u.pt")
    ud.load(str(tmp_path / "u.pt"), {"model": model})
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), ud.unwrap(model).state_dict().values()))


def test_a_model_whose_forward_is_torchs_own_is_compiled_too(single):
    """nn.Sequential's forward lives in torch/nn, whose frames dynamo skips: ``nn.Module.compile()``
    captures no graph for it in torch 2.13. prepare compiles the forward itself, so a graph is captured."""
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ud.init(backend="single", compile="eager")
    model = ud.prepare(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1)))
    model(torch.ones(2, 4))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1
    assert list(ud.unwrap(model).state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_a_model_compiled_before_prepare_is_left_as_it_is_and_unwraps(single):
    ud.init(backend="single", compile="eager")
    net = Net().double()
    user_compiled = torch.compile(net, backend="eager")
    model = ud.prepare(user_compiled)
    assert model is user_compiled and "forward" not in vars(net)  # not compiled twice
    assert ud.unwrap(model) is net


def test_unwrap_peels_compile_and_ddp_wrappers_in_any_order(single):
    ud.init(backend="single")
    net = Net()
    inner = torch.compile(net, backend="eager")
    outer = torch.compile(torch.nn.DataParallel(inner), backend="eager")
    assert ud.unwrap(outer) is net
    assert ud.unwrap(torch.nn.DataParallel(torch.compile(torch.nn.DataParallel(net), backend="eager"))) is net


# ---------------------------------------------------------------------- the non-finite check
def test_a_nan_in_an_accumulation_window_stops_at_its_optimizer_step_before_any_update(single, monkeypatch):
    """The check waits for the micro-step that synchronises (no exchange before it): a NaN at micro-step
    2 of the second window of 4 is refused at that window's 4th micro-step, naming optimizer step 2;
    the weights are those after step 1."""
    from unified_dist.collectives import ops as collectives

    exchanges = []
    real = collectives.all_reduce
    monkeypatch.setattr(collectives, "all_reduce", lambda *a, **k: exchanges.append(1) or real(*a, **k))
    ud.init(backend="single", gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 1).double()
    model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    after_step_1 = None
    with pytest.raises(ud.NonFiniteLoss, match="not finite on rank 0 at optimizer step 2: nothing was updated"):
        for micro in range(8):
            with ud.accumulate(model):
                loss = model(torch.ones(3, 2, dtype=torch.float64)).mean()
                if micro == 5:
                    loss = loss * float("nan")
                ud.backward(loss)
                opt.step()
                opt.zero_grad()
            assert len(exchanges) == (micro + 1) // 4  # one exchange per optimizer step, none in between
            if micro == 3:
                after_step_1 = [p.detach().clone() for p in model.parameters()]
    assert micro == 7 and len(exchanges) == 2
    assert all(torch.equal(a, p) for a, p in zip(after_step_1, model.parameters()))
