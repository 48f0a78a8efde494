"""``unified-dist launch --replica-groups N``: N replica groups on this host that outlive one another.

It starts torchft's lighthouse (torchft's ``LighthouseServer``, the server ``torchft_lighthouse`` runs, in a
process of its own that binds a port the OS picks and says which: no other program can take the port between
the choice and the bind) and N copies of the torch launch command (``torchrun --standalone``: each group its
own rendezvous), each with ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS`` set
(:mod:`unified_dist.backends.replica_groups`). Every process of a group runs the script through
``python -m unified_dist.cli.replica_child run``, which records how it ended (its exit status, and whether it was a
usage error) in a file the launcher reads: torchrun's own status is 1 for any failure, so the launcher could not
tell a requeue (75) or a usage error (2) from a crash otherwise.

It supervises everything it starts (docs/fault-tolerance.md):

- a group that exits with an error is started again, alone, while the others train on; the new group heals
  from a live one at its first step. A group's first start that ends on a usage error (exit status 2, or a
  ``UnifiedDistError`` other than a lost peer or a timeout before the process's first optimizer step) is not
  started again: it would fail the same way; the job stops with its status;
- the lighthouse is started again on the same address when it dies (the groups' next quorum reaches the new
  one); its output goes to ``lighthouse.log`` in the run's folder (``--replica-log-dir``); if it cannot be
  brought back, the job stops in one line;
- SIGTERM or SIGINT to the launcher is passed to every group's torchrun, which passes it to its processes
  (docs/preemption.md): they stop at an agreed step and save within :data:`STOP_GRACE_S`, torchrun's own grace;
  the launcher then exits with the status the groups agreed (75 for a requeue). SIGUSR1 (SLURM's warning before
  the time limit, ``#SBATCH --signal=USR1@90``) does the same, passed on as SIGTERM: torchrun passes on only
  TERM, INT, HUP and QUIT and dies of USR1, leaving its processes behind; the default ``stop_signals`` treat
  USR1 and TERM alike;
- whatever the launcher started (each group's torchrun, the lighthouse) gets SIGTERM from the kernel when the
  launcher dies without cleaning up (SIGKILL, a crash: ``PR_SET_PDEATHSIG``), so no group trains on unsupervised.

The command ends when every group has ended: 0 if all ended well; a group's exit status once it has failed
``--max-group-restarts`` times; 0 when a group fails while none is running but one already ended well (its
final state stands: the job's work is done); 1 if every group is down at once and none ended well (nothing
left to heal from: restart from a checkpoint instead). Each group is its own process session, killed with its
whole tree.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from ..backends.replica_groups import GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR, QUORUM_TIMEOUT, RESTARTS_VAR
from ..errors import UnifiedDistError
from ..training.preemption import REQUEUE_EXIT_CODE
from .commands import Command, Plan, environment
from .errors import UsageError
from .replica_child import STATUS_VAR, ready_port

HEARTBEAT_TIMEOUT_MS = 2000
"""How long the lighthouse waits for a silent group before the others go on without it (torchft's
default is 5000): the pause the survivors see when a group dies."""
JOIN_TIMEOUT_MS = 5000
"""How long the lighthouse waits for a group that still sends heartbeats but has not asked for the step's
quorum (hung, or in a long step of its own) before the others go on without it (torchft's default 60000);
``unified-dist launch --replica-join-timeout SECONDS`` sets it, below :data:`MAX_JOIN_TIMEOUT_S`."""
MAX_JOIN_TIMEOUT_S = QUORUM_TIMEOUT.total_seconds()
"""A join timeout must be shorter than the least a group's quorum waits
(:data:`unified_dist.backends.replica_groups.QUORUM_TIMEOUT`): else the groups that are on time give up first."""
QUORUM_RETRIES_VAR = "TORCHFT_QUORUM_RETRIES"
QUORUM_RETRIES = 10
"""How many times torchft asks the lighthouse again for a quorum that failed (its default: 0, and a group whose
quorum fails exits): a lighthouse that died and was started again answers the next time."""
STOP_GRACE_S = 30.0
"""How long the groups have to stop at an agreed step and save after a stop signal: torchrun's own grace for
its workers (docs/preemption.md), which it counts from when it passes the signal on."""
TORCHRUN_REPORT_S = 10.0
"""Beyond :data:`STOP_GRACE_S`, what torchrun may take to kill a late worker and exit before the launcher
kills the group's whole session."""
LIGHTHOUSE_START_S = 60.0
"""How long a lighthouse start (Python, torchft's import, the bind) may take before it counts as failed, and
how long a restart keeps trying a port that another program holds."""
LIGHTHOUSE_RESTARTS = 10
"""How many times the lighthouse is started again after it died, in one job."""
USAGE_EXIT_CODE = 2
"""A usage error's status (argparse's, ``unified-dist``'s, the examples')."""


@dataclass
class Ending:
    """How a group's start ended: its status, and whether it was a usage error (it would fail again)."""

    code: int
    usage: bool = False


@dataclass
class Group:
    """One replica group: its launch command and the process running it now."""

    index: int
    command: Command
    env: Dict[str, str]
    process: Optional[subprocess.Popen] = None
    restarts: int = 0
    exit_codes: List[int] = field(default_factory=list)
    nproc: int = 1
    status_root: Optional[Path] = None  # where its processes record how they ended (None: nothing recorded)

    def status_dir(self) -> Optional[Path]:
        """This start's folder of records (``None`` without a :attr:`status_root`)."""
        return None if self.status_root is None else self.status_root / f"group{self.index}" / f"start{self.restarts}"

    def start(self) -> None:
        env = {**self.env, RESTARTS_VAR: str(self.restarts)}
        folder = self.status_dir()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            env[STATUS_VAR] = str(folder)
        self.process = subprocess.Popen(list(self.command.argv), env=env, start_new_session=True,
                                        preexec_fn=end_with_launcher(os.getpid()))

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def signal(self, signum: int) -> None:
        """Send ``signum`` to the group's launcher (torchrun passes it to its processes)."""
        if self.running():
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                pass

    def ending(self) -> Ending:
        """How the start that has just ended ended, from its processes' records (:func:`ending_of`)."""
        assert self.process is not None and self.process.returncode is not None
        folder = self.status_dir()
        records = [] if folder is None else [json.loads(p.read_text()) for p in sorted(folder.glob("rank*.json"))]
        return ending_of(self.process.returncode, records, self.nproc)

    def kill(self) -> None:
        kill_session(self.process)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)
