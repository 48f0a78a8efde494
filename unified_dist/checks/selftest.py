"""The self-test ``unified-dist test`` runs: every collective and a training step, under one backend's
real launcher, as a table of rows.

:func:`run_backend` launches ``selftest_worker.py`` (which runs :data:`.contract.CHECKS` in every
rank) with the command its caller builds (:mod:`unified_dist.cli.selftest` builds the one
``unified-dist launch`` would run, a free port where the launcher takes one), in its own process
group, and kills that group when the timeout expires, so a hang is a failure rather than a stuck
terminal. The ranks write their results to a temporary folder; :func:`rows_of` merges them into one
row per check. The command prints :func:`table` and exits 1 if any row did not pass.

This module imports no torch (the command line's start reads it).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from .processes import clean_environment, kill_tree

WORKER = Path(__file__).with_name("selftest_worker.py")
"""The script every rank runs (``--out DIR --backend NAME --world-size N``)."""

Launch = Callable[[Tuple[str, ...], Dict[str, str]], Tuple[Sequence[str], Mapping[str, str]]]
"""``(the worker's arguments, a clean environment) -> (argv, environment)`` of the launch that runs
:data:`WORKER` with those arguments under a backend's launcher."""


@dataclass
class Row:
    """One line of the table."""

    backend: str
    check: str
    status: str  # "pass", "FAIL", "hung" (still running when the launch was killed) or "not run"
    seconds: Optional[float] = None
    detail: str = ""


@dataclass
class BackendRun:
    """The outcome of one backend's launch."""

    backend: str
    rows: List[Row]
    log_tail: str

    @property
    def passed(self) -> bool:
        return all(row.status == "pass" for row in self.rows)


def rows_of(backend: str, out: Path, nproc: int, finished: bool) -> List[Row]:
    """Merge the ranks' result files in ``out``: a check passes only if every rank passed it; ``finished``:
    the launch ended by itself (a check still running in a killed launch is ``hung``)."""
    from .contract import CHECKS  # imports torch: only once a launch has run

    ranks: Dict[int, Dict] = {}
    for r in range(nproc):
        path = out / f"rank{r}.json"
        if path.exists():
            ranks[r] = json.loads(path.read_text())["checks"]
    rows = []
    for name in ["init", *(check.__name__ for check in CHECKS)]:
        per_rank = {r: checks.get(name) for r, checks in ranks.items()}
        failures = [f"rank {r}: {c['error']}" for r, c in per_rank.items() if c and c["status"] == "fail"]
        running = [r for r, c in per_rank.items() if c and c["status"] == "running"]
        silent = [r for r in range(nproc) if r not in ranks]
        not_reached = [r for r in ranks if not per_rank.get(r)]
        seconds = max((c["seconds"] for c in per_rank.values() if c and c["status"] != "running"), default=None)
        if failures:
            rows.append(Row(backend, name, "FAIL", seconds, failures[0]))
        elif running:
            rows.append(Row(backend, name, "hung" if not finished else "FAIL", None,
                            f"ranks {running} never finished it"))
        elif silent or not_reached:
            why = [f"ranks {not_reached} never reached it"] if not_reached else []
            why += [f"ranks {silent} wrote no results"] if silent else []
            rows.append(Row(backend, name, "not run", None, "; ".join(why)))
        else:
            rows.append(Row(backend, name, "pass", seconds))
    return rows


def run_backend(backend: str, nproc: int, timeout: float, launch: Launch, launcher: str) -> BackendRun:
    """Launch the worker with ``launch``'s command (``launcher`` names it in the first row) and collect its rows
    (the launch itself first)."""
    with tempfile.TemporaryDirectory(prefix=f"unified-dist-test-{backend}-") as tmp:
        out = Path(tmp)
        argv, env = launch(("--out", str(out), "--backend", backend, "--world-size", str(nproc)),
                           clean_environment(timeout))
        log_path = out / "launcher.log"
        start = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(list(argv), env=dict(env), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                code: Optional[int] = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            finally:
                if proc.poll() is None:  # timed out or interrupted (Ctrl-C)
                    kill_tree(proc.pid)
                    proc.wait()
                else:  # stragglers of a finished launch, if any, are still in its group
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
        wall = time.perf_counter() - start
        launcher = f"{launcher}, {nproc} process{'es' if nproc > 1 else ''}"
        if code is None:
            first = Row(backend, "launch", "FAIL", wall, f"{launcher}: timed out after {timeout:g}s (killed)")
        elif code != 0:
            first = Row(backend, "launch", "FAIL", wall, f"{launcher}: exit status {code}")
        else:
            first = Row(backend, "launch", "pass", wall, launcher)
        rows = [first, *rows_of(backend, out, nproc, finished=code is not None)]
        lines = log_path.read_text(errors="replace").splitlines()
        return BackendRun(backend, rows, "\n".join(lines[-20:]))


def table(rows: Sequence[Row]) -> str:
    """The pass/fail table."""
    lines = [f"{'backend':<12}{'check':<20}{'result':<9}{'seconds':>8}  detail"]
    for row in rows:
        seconds = f"{row.seconds:.2f}" if row.seconds is not None else "-"
        detail = row.detail if len(row.detail) <= 160 else row.detail[:157] + "..."
        lines.append(f"{row.backend:<12}{row.check:<20}{row.status:<9}{seconds:>8}  {detail}".rstrip())
    return "\n".join(lines)
