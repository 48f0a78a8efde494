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
- Until the program has asked ``ud.should_stop()`` once, a stop signal does what it did without
  unified_dist (the default action, e.g. SIGTERM ends the process), after the background save in
  flight, if any, is written (:mod:`unified_dist.checkpoint.background`): a program that never asks is
  never left running by a signal it did not plan for.
- Afterwards every stop signal is only recorded (a second one while the checkpoint is written does
  not interrupt the write); SIGKILL, which no process can catch, remains the scheduler's last word.

Importing this module imports only the standard library.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Any, Dict, List, Sequence

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

    @property
    def pending(self) -> bool:
        """Whether a stop signal arrived (since the process started)."""
        return bool(self.received)

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
        if not self.asked:  # the program does not stop on request: the signal does what it always did,
            from ..checkpoint.background import flush_quietly  # once the checkpoint being written is whole

            flush_quietly()
            signal.signal(number, signal.SIG_DFL)
            os.kill(os.getpid(), number)
            return
        self.received.append(number)


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
