"""What the replica-group launch tests (tests/launchers/test_replica_groups*.py) and their workers
(tests/launchers/workers/replica_*.py) share.

- :class:`Records`: a worker process's events, one JSON line each in ``<out>/group<G>_rank<R>.jsonl``;
  :func:`events` reads them back.
- :func:`launch_command`: ``unified-dist launch --replica-groups N`` of a script, as a user types it.
- :class:`Launch`: a launch in the background with its output in a file, for a test that acts on it mid-run
  (kills a process, signals the launcher) and reads what it said.
- :func:`lighthouse_by_hand` and :func:`group_env`: the several-hosts recipe of docs/fault-tolerance.md on this
  host: torchft's lighthouse started by hand, and the variables of each group started by hand.

Importing this module imports no torch (the workers import it before ``unified_dist``'s first use).
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence

from ..backends.ports import free_port
from .launchers import BIN, ROOT, child_env, kill_session

GROUP_VAR = "REPLICA_GROUP_ID"  # the launcher's names (unified_dist.backends.replica_groups), spelled as users do


# ---------------------------------------------------------------------- a worker's records
class Records:
    """One process's events in ``<out>/group<G>_rank<R>.jsonl`` (``G``: its ``REPLICA_GROUP_ID``, 0 without
    replica groups; ``R``: ``rank``): ``record(event="step", ...)`` appends one JSON line with the process's pid
    and the time, so that the lines of a group started again tell its two processes apart."""

    def __init__(self, out: str, rank: int) -> None:
        self.group = int(os.environ.get(GROUP_VAR, "0"))
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / f"group{self.group}_rank{rank}.jsonl"

    def __call__(self, **event) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "t": time.time(), **event}) + "\n")

    def once(self, name: str) -> bool:
        """True for the first process of the job to ask for ``name`` (a marker file ``<out>/<name>.done``), False
        after: a kill or a hang that a restarted group must not repeat."""
        try:
            (self.out / f"{name}.done").touch(exist_ok=False)
            return True
        except FileExistsError:
            return False


def events(folder: Path, group: int, rank: int = 0) -> List[dict]:
    """The events :class:`Records` wrote for ``group``'s rank ``rank`` in ``folder``, in order."""
    return [json.loads(line) for line in (folder / f"group{group}_rank{rank}.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------- the launcher
def launch_command(script_and_args: Sequence[str], groups: int = 2, nproc: int = 1,
                   flags: Sequence[str] = ()) -> List[str]:
    """``unified-dist launch --nproc NPROC --replica-groups GROUPS FLAGS SCRIPT ARGS``."""
    return [str(BIN / "unified-dist"), "launch", "--nproc", str(nproc), "--replica-groups", str(groups), *flags,
            *map(str, script_and_args)]


class Launch:
    """``cmd`` running in the background in a session of its own, its output (stderr merged) in ``log``; ``out``:
    where its script writes (for the test to read). Use it as a context manager: its whole process tree is killed
    at the end of the block, however the test ends."""

    def __init__(self, cmd: Sequence[str], log: Path, env: Optional[Dict[str, str]] = None,
                 out: Optional[Path] = None) -> None:
        self.cmd, self.log, self.out = list(cmd), log, out
        with open(log, "w") as out:
            self.process = subprocess.Popen(self.cmd, env=env or child_env(), stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, cwd=ROOT)

    def __enter__(self) -> "Launch":
        return self

    def __exit__(self, *exc) -> None:
        kill_session(self.process.pid)

    @property
    def output(self) -> str:
        return self.log.read_text()

    def _first_line(self) -> re.Match:
        said = re.search(r"\+ torchft lighthouse at (http://localhost:(\d+)) \(pid (\d+), log (\S+)/lighthouse.log\)",
                         self.output)
        assert said, f"the launcher has not named its lighthouse yet:\n{self.output[-4000:]}"
        return said

    @property
    def run_dir(self) -> Path:
        """The run's folder, as the launcher's first line names it."""
        return Path(self._first_line()[4])

    @property
    def lighthouse(self) -> str:
        """The lighthouse's address, as the launcher's first line names it."""
        return self._first_line()[1]

    @property
    def lighthouse_pid(self) -> int:
        return int(self._first_line()[3])

    def worker(self, group: int, local_rank: int = 0) -> int:
        """The pid of the process of ``group`` with ``local_rank`` that runs the script now (torchrun's worker,
        not torchrun): found among the launcher's descendants by the variables torchrun and the launcher set."""
        import psutil

        for child in psutil.Process(self.process.pid).children(recursive=True):
            with contextlib.suppress(psutil.Error):
                env = child.environ()
                if env.get(GROUP_VAR) == str(group) and env.get("LOCAL_RANK") == str(local_rank) \
                        and child.status() != psutil.STATUS_ZOMBIE:
                    return child.pid
        raise AssertionError(f"no process of replica group {group} with local rank {local_rank} runs now")

    def wait_for(self, condition: Callable[[], bool], limit: float, what: str, every: float = 0.2) -> None:
        """Look at ``condition()`` every ``every`` seconds until it holds; fail if the launch ends first or
        ``limit`` seconds pass."""
        deadline = time.monotonic() + limit
        while not condition():
            assert self.process.poll() is None, f"the launch ended ({self.process.returncode}) before {what}:\n" \
                                                f"{self.output[-4000:]}"
            assert time.monotonic() < deadline, f"no {what} within {limit:g} s:\n{self.output[-4000:]}"
            time.sleep(every)

    def wait(self, limit: float) -> int:
        """The launch's exit status; the test fails if it has not ended within ``limit`` seconds."""
        try:
            return self.process.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            import pytest  # only tests call this

            pytest.fail(f"the launch did not end within {limit:g} s:\n{self.output[-4000:]}", pytrace=False)


def heartbeats(address: str) -> str:
    """The list of replica ids the lighthouse at ``address`` has had heartbeats from (its status page)."""
    import urllib.request

    direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # localhost, whatever http_proxy says
    with direct.open(f"{address}/status", timeout=10) as page:
        text = page.read().decode()
    return text[text.find("Heartbeats"):]


# ---------------------------------------------------------------------- groups started by hand
LIGHTHOUSE_FLAGS = ("--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "5000",
                    "--heartbeat_timeout_ms", "2000")
"""The flags docs/fault-tolerance.md gives ``torchft_lighthouse`` (besides ``--bind``)."""


@contextlib.contextmanager
def lighthouse_by_hand() -> Iterator[str]:
    """``torchft_lighthouse`` with the docs' flags on a free port for the block, as one starts it for groups on
    several hosts; yields its address, and kills it after."""
    port = free_port()
    lighthouse = subprocess.Popen([str(BIN / "torchft_lighthouse"), *LIGHTHOUSE_FLAGS, "--bind", f"[::]:{port}"],
                                  start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://localhost:{port}"
    finally:
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()


def group_env(lighthouse: str, group: int, groups: int, restarts: int = 0,
              extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The environment of replica group ``group`` of ``groups`` started by hand (docs/fault-tolerance.md): the
    lighthouse's address, the group, their count, and ``REPLICA_GROUP_RESTARTS`` (1 for a group started again)."""
    return child_env({**(extra or {}), "TORCHFT_LIGHTHOUSE": lighthouse, GROUP_VAR: str(group),
                      "NUM_REPLICA_GROUPS": str(groups), "REPLICA_GROUP_RESTARTS": str(restarts)})
