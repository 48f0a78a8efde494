"""Background saves (``async_save=True``) in one process: the state at the call is what is written, one
write at a time, readers wait for it, retention only after it, a failure is one line at the next
settling point, and every exit waits for it (docs/checkpoints.md, "Saves that do not stop training").
The writer is held back by a gate in place of ``torch.save`` (or DCP's ``save``), so each test decides
when the write happens. The proofs under torchrun, accelerate launch and horovodrun are the
``async_saves_*`` checks of tests/launchers/workers/contract_worker.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import unified_dist as ud
from unified_dist.checkpoint.background import WRITER
from unified_dist.testing.launchers import ROOT, child_env


@pytest.fixture
def single():
    ud.shutdown()
    ud.init(backend="single", stop_signals="none")
    yield
    WRITER.wait()
    ud.shutdown()


@pytest.fixture
def gate(monkeypatch):
    """``torch.save`` waits until ``gate.set()`` (at most 20 s), then writes; ``gate.order`` records each write."""
    real, opened = torch.save, threading.Event()
    opened.order = []

    def held(obj, f, *args, **kwargs):
        opened.wait(20)
        opened.order.append(obj.get("tag") if isinstance(obj, dict) else None)
        return real(obj, f, *args, **kwargs)
    monkeypatch.setattr(torch, "save", held)
    yield opened
    opened.set()
    WRITER.wait()


def _open_later(gate, seconds):
    threading.Timer(seconds, gate.set).start()


def _sgd_step(model, opt):
    opt.zero_grad()
    model(torch.ones(3, 4)).pow(2).sum().backward()
    opt.step()


def test_the_call_returns_before_the_write_and_the_file_holds_the_state_at_the_call(single, gate, tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _sgd_step(model, opt)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    momentum_at_call = opt.state[model.weight]["momentum_buffer"].clone()
    path = ud.save_checkpoint({"model": model, "optimizer": opt, "tag": "a"}, str(tmp_path), 1, async_save=True)
    assert not os.path.exists(path), "the call waited for the write"
    _sgd_step(model, opt)  # the next step changes weights and momentum in place
    assert not torch.equal(model.weight, at_call["weight"])
    gate.set()
    ud.barrier()
    saved = ud.load(path)
    for name, value in at_call.items():
        assert torch.equal(saved["model"][name], value), f"{name}: the next step's update reached the file"
    assert torch.equal(saved["optimizer"]["state"][0]["momentum_buffer"], momentum_at_call)


def test_a_reserved_first_save_stages_into_memory_made_ahead_and_holds_the_state_at_its_call(
        single, gate, tmp_path, monkeypatch):
    """Issue #50 item 4: the first async save of a run waited for the operating system's new pages for its
    staging copy (several times the copy itself, bench/checkpoint/async_checkpoint.py); ``ud.reserve_async_save``
    makes that copy's memory ahead, in a thread. The first save then stages into exactly those buffers
    (no fresh tensor, whichever order the state lists them in), and still holds the state at its call."""
    from unified_dist.checkpoint import background

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    _sgd_step(model, opt)  # the optimizer's state exists from here
    state = {"model": model, "optimizer": opt, "tag": "a"}
    ud.reserve_async_save(state)
    background.WRITER._join_reservation()
    reserved = {t.data_ptr() for t in background.WRITER._buffers}
    assert len(reserved) == 4 and all(not t.any() for t in background.WRITER._buffers)  # made and touched
    made = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: made.append(a) or real_empty(*a, **k))
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    path = ud.save_checkpoint({"optimizer": opt, "model": model, "tag": "a"}, str(tmp_path), 1, async_save=True)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert made == [], "the first save made fresh buffers instead of the reserved ones"
    assert {t.data_ptr() for t in background.WRITER._buffers} == reserved
    _sgd_step(model, opt)
    gate.set()
    ud.barrier()
    saved = ud.load(path)
    for name, value in at_call.items():
        assert torch.equal(saved["model"][name], value), f"{name}: the next step's update reached the file"


def test_a_sharded_save_writes_the_shards_as_they_were_at_the_call(single, tmp_path, monkeypatch):
    import torch.distributed.checkpoint as dcp

    real, opened = dcp.save, threading.Event()
    monkeypatch.setattr(dcp, "save", lambda *a, **k: (opened.wait(20), real(*a, **k))[1])
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _sgd_step(model, opt)
    at_call = {k: v.clone() for k, v in model.state_dict().items()}
    ud.save_sharded({"model": model, "optimizer": opt, "step": 1}, str(tmp_path / "sharded"), async_save=True)
    _sgd_step(model, opt)
    opened.set()
    fresh = torch.nn.Linear(4, 2)
    rest = ud.load_sharded({"model": fresh, "optimizer": torch.optim.AdamW(fresh.parameters(), lr=0.1)},
                           str(tmp_path / "sharded"))
    assert rest == {"step": 1}
    for name, value in at_call.items():
        assert torch.equal(fresh.state_dict()[name], value), name


def test_a_second_save_waits_for_the_first(single, gate, tmp_path):
    ud.save({"tag": "first", "w": torch.zeros(2)}, str(tmp_path / "a.pt"), async_save=True)
    start = time.monotonic()  # before the timer starts: the wait below is >= 0.5 s however slow the machine
    _open_later(gate, 0.5)
    ud.save({"tag": "second", "w": torch.ones(2)}, str(tmp_path / "b.pt"), async_save=True)
    waited = time.monotonic() - start
    assert waited > 0.4 and gate.order[:1] == ["first"], (waited, gate.order)  # the first was written before
    ud.barrier()
    assert gate.order == ["first", "second"]


def test_load_and_latest_checkpoint_wait_for_the_write_in_flight(single, gate, tmp_path):
    gate.set()
    ud.save_checkpoint({"tag": "old"}, str(tmp_path), 1)
    gate.clear()
    path = ud.save_checkpoint({"tag": "new"}, str(tmp_path), 2, async_save=True)
    _open_later(gate, 0.3)
    assert ud.latest_checkpoint(str(tmp_path)) == path
    assert ud.load(path)["tag"] == "new"
    path = ud.save_checkpoint({"tag": "newer"}, str(tmp_path), 3, async_save=True)
    assert ud.load(path)["tag"] == "newer"  # the gate is open now: load waits for the write itself


def test_retention_deletes_older_checkpoints_only_after_the_new_one_is_complete(single, gate, tmp_path):
    gate.set()
    first = ud.save_checkpoint({"tag": "1"}, str(tmp_path), 1, async_save=True)
    ud.barrier()
    gate.clear()
    ud.save_checkpoint({"tag": "2"}, str(tmp_path), 2, keep_last=1, async_save=True)
    time.sleep(0.3)
    assert os.path.exists(first) and ud.load(first)["tag"] == "1", "deleted before the new one was written"
    gate.set()
    ud.barrier()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-000000002.pt"], os.listdir(tmp_path)


def _unwritable_dir(tmp_path):
    """A directory no file can be created in, also for root (whom a mode of 0o555 does not stop)."""
    if os.geteuid() == 0:
        return "/sys"  # sysfs refuses new files to everyone
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return str(folder)


def test_a_failed_background_write_is_one_line_at_the_next_settling_point(single, tmp_path):
    path = os.path.join(_unwritable_dir(tmp_path), "ckpt.pt")
    ud.save({"w": torch.ones(2)}, path, async_save=True)  # returns: the write fails in the background
    with pytest.raises(ud.CheckpointError, match="background save failed") as reading:
        ud.load(path)  # this rank reads what it failed to write: never the previous file silently
    with pytest.raises(ud.CheckpointError) as settling:
        ud.barrier()
    text = str(settling.value)
    assert path in text and "failed on rank 0" in text and "\n" not in text and "\n" not in str(reading.value), text
    ud.barrier()  # reported once


def test_shutdown_waits_for_the_write_in_flight(single, gate, tmp_path):
    path = str(tmp_path / "ckpt.pt")
    ud.save({"tag": "last", "w": torch.ones(3)}, path, async_save=True)
    _open_later(gate, 0.5)
    ud.shutdown()
    assert os.path.exists(path) and torch.load(path, weights_only=True)["tag"] == "last"


def test_a_stop_and_requeue_wait_for_the_write_in_flight(gate, tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    ud.shutdown()
    ud.init(backend="single")
    try:
        ud.should_stop()
        first = str(tmp_path / "before-stop.pt")
        ud.save({"tag": "a"}, first, async_save=True)
        os.kill(os.getpid(), signal.SIGUSR1)
        _open_later(gate, 0.3)
        assert ud.should_stop()
        assert os.path.exists(first), "should_stop() returned True with the save still in flight"
        last = str(tmp_path / "at-stop.pt")
        ud.save({"tag": "b"}, last, async_save=True)
        with pytest.raises(SystemExit):
            ud.requeue()
        assert os.path.exists(last), "requeue() left with the save still in flight"
    finally:
        ud.shutdown()
        for number in (signal.SIGUSR1, signal.SIGTERM):
            signal.signal(number, signal.SIG_DFL)


# ------------------------------------------------------------------ in processes of their own
SLOW_WRITER = """
import os, signal, sys, time, torch, unified_dist as ud
real = torch.save
def slow(obj, f, *args, **kwargs):
    real(obj, f, *args, **kwargs)
    f.flush()
    print("written, not renamed", flush=True)
    time.sleep(float(os.environ.get("HOLD", "60")))