"""What the launcher takes as a stop (a preemption): passed to every group, :data:`PASSED_AS` says as what."""

PASSED_AS = {signal.SIGUSR1: signal.SIGTERM}
"""torchrun passes on only TERM, INT, HUP and QUIT (and dies of USR1 with its processes left running)."""


def end_with_launcher(launcher: int):
    """A ``preexec_fn``: the child gets SIGTERM from the kernel once the launcher (pid ``launcher``, whose only
    thread starts the children) has died, however it died (Linux's ``PR_SET_PDEATHSIG``; elsewhere nothing). A
    launcher that died between the fork and this call is caught by the parent check."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here: the child only calls it
    except (OSError, AttributeError):
        return None

    def arrange() -> None:
        prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        if os.getppid() != launcher:
            os.kill(os.getpid(), signal.SIGTERM)
    return arrange


def kill_session(process: Optional[subprocess.Popen]) -> None:
    """SIGKILL the session ``process`` leads (it was started with ``start_new_session``), if it still runs, and
    reap it."""
    if process is not None and process.poll() is None:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def status(returncode: int) -> int:
    """A process's exit status as a shell shows it (killed by signal N: 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


def ending_of(returncode: int, records: List[Dict[str, Any]], nproc: int) -> Ending:
    """How a group's start ended, from its launcher's ``returncode`` and its processes' ``records`` (one per
    process that ended through Python: ``{"code": status, "usage": bool}``) of its ``nproc``. torchrun exits 1
    whenever a process failed, whatever its status: the records give the status the processes agreed (every
    process's, such as 75 for a requeue), and a usage error in any of them."""
    if returncode == 0:
        return Ending(0)
    codes = {int(r["code"]) for r in records}
    if len(records) == nproc and len(codes) == 1 and codes != {0}:
        code = codes.pop()
        return Ending(code, usage=code == USAGE_EXIT_CODE or any(r.get("usage") for r in records))
    usage = [int(r["code"]) for r in records if r.get("usage") or int(r["code"]) == USAGE_EXIT_CODE]
    if usage:
        return Ending(usage[0], usage=True)
    return Ending(status(returncode), usage=status(returncode) == USAGE_EXIT_CODE)


