"""How often a job built on the facade crashes at exit: many short launches per launcher.

    python bench/exit/exit_stress.py [--launches 30] [--launchers torchrun,accelerate,horovodrun] [--out FILE]

Each launch runs bench/exit/exit_worker.py with 2 processes (3 training steps, an all_reduce, then the
script ends without ud.shutdown()). A launch whose every rank printed "done" but that exited
non-zero is an exit crash (torch/gloo's "terminate called without an active exception" SIGABRT
was the one seen); any other non-zero exit is a failure. A launch that exited cleanly but where a
rank found its process group, DDP reducer or Horovod still alive after the facade's exit handler
ran (bench/exit/exit_worker.py's report, written from an atexit handler that runs after the facade's)
is a missed teardown: that check is deterministic, the crash it prevents is not. Writes a JSON
(default bench/exit/results/exit_stress.json) with the commit, the command, the load average before and
after, and per launcher: launches, exit crashes, missed teardowns, failures, the first crash's
output tail, the first launch's per-rank exit reports, seconds.
tests/launchers/test_exit_stress.py runs a reduced form (1 launch per launcher) in `make test`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "shared"))

import provenance  # noqa: E402  (bench/shared/provenance.py)
from run import launch_command  # noqa: E402  (bench/shared/run.py)
from unified_dist.cli.launch import LAUNCHER_OF  # noqa: E402
from unified_dist.testing.launchers import run  # noqa: E402

WORKER = ROOT / "bench" / "exit" / "exit_worker.py"
BACKEND_OF = {launcher: backend for backend, launcher in LAUNCHER_OF.items()}
NPROC = 2


def left_alive(reports: list) -> list:
    """What some rank still had alive after the facade's exit handler ('rank R: NAME'), or
    'rank R: no report' where its report is missing."""
    found = [f"rank {r}: no report" for r, rep in enumerate(reports) if rep is None]
    return found + [f"rank {rep['rank']}: {name}" for rep in reports if rep is not None
                    for name, alive in rep["at_exit"].items() if alive]


def one_launch(launcher: str, timeout: float) -> tuple:
    """(outcome, output, per-rank exit reports) of one launch: 'ok', 'exit crash', 'teardown
    missed' or 'failure'."""
    argv, env = launch_command(BACKEND_OF[launcher], NPROC, str(WORKER), [])
    with tempfile.TemporaryDirectory(prefix="exit_reports") as reports_dir:
        env["EXIT_WORKER_REPORT"] = reports_dir
        proc = run(argv, timeout, env=env, cwd=ROOT)  # on timeout the launcher's whole process tree is killed
        paths = [os.path.join(reports_dir, f"rank{r}.json") for r in range(NPROC)]
        reports = [json.loads(Path(p).read_text()) if os.path.exists(p) else None for p in paths]
    if proc.timed_out:
        return "failure", f"timed out after {timeout:g}s\n{proc.output}", reports
    done = all(f"done rank {r}" in proc.output for r in range(NPROC))
    if proc.returncode != 0:
        return ("exit crash" if done else "failure"), proc.output, reports
    if not done:
        return "failure", proc.output, reports
    missed = left_alive(reports)
    if missed:
        return "teardown missed", f"alive after the facade's exit handler: {', '.join(missed)}\n{proc.output}", reports
    return "ok", proc.output, reports


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", type=int, default=30, help="launches per launcher (default 30)")
    p.add_argument("--launchers", default="torchrun,accelerate,horovodrun")
    p.add_argument("--timeout", type=float, default=120, help="seconds per launch")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "exit" / "results" / "exit_stress.json")
    args = p.parse_args(argv)
    launchers = [name.strip() for name in args.launchers.split(",") if name.strip()]
    unknown = [name for name in launchers if name not in BACKEND_OF]
    if unknown:
        p.error(f"unknown launcher(s) {unknown}; choose from {', '.join(BACKEND_OF)}")
    report = {**provenance.start(), "processes_per_launch": NPROC, "launchers": {}}
    for launcher in launchers:
        counts = {"launches": 0, "exit_crashes": 0, "teardowns_missed": 0, "failures": 0, "first_crash_tail": "",
                  "first_teardown_missed": "", "first_failure_tail": "", "first_exit_reports": None}
        start = time.monotonic()
        for i in range(args.launches):
            outcome, output, reports = one_launch(launcher, args.timeout)
            counts["launches"] += 1
            if counts["first_exit_reports"] is None:
                counts["first_exit_reports"] = reports
            if outcome == "exit crash":
                counts["exit_crashes"] += 1
                counts["first_crash_tail"] = counts["first_crash_tail"] or output[-1500:]
            elif outcome == "teardown missed":
                counts["teardowns_missed"] += 1
                counts["first_teardown_missed"] = counts["first_teardown_missed"] or output[-1500:]
            elif outcome == "failure":
                counts["failures"] += 1
                counts["first_failure_tail"] = counts["first_failure_tail"] or output[-1500:]
            print(f"{launcher} {i + 1}/{args.launches}: {outcome}", flush=True)
        counts["seconds"] = round(time.monotonic() - start, 1)
        report["launchers"][launcher] = counts
    provenance.finish(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1))
    for launcher, c in report["launchers"].items():
        print(f"{launcher}: {c['exit_crashes']} exit crashes, {c['teardowns_missed']} missed teardowns, "
              f"{c['failures']} other failures in {c['launches']} launches ({c['seconds']:.0f} s)")
    bad = sum(c["exit_crashes"] + c["teardowns_missed"] + c["failures"] for c in report["launchers"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
