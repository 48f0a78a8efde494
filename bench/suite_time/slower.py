"""Run a command on this machine made FACTOR times slower: its CPU time cut by a control group's quota.

    python bench/suite_time/slower.py 1.4 -- make test

The command and every process it starts run in a new control group whose CPU quota is ``cores / FACTOR`` CPUs per
100 ms period: together they get 1/FACTOR of the CPU time this machine's cores could give them. This is how the
suite's budget (issue #60: 30 minutes on the slowest 2-core machine seen) is measured for a machine slower than the
one at hand: ``make test``'s record (build/test-times.json) carries the quota (bench/shared/provenance.py's
``cpu_quota``), and suite_time.py says so where it renders the run.

What it does not emulate: a slower machine's memory, caches and vector units differ from its clock in their own
proportions, and a quota is given per period (work runs at full speed until the period's share is spent, then
waits), where a slower core is slow all the time.

Needs root and the ``cpu`` controller (cgroup v1 at /sys/fs/cgroup/cpu, or v2 with ``cpu`` in its
``cgroup.controllers``). The group is removed after the command ends, with any process of the command that is still
in it (killed); the command's exit status is this script's.
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

PERIOD_US = 100_000
"""The scheduling period the quota is given in (the kernel's default)."""
V1 = Path("/sys/fs/cgroup/cpu")
V2 = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))


class SlowerError(Exception):
    """What stops a slowed run before its command starts: one line, with what to do."""


def make_group(name: str, cpus: float, v1: Path = V1, v2=V2) -> Path:
    """A new control group ``name`` whose processes may use ``cpus`` CPUs per period; its folder."""
    quota = max(1000, round(cpus * PERIOD_US))
    try:
        if (v1 / "cpu.cfs_quota_us").exists():
            folder = v1 / name
            folder.mkdir()
            (folder / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (folder / "cpu.cfs_quota_us").write_text(str(quota))
            return folder
        for root in v2:
            controllers = root / "cgroup.controllers"
            if controllers.exists() and "cpu" in controllers.read_text().split():
                (root / "cgroup.subtree_control").write_text("+cpu")
                folder = root / name
                folder.mkdir()
                (folder / "cpu.max").write_text(f"{quota} {PERIOD_US}")
                return folder
    except PermissionError as exc:
        raise SlowerError(f"cannot make a control group ({exc.filename}: permission denied): run as root") from None
    except OSError as exc:
        raise SlowerError(f"cannot make a control group ({exc}): this machine's cgroups do not allow it") from None
    raise SlowerError("no cpu controller under /sys/fs/cgroup (cgroup v1 cpu/ or v2 with cpu in cgroup.controllers): "
                      "this machine cannot cut a group's CPU time")


def remove_group(folder: Path) -> List[int]:
    """Kill what is left in the group, then remove it; the process ids that were left."""
    left: List[int] = []
    for _ in range(50):
        pids = [int(pid) for pid in (folder / "cgroup.procs").read_text().split()]
        if not pids:
            break
        left += [pid for pid in pids if pid not in left]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    folder.rmdir()
    return left


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("factor", type=float, help="how many times slower (above 1): the group gets cores/FACTOR CPUs")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        if not command:
            raise SlowerError("no command: give it after --, e.g. slower.py 1.4 -- make test")
        if not args.factor > 1:
            raise SlowerError(f"FACTOR {args.factor} would not slow anything down: give a number above 1")
        cores = len(os.sched_getaffinity(0))
        folder = make_group(f"unified_dist_slower_{os.getpid()}", cores / args.factor)
    except SlowerError as exc:
        print(f"slower: {exc}", file=sys.stderr)
        return 2
    print(f"slower: {' '.join(command)} with {cores / args.factor:.2f} of {cores} CPUs ({folder})", file=sys.stderr,
          flush=True)
    procs = str(folder / "cgroup.procs")
    try:
        child = subprocess.Popen(command, preexec_fn=lambda: Path(procs).write_text(str(os.getpid())))
        try:
            code = child.wait()
        except KeyboardInterrupt:
            child.send_signal(signal.SIGINT)
            code = child.wait()
    finally:
        left = remove_group(folder)
        if left:
            print(f"slower: killed {len(left)} process(es) the command left running: {left}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
