"""``unified-dist test``: every collective and a training step, under each backend's real launcher.

For each backend, :func:`run_backend` launches ``selftest_worker.py`` with the command
:mod:`.launch` builds (a free port where the launcher takes one), in its own process group,
and kills that group when the timeout expires, so a hang is a failure rather than a stuck
terminal. The ranks write their results to a temporary folder; :func:`main` prints one table
row per backend and check, and exits 1 if any row did not pass.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..backends.ports import free_port
from ..registry import SPECS
from . import gpu_check, launch
from .errors import UsageError
from .processes import clean_environment, kill_tree

WORKER = Path(__file__).with_name("selftest_worker.py")
PACKAGE_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_S = 240.0


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


def installed(backend: str) -> bool:
    """The backend's library and its launcher are present (whether they work is what the test finds out)."""
    library = SPECS[backend].library
    has_library = library is None or importlib.util.find_spec(library) is not None
    return has_library and launch.find_launcher(backend) is not None


def choose_backends(requested: Optional[Sequence[str]]) -> List[str]:
    """``--backend`` values (repeatable, comma lists) in the order given, or every installed backend."""
    if not requested:
        return [b for b in launch.BACKENDS if installed(b)]
    chosen: List[str] = []
    for name in (part.strip() for item in requested for part in item.split(",")):
        if name not in launch.BACKENDS:
            raise UsageError(f"unknown backend {name!r}; choose from {', '.join(launch.BACKENDS)}")
        if not installed(name):
            raise UsageError(f"backend {name!r} is not installed here; {launch.INSTALL_FIX[name]}")
        if name not in chosen:
            chosen.append(name)
    return chosen


def _rows(backend: str, out: Path, nproc: int, finished: bool) -> List[Row]:
    """Merge the ranks' result files: a check passes only if every rank passed it."""
    from .contract import CHECKS

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


def run_backend(backend: str, nproc: int, timeout: float, cuda: bool = False) -> BackendRun:
    """Launch the worker under ``backend``'s launcher and collect its rows (the launch itself first)."""
    with tempfile.TemporaryDirectory(prefix=f"unified-dist-test-{backend}-") as tmp:
        out = Path(tmp)
        plan = launch.Plan(backend=backend, script=str(WORKER), nproc=nproc, master_port=free_port(),
                           script_args=("--out", str(out), "--backend", backend, "--world-size", str(nproc)))
        command = launch.build(plan, cuda=cuda, environ={})
        print(f"+ {command.line()}", file=sys.stderr, flush=True)
        log_path = out / "launcher.log"
        start = time.perf_counter()
        with open(log_path, "w") as log:
            proc = subprocess.Popen(list(command.argv), env=launch.environment(command, clean_environment(timeout)),
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
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
        launcher = f"{launch.LAUNCHER_OF[backend]}, {nproc} process{'es' if nproc > 1 else ''}"
        if code is None:
            first = Row(backend, "launch", "FAIL", wall, f"{launcher}: timed out after {timeout:g}s (killed)")
        elif code != 0:
            first = Row(backend, "launch", "FAIL", wall, f"{launcher}: exit status {code}")
        else:
            first = Row(backend, "launch", "pass", wall, launcher)
        rows = [first, *_rows(backend, out, nproc, finished=code is not None)]
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


# ---------------------------------------------------------------------- subcommand
def add_arguments(parser) -> None:
    """The ``test`` subcommand's options."""
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help=f"{', '.join(launch.BACKENDS)}; repeat or comma-separate (default: every installed one)")
    parser.add_argument("--nproc", type=int, default=2, metavar="N", help="processes per launch (default 2)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help=f"seconds per launch before its processes are killed (default {DEFAULT_TIMEOUT_S:g}); "
                             f"with --gpu, the whole run's (default {gpu_check.DEFAULT_TOTAL_S:g})")
    gpu = parser.add_argument_group("GPU checks (make gpu-check)")
    gpu.add_argument("--gpu", action="store_true",
                     help="instead: check every CUDA path on this machine's GPU (FSDP2, HSDP, TP, pinned offload, "
                          "host syncs, compile, fp16, CUDA RNG, SyncBatchNorm) and write a results file; "
                          "without a GPU say so and exit 0")
    gpu.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                     help="with --gpu: cpu runs every check's code on the CPU (a dry run; default cuda)")
    gpu.add_argument("--only", metavar="NAMES",
                     help=f"with --gpu: these checks (comma list of {', '.join(gpu_check.NAMES)})")
    gpu.add_argument("--results", metavar="FILE",
                     help="with --gpu: the results file (default bench/results/gpu_check_<date>.json on a GPU)")


def main(args) -> int:
    """Run the self-test under every chosen backend (or the GPU checks, ``--gpu``); 0 if every row passed, else 1."""
    if args.gpu:
        return gpu_check.main(args)
    given = [flag for flag, value in (("--device", args.device != "cuda"), ("--only", args.only),
                                      ("--results", args.results)) if value]
    if given:
        raise UsageError(f"{', '.join(given)} go with --gpu (unified-dist test --gpu {given[0]} ...)")
    args.timeout = DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout
    if args.nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {args.nproc}")
    if args.timeout <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    backends = choose_backends(args.backend)
    import torch  # after the usage checks: only asked whether there is a GPU

    runs = [run_backend(b, args.nproc, args.timeout, cuda=torch.cuda.is_available()) for b in backends]
    rows = [row for run in runs for row in run.rows]
    print(table(rows))
    for run in runs:
        if not run.passed and run.log_tail:
            print(f"\n{run.backend}: last lines of the launcher's output", file=sys.stderr)
            print("\n".join(f"  {line}" for line in run.log_tail.splitlines()), file=sys.stderr)
    failed = sum(row.status != "pass" for row in rows)
    print(f"\n{len(rows) - failed} of {len(rows)} passed"
          + (f", {failed} failed" if failed
             else f" ({', '.join(backends)}; {args.nproc} process{'es' if args.nproc > 1 else ''} each)"))
    return 1 if failed else 0
