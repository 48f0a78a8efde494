"""Stop signals: what a cluster sends before it takes the machine away, turned into one agreed stop.

SLURM sends ``#SBATCH --signal=USR1@90`` ahead of the time limit and SIGTERM on ``scancel`` or
preemption (then SIGKILL after ``KillWait``); torchrun forwards SIGTERM to its workers (then SIGKILL
after 30 s); Kubernetes sends SIGTERM and waits its grace period. :class:`StopSignals` records them;
the session's once-per-optimizer-step exchange (:mod:`unified_dist.session`) carries "I got one" to
every rank, so ``ud.should_stop()`` turns True on every rank at the same optimizer step.

Contract:

- The handlers are installed at ``ud.init`` in the main thread, only over the default action
  (``SIG_DFL``): a handler the program installed before ``init`` is kept, and one installed after
  replaces ours.
- Until the program has asked ``ud.should_stop()`` once, a stop signal is the program's to plan for:
  before ``ud.prepare`` got an optimizer it does at once what it did without unified_dist (the
  default action, e.g. SIGTERM ends the process); once an optimizer is prepared it is *held* until
  the end of the next optimizer step (that is, until the program takes the optimizer step after it).
  A program that asks by then stops at an agreed step on every rank, as if it had asked before the
  signal; one that has not asked gets the default action then, before that step updates anything, or
  at the session's end (``ud.shutdown``, interpreter exit) if no step comes. Either way the background
  save in flight, if any, is written first (:mod:`unified_dist.checkpoint.background`): a program that
  never asks is never left running by a signal it did not plan for, and one that logs or evaluates
  between its first optimizer step and its first ask loses nothing.
- Afterwards every stop signal is only recorded (a second one while the checkpoint is written does
  not interrupt the write); SIGKILL, which no process can catch, remains the scheduler's last word.

Importing this module imports only the standard library.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

REQUEUE_EXIT_CODE = 75
"""The status ``ud.requeue()`` exits with outside SLURM: ``EX_TEMPFAIL`` ("temporary failure, run
me again" in sysexits.h). Non-zero, so torchrun's ``--max-restarts``, an elastic agent or a
Kubernetes ``restartPolicy: OnFailure`` runs the job again."""


class StopSignals:
    """The stop signals of this process: which arrived (in order), and whether the program asks."""

    def __init__(self, names: Sequence[str]) -> None:
        self.numbers = [getattr(signal, name) for name in names]
        self.received: List[int] = []
        self.asked = False  # the program called ud.should_stop() at least once
        self._installed: Dict[int, Any] = {}
        self._steps: Optional[Callable[[], int]] = None  # optimizer steps taken so far, once an optimizer is prepared
        self._held: Optional[Tuple[int, int]] = None  # (signal, optimizer steps taken when it came), before any ask

    @property
    def pending(self) -> bool:
        """Whether a stop signal arrived (since the process started)."""
        return bool(self.received)

    def hold_from(self, steps: Callable[[], int]) -> None:
        """The program trains (an optimizer is prepared): from now on a signal before the first ask is held
        until the end of the next optimizer step; ``steps()`` counts the optimizer steps taken."""
        self._steps = steps

    def step_begins(self) -> None:
        """An optimizer step begins: a signal held through the whole of an earlier optimizer step, without
        the program asking, gets its default action now (the rule is in the module's docstring)."""
        if self._held is not None and not self.asked and self._steps is not None and self._steps() > self._held[1]:
            self.release_held()

    def release_held(self) -> None:
        """The session ends (or a step began, see :meth:`step_begins`): a signal still held because the
        program never asked gets the default action it would have had without unified_dist."""
        if self._held is not None and not self.asked:
            number, self._held = self._held[0], None
            _default_action(number)

    def install(self) -> List[str]:
        """Handle each signal whose action is the default; returns the names left to the program's
        own handlers. Outside the main thread nothing can be installed: every name is returned."""
        if threading.current_thread() is not threading.main_thread():
            return [signal.Signals(n).name for n in self.numbers]
        kept = []
        for number in self.numbers:
            if signal.getsignal(number) is signal.SIG_DFL:
                signal.signal(number, self._record)
                self._installed[number] = signal.SIG_DFL
            else:
                kept.append(signal.Signals(number).name)
        return kept

    def uninstall(self) -> None:
        """Give back the default action of each signal still handled by :meth:`_record`."""
        if threading.current_thread() is not threading.main_thread():
            return
        for number, previous in self._installed.items():
            if signal.getsignal(number) == self._record:
                signal.signal(number, previous)
        self._installed.clear()

    def _record(self, number: int, frame: Any) -> None:
        if not self.asked:  # the program does not stop on request (yet)
            if self._steps is None:  # not training yet: the signal does what it always did
                _default_action(number)
                return
            if self._held is None:  # held until the end of the next optimizer step (step_begins decides)
                self._held = (number, self._steps())
        self.received.append(number)


def _default_action(number: int) -> None:
    """What ``number`` did without unified_dist (e.g. SIGTERM ends the process), once the checkpoint being
    written in the background is whole."""
    from ..checkpoint.background import flush_quietly

    flush_quietly()
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


def slurm_requeue(job_id: str) -> "str | None":
    """Ask SLURM to run job ``job_id`` again (``scontrol requeue``, as Lightning's SLURM environment
    does); ``None`` when it accepted, else the one-line reason to show on every rank."""
    import shutil
    import subprocess

    if shutil.which("scontrol") is None:
        return (f"ud.requeue() found SLURM_JOB_ID={job_id} but no scontrol on PATH; run the job where SLURM's "
                "commands are installed, or unset SLURM_JOB_ID to exit with status 75 instead")
    done = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if done.returncode == 0:
        return None
    said = " ".join((done.stderr or done.stdout).split()) or f"exit status {done.returncode}"
    return (f"scontrol requeue {job_id} failed ({said}); submit with `sbatch --requeue` (and a cluster whose "
            "JobRequeue allows it); the checkpoint is written, so resubmitting the job resumes it")