torch.save = slow
"""


def _script(tmp_path, body):
    path = tmp_path / "s.py"
    path.write_text(SLOW_WRITER + textwrap.dedent(body))
    return path


@pytest.mark.distributed
def test_kill_9_during_the_background_write_leaves_the_previous_checkpoint_loadable(single, tmp_path):
    """keep_last=1: the previous checkpoint is the only one, and must survive a SIGKILL mid-write."""
    folder = tmp_path / "ckpts"
    ud.save_checkpoint({"w": torch.arange(5.0), "tag": "previous"}, str(folder), 1, keep_last=1)
    script = _script(tmp_path, """
        w = torch.randn(1000, 1000)
        ud.save_checkpoint({"w": w, "tag": "new"}, sys.argv[1], 2, keep_last=1, async_save=True)
        print("returned", flush=True)
        w.add_(1)  # training goes on
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, str(script), str(folder)], env=child_env(), cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        lines = [proc.stdout.readline().strip() for _ in range(2)]
        assert sorted(lines) == ["returned", "written, not renamed"], lines
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    latest = ud.latest_checkpoint(str(folder))
    assert latest is not None and latest.endswith("checkpoint-000000001.pt"), os.listdir(folder)
    state = ud.load(latest)
    assert state["tag"] == "previous" and torch.equal(state["w"], torch.arange(5.0))


