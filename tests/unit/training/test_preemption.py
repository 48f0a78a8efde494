"""Stop signals in one process: recorded only once the program asks, agreed at an optimizer step,
never stealing a handler, and ``ud.requeue`` (docs/preemption.md). The proofs with several ranks and
real launchers (torchrun, accelerate launch, horovodrun, a SLURM job requeued) are in
tests/launchers/test_preemption_under_launchers.py."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import unified_dist as ud
from unified_dist.collectives import ops as collectives
from unified_dist.errors import SettingError
from unified_dist.session import config_from


@pytest.fixture
def single():
    ud.shutdown()
    yield
    ud.shutdown()
    for number in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(number, signal.SIG_DFL)


@pytest.mark.parametrize("text,names", [("USR1,TERM", ("SIGUSR1", "SIGTERM")), ("sigterm", ("SIGTERM",)),
                                        ("USR2 INT", ("SIGUSR2", "SIGINT")), ("none", ())])
def test_the_stop_signals_variable_reads(text, names):
    assert config_from({}, {"UNIFIED_DIST_STOP_SIGNALS": text}, cuda=False).stop_signals == names


def test_stop_signals_default_to_usr1_and_term_and_refuse_what_cannot_be_caught():
    assert config_from({}, {}, cuda=False).stop_signals == ("SIGUSR1", "SIGTERM")
    assert config_from({"stop_signals": [signal.SIGUSR2]}, {}, cuda=False).stop_signals == ("SIGUSR2",)
    with pytest.raises(SettingError, match="'KILL' is not a signal a process can catch"):
        config_from({}, {"UNIFIED_DIST_STOP_SIGNALS": "TERM,KILL"}, cuda=False)


def _loop(model, opt, micro_steps, signal_at=None, asks=True, first_ask=0):
    """Micro-steps of a loop with accumulation; returns the micro-step at which should_stop() turned True.
    ``first_ask``: the micro-step of the first ``should_stop()`` (a loop that logs or evaluates before it asks)."""
    for micro in range(micro_steps):
        with ud.accumulate(model):
            ud.backward(model(torch.ones(2, 2)).sum())
            opt.step()
            opt.zero_grad()
        if micro == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        if asks and micro >= first_ask and ud.should_stop():
            return micro
    return None


def test_a_signal_becomes_a_stop_at_the_next_optimizer_step_without_an_extra_exchange(single, monkeypatch):
    """Accumulation 4: a SIGUSR1 right after micro-step 7 (the second window's exchange is done) stops at
    micro-step 11, the third window's synchronising one, and the only exchanges were the optimizer steps'."""
    exchanges = []
    real = collectives.all_reduce
    monkeypatch.setattr(collectives, "all_reduce", lambda *a, **k: exchanges.append(1) or real(*a, **k))
    ud.init(backend="single", gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 1)
    model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _loop(model, opt, 12, signal_at=7) == 11  # window 3 (micro 8..11) is the first after the signal
    assert len(exchanges) == 3


def test_a_signal_inside_a_window_stops_at_that_windows_step(single):
    ud.init(backend="single", gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 1)
    model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _loop(model, opt, 12, signal_at=4) == 7
    ud.shutdown()
    ud.init(backend="single", gradient_accumulation_steps=4)
    model = torch.nn.Linear(2, 1)
    model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _loop(model, opt, 12, signal_at=6) == 7


def test_a_signal_between_a_step_and_the_first_ask_is_held_and_stops_at_the_next_step(single):
    """Accumulation 2, an optimizer prepared: SIGUSR1 right after the first optimizer step (micro-step 1),
    before the program's first should_stop() (micro-step 3), is held, not the default action that would
    end this test run; the first ask is False (the step's exchange ran before the signal) and the stop
    comes at the next optimizer step, micro-step 3."""
    ud.init(backend="single", gradient_accumulation_steps=2)
    model = torch.nn.Linear(2, 1)
    model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert _loop(model, opt, 8, signal_at=1, first_ask=2) == 3


_HELD = """
import os, signal, sys, torch
import unified_dist as ud
ud.init(backend="single")
model = torch.nn.Linear(2, 1)
model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
def step(n):
    with ud.accumulate(model):
        ud.backward(model(torch.ones(2, 2)).sum())
        opt.step()
        opt.zero_grad()
    print("step", n, "taken", opt.steps_taken, flush=True)
step(1)
os.kill(os.getpid(), signal.SIGTERM)
print("held", flush=True)
if sys.argv[1] == "asks":
    print("first ask", ud.should_stop(), flush=True)  # step 1's exchange came before the signal
    step(2)
    print("next ask", ud.should_stop(), flush=True)
elif sys.argv[1] == "steps":
    step(2)
    step(3)
elif sys.argv[1] == "shutdown":
    ud.shutdown()
print("went on", flush=True)
"""


@pytest.mark.distributed
def test_a_held_signal_stops_a_program_that_asks_after_it_at_the_next_step(tmp_path):
    """SIGTERM between step 1 and the first ask is held (the child lives on), and the stop is agreed at step 2
    (in a child process: a signal wrongly given its default action must end the child, not the test run)."""
    script = tmp_path / "s.py"
    script.write_text(_HELD)
    done = subprocess.run([sys.executable, str(script), "asks"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.splitlines() == [
        "step 1 taken 1", "held", "first ask False", "step 2 taken 2", "next ask True", "went on"], done


@pytest.mark.distributed
@pytest.mark.parametrize("end,said", [
    ("steps", ["step 1 taken 1", "held", "step 2 taken 2"]),  # dies as step 3 begins, before it updates
    ("shutdown", ["step 1 taken 1", "held"]),  # no step came: ud.shutdown gives the default action
    ("exit", ["step 1 taken 1", "held", "went on"]),  # nor shutdown: the interpreter's exit does
])
def test_a_held_signal_the_program_never_asks_about_ends_it_after_the_next_step(tmp_path, end, said):
    """An optimizer is prepared and the program never asks: SIGTERM after step 1 is held through the end of
    step 2, then the process dies of it (as without unified_dist) when step 3 begins, or at the session's
    end if no step comes (in a child process: the death is the point)."""
    script = tmp_path / "s.py"
    script.write_text(_HELD)
    done = subprocess.run([sys.executable, str(script), end], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM and done.stdout.splitlines() == said, done


@pytest.mark.distributed
def test_a_second_signal_is_only_recorded(tmp_path):
    """Once asked, two SIGTERMs are recorded and the process lives on (in a child process: a signal that
    wrongly kept its default action must end the child, not the test run)."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import os, signal
        import unified_dist as ud
        ud.init(backend="single")
        print("asked", ud.should_stop())
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        print("stop", ud.should_stop())  # no ud.backward in this loop: the call made the exchange
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["asked", "False", "stop", "True"], done


def test_a_handler_installed_before_init_is_kept(single):
    seen = []
    signal.signal(signal.SIGUSR1, lambda n, f: seen.append(n))
    ud.init(backend="single")
    ud.should_stop()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert seen == [signal.SIGUSR1]
    assert ud.should_stop() is False


def test_no_stop_signals_installs_nothing(single):
    ud.init(backend="single", stop_signals="none")
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and ud.should_stop() is False


def test_shutdown_gives_the_default_action_back(single):
    ud.init(backend="single")
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
    ud.shutdown()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_requeue_refuses_a_job_that_was_not_asked_to_stop(single):
    ud.init(backend="single")
    with pytest.raises(ud.UnifiedDistError, match="a job that failed for another reason must end"):
        ud.requeue()


def test_requeue_outside_slurm_exits_75(single, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    ud.init(backend="single")
    ud.should_stop()
    os.kill(os.getpid(), signal.SIGUSR1)
    assert ud.should_stop()
    with pytest.raises(SystemExit) as info:
        ud.requeue()
    assert info.value.code == 75


@pytest.mark.parametrize("works", [True, False])
def test_requeue_under_slurm_asks_scontrol(single, monkeypatch, tmp_path, works):
    calls = tmp_path / "calls"
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho \"$@\" >> {calls}\n" + ("exit 0\n" if works else
                    "echo 'Requested operation is disabled' >&2\nexit 1\n"))
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    ud.init(backend="single")
    ud.should_stop()
    os.kill(os.getpid(), signal.SIGTERM)
    assert ud.should_stop()
    if works:
        with pytest.raises(SystemExit) as info:
            ud.requeue()
        assert info.value.code == 0
    else:
        with pytest.raises(ud.UnifiedDistError, match=r"scontrol requeue 4242 failed \(Requested operation is "
                                                      r"disabled\); submit with `sbatch --requeue`"):
            ud.requeue()
    assert calls.read_text() == "requeue 4242\n"


@pytest.mark.distributed
def test_a_program_that_never_asks_dies_of_the_signal_as_before(tmp_path):
    """Until should_stop() is called, SIGTERM keeps its default action: the process ends by it."""
    script = tmp_path / "s.py"
    script.write_text(textwrap.dedent("""
        import os, signal, time
        import unified_dist as ud
        ud.init(backend="single")
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("survived")
    """))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM and "survived" not in done.stdout, done
