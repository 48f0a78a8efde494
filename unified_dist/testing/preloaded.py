"""Many one-process Python programs, each in a fresh fork of one process that imported :data:`PRELOAD` once.

    python -m unified_dist.testing.preloaded PLAN.json RESULTS.json

``PLAN.json`` is a list of runs, each ``{"name", "script", "args", "cwd", "env", "output", "timeout"}``. This
process imports :data:`PRELOAD` once, then runs the plan in order: for each run it forks, and the child does
what ``python SCRIPT ARGS`` would do in ``cwd`` with exactly ``env`` as its environment: the script's folder first
on ``sys.path``, ``sys.argv`` set, the script run as a fresh ``__main__`` module, stdout and stderr both into
``output``; its exit status is the interpreter's (``SystemExit``'s code; 1 after an uncaught exception, whose
traceback goes to ``output``), and its ``atexit`` functions run. A run past its ``timeout`` seconds is killed with
its whole session. ``RESULTS.json`` maps each name to ``{"returncode", "timed_out", "wall_s", "cpu_s"}``.

What a run gets from the fork is only what importing :data:`PRELOAD` leaves: modules whose import does not depend on the
run's variables. A script still imports what it uses (its globals are fresh: a missing ``import torch`` fails as it
would alone); what it imports beyond :data:`PRELOAD` is imported in the child, under its own environment. The plan's
environments must share the variables torch reads at import; :func:`main` refuses a plan whose runs differ from this
process's environment in one of them (:func:`check_plan`).

Why: on 2 cores, importing torch and ``torch._dynamo`` (which torch's first optimizer imports) costs each
short program about 3 CPU-seconds, more than most documentation snippets spend on their own work.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Dict, List

from unified_dist.testing.zygote import PRELOAD, client, kill_group, run_as_python


def _child(run: Dict) -> int:
    """In the forked child: ``python SCRIPT ARGS`` as far as the script can tell; the exit status."""
    os.setsid()
    fd = os.open(run["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(run["cwd"])
    os.environ.clear()
    os.environ.update(run["env"])
    return run_as_python("script", run["script"], run.get("args", []))


def run_one(run: Dict) -> Dict:
    """Fork, run ``run`` in the child, wait for it (killing its group after its timeout); its result."""
    sys.stdout.flush()
    sys.stderr.flush()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        status = 1
        try:
            status = _child(run)
        finally:
            os._exit(status)
    deadline = started + float(run.get("timeout", 90))
    timed_out = False
    while True:
        done, status, usage = os.wait4(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            timed_out = True
            kill_group(pid)
            _, status, usage = os.wait4(pid, 0)
            break
        time.sleep(0.02)
    kill_group(pid)  # whatever the run left behind in its group
    code = os.waitstatus_to_exitcode(status)
    return {"returncode": -9 if timed_out else code, "timed_out": timed_out,
            "wall_s": round(time.monotonic() - started, 2), "cpu_s": round(usage.ru_utime + usage.ru_stime, 2)}


def check_plan(plan: List[Dict], environ=os.environ) -> None:
    """Refuse, in one line, a run whose environment differs from ``environ`` where :data:`PRELOAD`'s import or the
    interpreter's start reads it (the zygote client's rule), or in ``PYTHONPATH`` (a run keeps this process's
    ``sys.path``)."""
    differs = client().differs_at_import
    for run in plan:
        name = differs(run["env"], environ)
        if name is None and run["env"].get("PYTHONPATH") != environ.get("PYTHONPATH"):
            name = "PYTHONPATH"
        if name is not None:
            raise SystemExit(f"preloaded: run {run['name']!r} sets {name}={run['env'].get(name)!r} but torch was "
                             f"imported with {name}={environ.get(name)!r}: start this process with the runs' "
                             "environment")


def main(argv: List[str]) -> int:
    plan_path, results_path = argv
    with open(plan_path) as handle:
        plan = json.load(handle)
    check_plan(plan)
    for module in PRELOAD:
        __import__(module)
    results = {}
    for run in plan:
        results[run["name"]] = run_one(run)
        with open(results_path, "w") as handle:  # after each run: a killed plan still tells what ran
            json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