# ---------------------------------------------------------------------- the lighthouse
def join_timeout_ms(seconds: Optional[float]) -> int:
    """``--replica-join-timeout``'s seconds as the lighthouse's milliseconds (``None``: :data:`JOIN_TIMEOUT_MS`);
    a value the groups' quorum would not outwait is a :class:`UsageError`."""
    if seconds is None:
        return JOIN_TIMEOUT_MS
    if not 0 < seconds < MAX_JOIN_TIMEOUT_S:
        raise UsageError(f"--replica-join-timeout {seconds:g}: give seconds above 0 and below {MAX_JOIN_TIMEOUT_S:g} "
                         "(the least a group's quorum waits: the groups on time would give up before the late one)")
    return max(1, round(seconds * 1000))


def lighthouse_flags(port: str, join_ms: int = JOIN_TIMEOUT_MS) -> List[str]:
    """The lighthouse's flags on ``port``: a quorum needs one group; a silent group is dropped after
    :data:`HEARTBEAT_TIMEOUT_MS`, a late one after ``join_ms`` (:data:`JOIN_TIMEOUT_MS`)."""
    return ["--min_replicas", "1", "--bind", f"[::]:{port}", "--quorum_tick_ms", "100",
            "--join_timeout_ms", str(join_ms), "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]


def lighthouse_command(port: int, join_ms: int = JOIN_TIMEOUT_MS) -> List[str]:
    """torchft's lighthouse on ``port`` (0: one the OS picks) in a process of its own, with
    ``torchft_lighthouse``'s flags: it prints :data:`~unified_dist.cli.replica_child.READY` and the port once bound."""
    return [sys.executable, "-m", "unified_dist.cli.replica_child", "lighthouse",
            *lighthouse_flags(str(port), join_ms)]


TOO_SLOW = "it did not listen within"


class LighthouseDown(UnifiedDistError):
    """The lighthouse could not be started (the message says why); the launcher turns it into its one line."""


@dataclass
class Lighthouse:
    """The lighthouse process the launcher started, and its log (every start appends to it)."""

    log: Path
    join_ms: int = JOIN_TIMEOUT_MS
    port: int = 0
    process: Optional[subprocess.Popen] = None
    restarts: int = 0

    @property
    def address(self) -> str:
        return f"http://localhost:{self.port}"

    def start(self) -> None:
        """Start it on :attr:`port` (0: a port the OS picks, then kept) and wait until it listens; a port that
        another program holds is tried again for :data:`LIGHTHOUSE_START_S`. Raises :class:`LighthouseDown`."""
        deadline = time.monotonic() + LIGHTHOUSE_START_S
        reason = ""
        while True:
            try:
                self._start_once(deadline)
                return
            except LighthouseDown as exc:
                if not reason or not str(exc).startswith(TOO_SLOW):  # why an earlier try exited says more
                    reason = str(exc)
                if self.port == 0 or time.monotonic() >= deadline:
                    raise LighthouseDown(reason) from None
                time.sleep(0.5)

    def _start_once(self, deadline: float) -> None:
        offset = self.log.stat().st_size if self.log.exists() else 0
        with open(self.log, "a") as out:
            self.process = subprocess.Popen(lighthouse_command(self.port, self.join_ms), stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=end_with_launcher(os.getpid()))
        while time.monotonic() < deadline:
            with open(self.log) as log:
                log.seek(offset)
                said = log.read()
            port = ready_port(said)
            if port is not None:
                self.port = port
                return
            if self.process.poll() is not None:
                last = [line for line in said.splitlines() if line.strip()]
                raise LighthouseDown(f"it exited with {status(self.process.returncode)}"
                                     + (f": {last[-1].strip()}" if last else ""))
            time.sleep(0.1)
        self.kill()
        raise LighthouseDown(f"{TOO_SLOW} {LIGHTHOUSE_START_S:g} s")

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def revive(self) -> Optional[str]:
        """Start it again on the same address after it died: ``None``, or the one line that says it could not."""
        code = status(self.process.returncode) if self.process is not None else None
        if self.restarts >= LIGHTHOUSE_RESTARTS:
            return (f"unified-dist launch: the torchft lighthouse exited with {code} after {self.restarts} restarts "
                    f"(log: {self.log}): stopping the job; restart it from its last checkpoint")
        self.restarts += 1
        print(f"unified-dist launch: the torchft lighthouse (pid {self.process.pid}) exited with {code}; starting it "
              f"again at {self.address} (restart {self.restarts} of {LIGHTHOUSE_RESTARTS}; log: {self.log})",
              file=sys.stderr, flush=True)
        try:
            self.start()
        except LighthouseDown as exc:
            return (f"unified-dist launch: the torchft lighthouse could not be started again at {self.address} ({exc}; "
                    f"log: {self.log}): stopping the job; restart it from its last checkpoint")
        print(f"unified-dist launch: the torchft lighthouse is back at {self.address} (pid {self.process.pid})",
              file=sys.stderr, flush=True)
        return None

    def kill(self) -> None:
        kill_session(self.process)


# ---------------------------------------------------------------------- a group's processes
RUNNER = ("-m", "unified_dist.cli.replica_child", "run")
"""What runs the script in each process of a group: it records how the process ended
(:func:`unified_dist.cli.replica_child.run_script`)."""


def with_runner(command: Command, plan: Plan) -> Command:
    """``command`` running ``plan.script`` through :data:`RUNNER`."""
    argv = list(command.argv)
    at = len(argv) - len(plan.script_args) - 1  # every builder ends with the script, then its arguments
    if argv[at] != plan.script:
        raise AssertionError(f"the script is not where the runner goes in {command.line()!r}")
    return Command((*argv[:at], *RUNNER, *argv[at:]), command.env, command.native)


# ---------------------------------------------------------------------- the launcher
def group_env(command: Command, index: int, groups: int, lighthouse: str,
              environ: Mapping[str, str] = os.environ, gpus: Optional[List[str]] = None,
              nproc: int = 1) -> Dict[str, str]:
    """Group ``index``'s environment: the launch command's, plus the replica-group variables (and torchft's
    :data:`QUORUM_RETRIES_VAR`, unless set), and its own
    ``nproc`` of ``gpus`` (this host's visible GPUs) where there are enough for every group, so the groups
    do not share GPUs."""
    env = environment(command, environ)
    env.update({LIGHTHOUSE_VAR: lighthouse, GROUP_VAR: str(index), GROUPS_VAR: str(groups)})
    env.setdefault(QUORUM_RETRIES_VAR, str(QUORUM_RETRIES))  # a quorum the lighthouse's death broke is asked again
    if gpus and len(gpus) >= groups * nproc:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[index * nproc:(index + 1) * nproc])
    return env