@pytest.mark.distributed
def test_every_exit_waits_for_the_write_and_a_failure_at_exit_is_one_line_and_status_1(tmp_path):
    """A normal end of the script, and a SIGTERM the program never asked about (its default action
    comes once the write is whole); a write that fails with nobody left to tell: stderr and status 1."""
    script = _script(tmp_path, """
        ud.init(backend="single")
        ud.save({"w": torch.ones(4), "tag": sys.argv[2]}, sys.argv[1], async_save=True)
        print("returned", flush=True)
        if sys.argv[2] == "signal":
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
            print("survived", flush=True)
    """)
    env = child_env({"HOLD": "1"})
    for how in ("end", "signal"):
        path = tmp_path / f"{how}.pt"
        done = subprocess.run([sys.executable, str(script), str(path), how], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == (0 if how == "end" else -signal.SIGTERM), done
        assert "survived" not in done.stdout and torch.load(path, weights_only=True)["tag"] == how, done
    unwritable = os.path.join(_unwritable_dir(tmp_path), "ckpt.pt")
    done = subprocess.run([sys.executable, str(script), unwritable, "end"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    said = [line for line in done.stderr.splitlines() if "unified_dist" in line]
    assert done.returncode == 1 and len(said) == 1 and unwritable in said[0], done
