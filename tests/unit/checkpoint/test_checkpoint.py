"""Atomic writes, portable state, and loads that never run code."""
import os
import pickle
import shutil

import pytest
import torch

import unified_dist as ud
from unified_dist.checkpoint import files as checkpoint


@pytest.fixture(autouse=True)
def fresh_facade():
    ud.shutdown()
    yield
    ud.shutdown()


def test_ddp_prefix_is_stripped_and_tensors_are_plain():
    wrapped = {"module.weight": torch.ones(2), "module.bias": torch.zeros(1)}
    state = checkpoint.to_state({"model": wrapped, "step": 3}, lambda m: m)
    assert set(state["model"]) == {"weight", "bias"} and state["step"] == 3


def test_save_load_round_trip(tmp_path):
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = ud.prepare(model, opt)
    ud.save({"model": model, "optimizer": opt, "epoch": 2}, str(tmp_path / "c.pt"))
    got = ud.load(str(tmp_path / "c.pt"))
    assert got["epoch"] == 2 and torch.equal(got["model"]["weight"], model.weight.detach())
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_checkpoint_mode_follows_the_umask(tmp_path, umask, mode):
    """Colleagues on a shared cluster read checkpoints as they read any file the user writes;
    save_checkpoint's directory and rotation leave the newest file with the same mode."""
    previous = os.umask(umask)
    try:
        ud.save({"v": torch.ones(1)}, str(tmp_path / "c.pt"))
        newest = ud.save_checkpoint({"v": torch.ones(1)}, str(tmp_path / "ckpts"), 7)
    finally:
        os.umask(previous)
    assert oct(os.stat(tmp_path / "c.pt").st_mode & 0o777) == oct(mode)
    assert oct(os.stat(newest).st_mode & 0o777) == oct(mode)


def test_load_into_live_objects_restores_them_in_place(tmp_path):
    """ud.load(path, state) is the mirror of ud.save(state, path): models (prepared or not),
    optimizers, schedulers and loaders take their state, plain values are replaced, and the
    saved entries state does not name come back; a name the file lacks is refused first."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10.0)), batch_size=2)
    model, opt, sched, loader = ud.prepare(model, opt, sched, loader)
    for (x,) in loader:
        with ud.accumulate(model):
            ud.backward(model(x.reshape(-1, 1).repeat(1, 3)).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        break
    path = str(tmp_path / "c.pt")
    ud.save({"model": model, "optimizer": opt, "scheduler": sched, "loader": loader, "step": 1, "note": "x"}, path)
    fresh = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, 1, gamma=0.5)
    fresh_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10.0)), batch_size=2)
    fresh, fresh_opt, fresh_sched, fresh_loader = ud.prepare(fresh, fresh_opt, fresh_sched, fresh_loader)
    state = {"model": fresh, "optimizer": fresh_opt, "scheduler": fresh_sched, "loader": fresh_loader, "step": 0}
    with pytest.raises(ud.CheckpointError, match="has no 'epoch'"):
        ud.load(path, {**state, "epoch": 0})
    assert ud.load(path, state) == {"note": "x"}
    assert state["step"] == 1
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    assert fresh_opt.state_dict()["state"] and fresh_sched.last_epoch == 1
    assert fresh_opt.param_groups[0]["lr"] == pytest.approx(0.05)
    assert next(iter(fresh_loader))[0].tolist() == [2.0, 3.0]  # resumes after the batch taken
    with pytest.raises(ud.CheckpointError, match="map_location"):
        ud.load(path, "cpu")


def test_failed_write_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    path = str(tmp_path / "c.pt")
    ud.save({"v": torch.tensor([1.0])}, path)

    def broken_save(obj, handle):
        handle.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint.torch, "save", broken_save)
    with pytest.raises(ud.UnifiedDistError, match="saving .* failed on the main process: OSError: disk full"):
        ud.save({"v": torch.tensor([2.0])}, path)
    monkeypatch.undo()
    assert ud.load(path)["v"].item() == 1.0
    assert os.listdir(tmp_path) == ["c.pt"]


def test_a_write_that_fills_the_disk_says_so_and_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as ``unexpected pos``; the error names the cause."""
    path = str(tmp_path / "c.pt")
    ud.save({"v": torch.tensor([1.0])}, path)
    usage = shutil.disk_usage(tmp_path)

    def filling_save(obj, handle):
        handle.write(b"x" * 3 * 2**20)
        handle.flush()
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 137792448 vs 137792336")

    monkeypatch.setattr(checkpoint.torch, "save", filling_save)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda d: usage._replace(free=5 * 2**20))
    with pytest.raises(ud.UnifiedDistError, match=(
            r"saving .*c\.pt failed on the main process: CheckpointError: the filesystem of .*c\.pt is full "
            r"\(5 MiB free after writing 3 MiB of it\); free space there or save to another filesystem")):
        ud.save({"v": torch.tensor([2.0])}, path)
    monkeypatch.undo()
    assert ud.load(path)["v"].item() == 1.0
    assert os.listdir(tmp_path) == ["c.pt"]