def visible_gpus(count: int, environ: Mapping[str, str] = os.environ) -> List[str]:
    """The GPUs this host shows the job: ``CUDA_VISIBLE_DEVICES``'s list where it is set, else 0..count-1."""
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [str(i) for i in range(count)]


def check_gpus(groups: int, nproc: int, count: int, environ: Mapping[str, str] = os.environ) -> Optional[List[str]]:
    """The GPUs the groups are given (``None`` on a host without one, ``count`` being torch's count); raises
    :class:`UsageError` where they would have to share GPUs (fewer than ``groups`` × ``nproc``)."""
    if not count:
        return None
    gpus = visible_gpus(count, environ)[:count]  # CUDA stops at the first listed device it cannot use
    if len(gpus) < groups * nproc:
        given = environ.get("CUDA_VISIBLE_DEVICES")
        shown = "" if given is None else f" (CUDA_VISIBLE_DEVICES={given})"
        raise UsageError(f"--replica-groups {groups} --nproc {nproc} needs {groups * nproc} GPUs, one per process, "
                         f"and this host shows {len(gpus)}{shown}: groups that shared GPUs would slow and starve one "
                         "another; use fewer groups or --nproc")
    return gpus


def describe(command: Command, groups: int, join_ms: int = JOIN_TIMEOUT_MS) -> str:
    """What ``--dry-run`` prints: the lighthouse, then one line per group, as a user would type them by hand
    (the launcher runs the same lighthouse through torchft's Python server, to learn its port, and each group's
    processes through :data:`RUNNER`, to learn how they ended)."""
    lines = [shlex.join(["torchft_lighthouse", *lighthouse_flags("PORT", join_ms)])]
    for index in range(groups):
        lines.append(f"{LIGHTHOUSE_VAR}=http://localhost:PORT {GROUP_VAR}={index} {GROUPS_VAR}={groups} "
                     + command.line())
    return "\n".join(lines)


