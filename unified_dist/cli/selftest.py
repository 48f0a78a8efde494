"""``unified-dist test``: the self-test under each backend's real launcher, or (``--gpu``) every CUDA path
on this machine's GPU.

The command reads the options, builds each launch as ``unified-dist launch`` would (:mod:`.launch`) and
prints; the checks and their runners live in :mod:`unified_dist.checks` (:mod:`~unified_dist.checks.selftest`
and its worker, :mod:`~unified_dist.checks.contract`; :mod:`~unified_dist.checks.gpu` and
:mod:`~unified_dist.checks.gpu_checks`).
"""
from __future__ import annotations

import json
import sys
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..backends.ports import free_port
from ..checks import gpu, selftest
from ..checks.processes import installed
from ..registry import SPECS
from . import launch
from .errors import UsageError

DEFAULT_TIMEOUT_S = 240.0


def choose_backends(requested: Optional[Sequence[str]]) -> List[str]:
    """``--backend`` values (repeatable, comma lists) in the order given, or every installed backend that runs
    the self-test (:attr:`~unified_dist.registry.BackendSpec.selftest`)."""
    if not requested:
        return [b for b in launch.BACKENDS if installed(b) and SPECS[b].selftest]
    chosen: List[str] = []
    for name in (part.strip() for item in requested for part in item.split(",")):
        if name not in launch.BACKENDS:
            raise UsageError(f"unknown backend {name!r}; choose from {', '.join(launch.BACKENDS)}")
        if not installed(name):
            raise UsageError(f"backend {name!r} is not installed here; {launch.INSTALL_FIX[name]}")
        if name not in chosen:
            chosen.append(name)
    return chosen


def run_backend(backend: str, nproc: int, timeout: float, cuda: bool = False) -> selftest.BackendRun:
    """The self-test under ``backend``'s launcher, with the command ``unified-dist launch`` would run
    (printed on stderr)."""

    def command(worker_args: Tuple[str, ...], clean: Dict[str, str]) -> Tuple[Sequence[str], Mapping[str, str]]:
        plan = launch.Plan(backend=backend, script=str(selftest.WORKER), nproc=nproc, master_port=free_port(),
                           script_args=worker_args)
        built = launch.build(plan, cuda=cuda, environ={})
        print(f"+ {built.line()}", file=sys.stderr, flush=True)
        return built.argv, launch.environment(built, clean)

    return selftest.run_backend(backend, nproc, timeout, command, launch.LAUNCHER_OF[backend])


# ---------------------------------------------------------------------- subcommand
def add_arguments(parser) -> None:
    """The ``test`` subcommand's options."""
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help=f"{', '.join(launch.BACKENDS)}; repeat or comma-separate (default: every installed one)")
    parser.add_argument("--nproc", type=int, default=2, metavar="N", help="processes per launch (default 2)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help=f"seconds per launch before its processes are killed (default {DEFAULT_TIMEOUT_S:g}); "
                             f"with --gpu, the whole run's (default {gpu.DEFAULT_TOTAL_S:g})")
    options = parser.add_argument_group("GPU checks (make gpu-check)")
    options.add_argument("--gpu", action="store_true",
                         help="instead: check every CUDA path on this machine's GPU (FSDP2, HSDP, TP, pinned offload, "
                              "host syncs, compile, fp16, CUDA RNG, SyncBatchNorm) and write a results file; "
                              "without a GPU say so and exit 0")
    options.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                         help="with --gpu: cpu runs every check's code on the CPU (a dry run; default cuda)")
    options.add_argument("--only", metavar="NAMES",
                         help=f"with --gpu: these checks (comma list of {', '.join(gpu.NAMES)})")
    options.add_argument("--results", metavar="FILE",
                         help="with --gpu: the results file (default bench/gpu/results/gpu_check_<date>.json on a GPU)")


def main(args) -> int:
    """Run the self-test under every chosen backend (or the GPU checks, ``--gpu``); 0 if every row passed, else 1."""
    if args.gpu:
        return gpu_main(args)
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
    print(selftest.table(rows))
    for run in runs:
        if not run.passed and run.log_tail:
            print(f"\n{run.backend}: last lines of the launcher's output", file=sys.stderr)
            print("\n".join(f"  {line}" for line in run.log_tail.splitlines()), file=sys.stderr)
    failed = sum(row.status != "pass" for row in rows)
    print(f"\n{len(rows) - failed} of {len(rows)} passed"
          + (f", {failed} failed" if failed
             else f" ({', '.join(backends)}; {args.nproc} process{'es' if args.nproc > 1 else ''} each)"))
    return 1 if failed else 0


def choose_gpu_checks(only: Optional[str]) -> List[str]:
    """``--only``'s names (every GPU check without it)."""
    if not only:
        return list(gpu.NAMES)
    names = [n.strip() for n in only.split(",") if n.strip()]
    unknown = [n for n in names if n not in gpu.NAMES]
    if unknown:
        raise UsageError(f"unknown GPU check(s) {', '.join(unknown)}; choose from {', '.join(gpu.NAMES)}")
    return names


def gpu_main(args) -> int:
    """``unified-dist test --gpu``: 0 if every check passed (or was skipped), or when there is no GPU."""
    names = choose_gpu_checks(args.only)
    total = gpu.DEFAULT_TOTAL_S if args.timeout is None else args.timeout
    if total <= 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {total:g}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("unified-dist test --gpu: no CUDA GPU here (torch.cuda.is_available() is False): nothing to check "
              "(--device cpu runs the checks' code on the CPU)")
        return 0
    record = gpu.run(names, args.device, total)
    print(gpu.table(record["checks"]))
    failed = record["total"] - record["passed"]
    print(f"\n{record['passed']} of {record['total']} passed on {record['device']}"
          + (f", {failed} failed" if failed else "") + f" ({record['wall_s']:.0f}s)")
    path = gpu.default_results_path(args.device, args.results)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"results: {path}")
    return 1 if failed else 0