def test_missing_truncated_and_foreign_files(tmp_path):
    with pytest.raises(ud.CheckpointError, match="does not exist"):
        ud.load(str(tmp_path / "nope.pt"))
    good = tmp_path / "good.pt"
    ud.save({"w": torch.randn(100)}, str(good))
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:200])
    with pytest.raises(ud.CheckpointError, match="truncated or not a torch checkpoint") as info:
        ud.load(str(truncated))
    assert "\n" not in str(info.value)
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello")
    with pytest.raises(ud.CheckpointError):
        ud.load(str(foreign))


class Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_pickled_code_is_refused_with_the_reason(tmp_path):
    evil = tmp_path / "evil.pt"
    torch.save({"x": Payload()}, str(evil), pickle_module=pickle)
    with pytest.raises(ud.CheckpointError, match="refusing to load .*weights_only=True") as info:
        ud.load(str(evil))
    assert "\n" not in str(info.value)


def test_rotation_keeps_the_newest_and_never_the_only_good_one(tmp_path):
    d = str(tmp_path)
    for step in (10, 20, 30, 40):
        path = ud.save_checkpoint({"step": step}, d, step, keep_last=2)
    assert sorted(os.listdir(d)) == ["checkpoint-000000030.pt", "checkpoint-000000040.pt"]
    assert ud.latest_checkpoint(d) == path and ud.load(path)["step"] == 40
    # a truncated newest file (e.g. copied by hand) is skipped by latest() and deletes nothing
    broken = checkpoint.checkpoint_path(d, 50)
    with open(broken, "wb") as f:
        f.write(b"PK\x03\x04 not really")
    checkpoint.rotate(d, 1, broken)
    assert ud.latest_checkpoint(d) == path and len(os.listdir(d)) == 3
    assert ud.latest_checkpoint(str(tmp_path / "empty")) is None


KILL_DURING_SAVE = r"""
import io, sys, torch, unified_dist as ud
path = sys.argv[1]
real = torch.save
def half_then_wait(obj, f, *args, **kwargs):  # the test kills this process mid-write, whatever the disk's speed
    buffer = io.BytesIO()
    real(obj, buffer, *args, **kwargs)
    f.write(buffer.getvalue()[:buffer.tell() // 2])
    f.flush()
    print("half written", flush=True)
    sys.stdin.readline()  # never answered: SIGKILL comes first
torch.save = half_then_wait
print("ready", flush=True)
ud.save({"w": torch.randn(16, 1024, 1024), "tag": "new"}, path)
"""


def test_killing_a_process_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    import signal
    import subprocess
    import sys

    from unified_dist.testing.launchers import ROOT, child_env

    path = tmp_path / "ckpt.pt"
    ud.save({"w": torch.arange(5.0), "tag": "previous"}, str(path))
    proc = subprocess.Popen([sys.executable, "-c", KILL_DURING_SAVE, str(path)], env=child_env(), cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        assert proc.stdout.readline().strip() == "half written"  # the child now waits, mid-write
        assert any(p.name.endswith(".tmp") and p.stat().st_size > 10_000_000 for p in tmp_path.iterdir()), \
            "the half-written file is not a temporary one"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    state = ud.load(str(path))  # the kill landed mid-write: the previous checkpoint is still the file
    assert state["tag"] == "previous" and torch.equal(state["w"], torch.arange(5.0))