def run(command: Command, groups: int, max_restarts: int, nproc: int = 1, gpu_count: int = 0,
        log_dir: Optional[str] = None, join_ms: int = JOIN_TIMEOUT_MS) -> int:
    """Start the lighthouse and ``groups`` groups running ``command`` (``nproc`` processes each, on this host's
    ``gpu_count`` GPUs); supervise them (at most ``max_restarts`` restarts of each group); return the job's exit
    status (the module doc). The lighthouse's log and the groups' records go to ``log_dir`` (default: a new
    folder in the temporary directory); ``join_ms``: the lighthouse's join timeout (:data:`JOIN_TIMEOUT_MS`)."""
    gpus = check_gpus(groups, nproc, gpu_count)
    if importlib.util.find_spec("torchft") is None:
        raise UsageError("--replica-groups needs torchft, which is not installed here: "
                         "pip install 'unified_dist[fault-tolerance]'")
    folder = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="unified-dist-replica-groups-"))
    folder.mkdir(parents=True, exist_ok=True)
    lighthouse = Lighthouse(folder / "lighthouse.log", join_ms)
    members: List[Group] = []
    stopping = {"signal": 0}

    def stop(signum, _frame) -> None:
        stopping["signal"] = stopping["signal"] or signum  # the first one counts; later ones change nothing

    previous = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        try:
            lighthouse.start()
        except LighthouseDown as exc:
            print(f"unified-dist launch: torchft's lighthouse did not start ({exc}; log: {lighthouse.log})",
                  file=sys.stderr, flush=True)
            return 1
        if stopping["signal"]:  # stopped while the lighthouse started: no group has anything to save
            return 128 + stopping["signal"]
        print(f"+ torchft lighthouse at {lighthouse.address} (pid {lighthouse.process.pid}, log {lighthouse.log}); "
              f"{groups} replica groups of: {command.line()}", file=sys.stderr, flush=True)
        members += [Group(i, command, group_env(command, i, groups, lighthouse.address, gpus=gpus, nproc=nproc),
                          nproc=nproc, status_root=folder / "status") for i in range(groups)]
        for member in members:
            member.start()
        return _watch(members, max_restarts, stopping, lighthouse)
    finally:
        for member in members:
            member.kill()
        lighthouse.kill()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _watch(members: List[Group], max_restarts: int, stopping: Dict[str, int],
           lighthouse: Optional[Lighthouse] = None) -> int:
    running = set(range(len(members)))
    ended_well: List[int] = []
    while running:
        if stopping["signal"]:
            return _stop(members, running, stopping["signal"], lighthouse)
        time.sleep(0.2)
        if lighthouse is not None and not lighthouse.alive():
            problem = lighthouse.revive()
            if problem:
                print(problem, file=sys.stderr, flush=True)
                return 1
        ended = [m for m in members if m.index in running and m.process.poll() is not None]
        for member in ended:
            code = member.process.returncode
            member.exit_codes.append(code)
            if code == 0:
                running.discard(member.index)
                ended_well.append(member.index)
                continue
            how = member.ending()
            if how.usage and member.restarts == 0:
                print(f"unified-dist launch: replica group {member.index} stopped on a usage error (exit status "
                      f"{how.code}); it would fail the same way again, so it is not started again: fix the command "
                      "or the script, then launch again", file=sys.stderr, flush=True)
                return how.code
            alive = [m.index for m in members if m.index in running and m.process.poll() is None]
            if not alive and ended_well:
                print(f"unified-dist launch: replica group {member.index} exited with {how.code} after replica group "
                      f"{ended_well[0]} ended well: group {ended_well[0]}'s final state stands, and the late restart "
                      "had nothing left to do", file=sys.stderr, flush=True)
                return 0
            if not alive:
                print(f"unified-dist launch: replica group {member.index} exited with {how.code} and no group is "
                      "running: nothing left to heal from; restart the job from its last checkpoint", file=sys.stderr,
                      flush=True)
                return 1
            if member.restarts >= max_restarts:
                print(f"unified-dist launch: replica group {member.index} exited with {how.code} after "
                      f"{member.restarts} restarts (--max-group-restarts {max_restarts}); stopping the job",
                      file=sys.stderr, flush=True)
                return how.code
            member.restarts += 1
            print(f"unified-dist launch: replica group {member.index} exited with {how.code}; starting it again "
                  f"(restart {member.restarts} of {max_restarts}), the other groups train on", file=sys.stderr,
                  flush=True)
            member.start()
    return 0


