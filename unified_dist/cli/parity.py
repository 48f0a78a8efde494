"""``unified-dist parity``: run one training script under several launchers and compare their
metrics step by step.

    unified-dist parity examples/bert_sentiment/train.py \\
        --run torch=torch:2 --run accelerate=accelerate:2 --run horovod=horovod:2 \\
        --rtol 1e-5 -- --no-dropout --max-steps 6

Each ``--run NAME=SPEC`` is ``python``, ``python:1`` or ``BACKEND:N`` (torch, accelerate, horovod),
optionally followed by extra script arguments (``--run "accum=python:1 --grad-accum 2"``).
Every run writes to ``OUT/NAME`` (passed as ``--output-dir``) and must leave a ``metrics.jsonl``
with ``{"type": "train", "step", "loss"}`` and ``{"type": "eval", "accuracy", ...}`` lines. The
first run is the reference. Prints a table of the largest differences and exits 1 past the
tolerances, 2 when a run or its metrics are missing (``--compare DIR ...`` compares existing
output directories without running). The words after the first ``--`` go to every run.

The comparison itself (reading ``metrics.jsonl``, the differences, the table) is
:mod:`unified_dist.checks.parity`.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from ..checks.parity import compare, read_metrics, table
from ..registry import LAUNCHED
from .errors import UsageError

SCRIPT_ARGS_AFTER_DASHES = True
"""``unified-dist`` hands this subcommand the words after the first ``--`` as ``args.script_args``."""


@dataclass
class RunSpec:
    name: str
    backend: str  # "python" or a backend with a launcher
    nproc: int
    extra: Tuple[str, ...]


def parse_run(text: str) -> RunSpec:
    """``NAME=SPEC [extra args]`` -> :class:`RunSpec`; one-line ValueError on bad input."""
    if "=" not in text:
        raise ValueError(f"--run {text!r}: expected NAME=SPEC, e.g. torch=torch:2")
    name, rest = text.split("=", 1)
    words = shlex.split(rest)
    if not name or not words:
        raise ValueError(f"--run {text!r}: expected NAME=SPEC, e.g. torch=torch:2")
    backend, _, count = words[0].partition(":")
    if backend not in ("python", *LAUNCHED):
        raise ValueError(f"--run {text!r}: unknown launcher {backend!r}; use python or one of {', '.join(LAUNCHED)}")
    try:
        nproc = int(count) if count else 1
    except ValueError:
        raise ValueError(f"--run {text!r}: process count {count!r} is not an integer") from None
    if nproc < 1 or (backend == "python" and nproc != 1):
        raise ValueError(f"--run {text!r}: python runs 1 process; launchers need N >= 1")
    return RunSpec(name, backend, nproc, tuple(words[1:]))


def command_for(spec: RunSpec, script: str, args: Sequence[str]) -> Tuple[List[str], Dict[str, str]]:
    """The native command (same as ``unified-dist launch`` prints) and its environment."""
    if spec.backend == "python":
        return [sys.executable, script, *args], dict(os.environ)
    from ..backends.ports import free_port
    from . import launch

    plan = launch.Plan(backend=spec.backend, script=script, script_args=tuple(args), nproc=spec.nproc,
                       master_port=free_port())
    command = launch.build(plan)
    return list(command.argv), launch.environment(command)


def add_arguments(parser) -> None:
    """The ``parity`` subcommand's options (the script's own arguments follow ``--``)."""
    parser.epilog = "Arguments after -- go to the training script, in every run."
    parser.add_argument("script", nargs="?", help="training script (omit with --compare)")
    parser.add_argument("--run", action="append", default=[], metavar="NAME=SPEC",
                        help="a launch; the first is the reference")
    parser.add_argument("--compare", nargs="+", metavar="DIR", help="compare existing output dirs (first = reference)")
    parser.add_argument("--out", default="runs/parity", help="parent of each run's --output-dir")
    parser.add_argument("--rtol", type=float, default=1e-5, help="largest relative loss difference allowed per step")
    parser.add_argument("--eval-atol", type=float, default=0.0, help="largest eval metric difference allowed")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per run before it is killed")
    parser.add_argument("--output-flag", default="--output-dir", help="the script's output directory flag")


def _run_all(args) -> List[Tuple[str, str]]:
    """Run every ``--run`` in turn; (name, output directory) of each."""
    if not args.script or len(args.run) < 2:
        raise UsageError("give a script and at least two --run, or --compare DIR DIR ...")
    if not os.path.isfile(args.script):
        raise ValueError(f"script {args.script!r} does not exist")
    dirs = []
    for spec in [parse_run(r) for r in args.run]:
        out = os.path.join(args.out, spec.name)
        cmd, env = command_for(spec, args.script, [*args.script_args, *spec.extra, args.output_flag, out])
        print(f"+ {shlex.join(cmd)}", flush=True)
        start = time.monotonic()
        proc = subprocess.run(cmd, env=env, timeout=args.timeout)
        print(f"  {spec.name}: exit {proc.returncode} in {time.monotonic() - start:.1f}s", flush=True)
        if proc.returncode != 0:
            raise RuntimeError(f"run {spec.name} exited with {proc.returncode}")
        dirs.append((spec.name, out))
    return dirs


def main(args) -> int:
    """Run (or take) the runs and compare them: 0 within the tolerances, 1 past them, 2 on an error."""
    try:
        if args.compare:
            dirs = [(os.path.basename(os.path.normpath(d)), d) for d in args.compare]
        else:
            dirs = _run_all(args)
        metrics = [(name, read_metrics(d)) for name, d in dirs]
    except (ValueError, RuntimeError, FileNotFoundError, subprocess.TimeoutExpired) as exc:
        print(f"unified-dist parity: error: {exc}", file=sys.stderr)
        return 2
    ref_name, ref = metrics[0]
    rows = [compare(name, ref, m) for name, m in metrics[1:]]
    print(table(ref_name, rows, args.rtol, args.eval_atol))
    return 0 if all(r.ok(args.rtol, args.eval_atol) for r in rows) else 1
