"""``unified-dist launch --replica-groups N``: N replica groups on this host that outlive one another.

It starts torchft's lighthouse (the ``torchft_lighthouse`` command that comes with torchft, on a free
port) and N copies of the torch launch command (``torchrun --standalone``: each group its own
rendezvous), each with ``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and ``NUM_REPLICA_GROUPS`` set
(:mod:`unified_dist.backends.replica_groups`). A group that exits with an error is started again, alone,
while the others train on; the new group heals from a live one at its first step. The command ends
when every group has ended: 0 if all ended well; a group's exit status once it has failed
``--max-group-restarts`` times; 1 if every group is down at once (nothing left to heal from: restart
from a checkpoint instead). Each group is its own process session, killed with its whole tree.
"""
from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional

from ..backends.replica_groups import GROUP_VAR, GROUPS_VAR, LIGHTHOUSE_VAR, RESTARTS_VAR
from ..net import free_port
from .errors import UsageError
from .launch import Command, environment

HEARTBEAT_TIMEOUT_MS = 2000
"""How long the lighthouse waits for a silent group before the others go on without it (torchft's
default is 5000): the pause the survivors see when a group dies."""
JOIN_TIMEOUT_MS = 5000
"""How long the lighthouse waits for a group that still sends heartbeats but has not asked for the step's
quorum (hung, or in a long step of its own) before the others go on without it (torchft's default 60000)."""


@dataclass
class Group:
    """One replica group: its launch command and the process running it now."""

    index: int
    command: Command
    env: Dict[str, str]
    process: Optional[subprocess.Popen] = None
    restarts: int = 0
    exit_codes: List[int] = field(default_factory=list)

    def start(self) -> None:
        env = {**self.env, RESTARTS_VAR: str(self.restarts)}
        self.process = subprocess.Popen(list(self.command.argv), env=env, start_new_session=True)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()


def lighthouse_flags(port: str) -> List[str]:
    """The lighthouse's flags on ``port``: a quorum needs one group; a silent group is dropped after
    :data:`HEARTBEAT_TIMEOUT_MS`, a late one after :data:`JOIN_TIMEOUT_MS`."""
    return ["--min_replicas", "1", "--bind", f"[::]:{port}", "--quorum_tick_ms", "100",
            "--join_timeout_ms", str(JOIN_TIMEOUT_MS), "--heartbeat_timeout_ms", str(HEARTBEAT_TIMEOUT_MS)]


def lighthouse_command(port: int, environ: Mapping[str, str] = os.environ) -> List[str]:
    """torchft's lighthouse (the ``torchft_lighthouse`` its package installs) on ``port``."""
    path = shutil.which("torchft_lighthouse", path=environment(Command(()), environ)["PATH"])
    if path is None:
        raise UsageError("--replica-groups needs torchft's lighthouse (torchft_lighthouse), which is not installed "
                         "here: pip install 'unified_dist[fault-tolerance]' (torchft)")
    return [path, *lighthouse_flags(str(port))]


def group_env(command: Command, index: int, groups: int, lighthouse: str,
              environ: Mapping[str, str] = os.environ, gpus: Optional[List[str]] = None,
              nproc: int = 1) -> Dict[str, str]:
    """Group ``index``'s environment: the launch command's, plus the replica-group variables, and its own
    ``nproc`` of ``gpus`` (this host's visible GPUs) where there are enough for every group, so the groups
    do not share GPUs."""
    env = environment(command, environ)
    env.update({LIGHTHOUSE_VAR: lighthouse, GROUP_VAR: str(index), GROUPS_VAR: str(groups)})
    if gpus and len(gpus) >= groups * nproc:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus[index * nproc:(index + 1) * nproc])
    return env


def visible_gpus(count: int, environ: Mapping[str, str] = os.environ) -> List[str]:
    """The GPUs this host shows the job: ``CUDA_VISIBLE_DEVICES``'s list where it is set, else 0..count-1."""
    given = environ.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        return [d.strip() for d in given.split(",") if d.strip()]
    return [str(i) for i in range(count)]


def describe(command: Command, groups: int) -> str:
    """The commands ``--dry-run`` prints: the lighthouse, then one line per group."""
    lines = [shlex.join(["torchft_lighthouse", *lighthouse_flags("PORT")])]
    for index in range(groups):
        lines.append(f"{LIGHTHOUSE_VAR}=http://localhost:PORT {GROUP_VAR}={index} {GROUPS_VAR}={groups} "
                     + command.line())
    return "\n".join(lines)


def run(command: Command, groups: int, max_restarts: int, nproc: int = 1, gpu_count: int = 0) -> int:
    """Start the lighthouse and ``groups`` groups running ``command`` (``nproc`` processes each, on this host's
    ``gpu_count`` GPUs); restart a group that fails (at most ``max_restarts`` times each); return the job's
    exit status (the module doc)."""
    port = free_port()
    lighthouse = subprocess.Popen(lighthouse_command(port), start_new_session=True,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    address = f"http://localhost:{port}"
    print(f"+ torchft lighthouse at {address} (pid {lighthouse.pid}); {groups} replica groups of: {command.line()}",
          file=sys.stderr, flush=True)
    gpus = visible_gpus(gpu_count) if gpu_count else None
    members = [Group(i, command, group_env(command, i, groups, address, gpus=gpus, nproc=nproc))
               for i in range(groups)]
    stopping = {"signal": 0}

    def stop(signum, _frame) -> None:
        stopping["signal"] = signum

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        for member in members:
            member.start()
        return _watch(members, max_restarts, stopping)
    finally:
        for member in members:
            member.kill()
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _watch(members: List[Group], max_restarts: int, stopping: Dict[str, int]) -> int:
    running = set(range(len(members)))
    while running:
        if stopping["signal"]:
            return 128 + stopping["signal"]
        time.sleep(0.2)
        ended = [m for m in members if m.index in running and m.process.poll() is not None]
        for member in ended:
            code = member.process.returncode
            member.exit_codes.append(code)
            if code == 0:
                running.discard(member.index)
                continue
            alive = [m.index for m in members if m.index in running and m.process.poll() is None]
            if not alive:
                print(f"unified-dist launch: replica group {member.index} exited with {code} and no group is "
                      "running: nothing left to heal from; restart the job from its last checkpoint", file=sys.stderr,
                      flush=True)
                return 1
            if member.restarts >= max_restarts:
                print(f"unified-dist launch: replica group {member.index} exited with {code} after "
                      f"{member.restarts} restarts (--max-group-restarts {max_restarts}); stopping the job",
                      file=sys.stderr, flush=True)
                return code if code > 0 else 128 - code
            member.restarts += 1
            print(f"unified-dist launch: replica group {member.index} exited with {code}; starting it again "
                  f"(restart {member.restarts} of {max_restarts}), the other groups train on", file=sys.stderr,
                  flush=True)
            member.start()
    return 0