def _stop(members: List[Group], running: set, signum: int, lighthouse: Optional[Lighthouse]) -> int:
    """Pass ``signum`` to every running group, give them :data:`STOP_GRACE_S` to stop at an agreed step and
    save (the lighthouse kept up meanwhile), kill what is left; the status they agreed (docs/preemption.md)."""
    live = [m for m in members if m.index in running and m.running()]
    name = signal.Signals(signum).name
    passed = PASSED_AS.get(signum, signum)
    told = "it" if passed == signum else f"it as {signal.Signals(passed).name}"
    print(f"unified-dist launch: {name}: passing {told} to replica groups {', '.join(str(m.index) for m in live)}, "
          f"which have {STOP_GRACE_S:g} s to stop at an agreed step and save", file=sys.stderr, flush=True)
    for member in live:
        member.signal(passed)
    deadline = time.monotonic() + STOP_GRACE_S + TORCHRUN_REPORT_S
    while any(m.running() for m in live) and time.monotonic() < deadline:
        time.sleep(0.2)
        if lighthouse is not None and not lighthouse.alive():
            problem = lighthouse.revive()
            if problem:
                print(problem, file=sys.stderr, flush=True)
                break
    late = [m.index for m in live if m.running()]
    for member in live:
        member.kill()
    codes = {m.index: m.ending().code for m in live}
    if late:
        print(f"unified-dist launch: replica groups {', '.join(map(str, late))} did not stop within the grace: "
              "killed", file=sys.stderr, flush=True)
    agreed = set(codes.values())
    failed = {i: c for i, c in codes.items() if c not in (0, REQUEUE_EXIT_CODE)}
    if failed or not live:
        code = next(iter(failed.values()), 128 + signum)
        print(f"unified-dist launch: after {name}, replica groups ended with {codes}: not every group stopped at an "
              "agreed step and saved", file=sys.stderr, flush=True)
        return code
    code = REQUEUE_EXIT_CODE if REQUEUE_EXIT_CODE in agreed else 0
    print(f"unified-dist launch: after {name}, every replica group stopped and ended with {code}"
          + (" (saved for a requeue: run the job again to resume)" if code == REQUEUE_EXIT_CODE else ""),
          file=sys.stderr, flush=True)
    return code

