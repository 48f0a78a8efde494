"""Where ``make test``'s time goes: the suite's budget, from the seconds every test took.

``make test`` writes ``build/test-times.json`` (tests/conftest.py: each test's seconds per phase, with the run's
commit, CPU, load and steal); this script sums it into a results file that docs/testing.md renders::

    python bench/suite_time/suite_time.py build/test-times.json --out bench/suite_time/results/suite_time.json

What it records (:func:`summarise`):

- ``tests_s``: the seconds of tests, every phase of every test summed (set-up, call, tear-down); pytest's own
  collection and start are not in it, ``wall_s`` (the session's wall clock) has them;
- ``workers``: the pytest-xdist workers the run had (0: one process);
- ``budget_s``: the goal, 30 minutes of tests on the slowest 2-core machine (issue #60), and ``over_s``: what is
  measured against it is ``tests_s`` in one process, and the session's wall clock ``wall_s`` where workers ran
  tests side by side (their phases overlap, so their sum is more than the minutes one waits);
- ``by_phase``: set-up is mostly the module-scoped fixtures that launch once for many checks, call the tests'
  own work (a launch of its own, most often);
- ``by_folder`` and ``by_file`` (the 25 heaviest files), each with its share of ``tests_s``;
- ``slowest``: the 20 slowest single phases (``nodeid``, ``phase``, ``s``, ``share``), pytest's ``--durations``;
- ``launches`` (with ``--launches build/launches.jsonl``, one line per command a test ran through
  ``unified_dist.testing.launchers.run``, :func:`launch_summary`): how many, their wall seconds and the share of
  ``tests_s`` spent inside them, the CPU seconds of the processes they started, per launcher, and the longest ones
  with their CPU per wall second (a launch of 2 busy processes on 2 cores shows about 2; well under 1, it waited).

Ratios within one run only: the machine's CPU changes between sessions (the record names it). A run under
bench/suite_time/slower.py (this machine's CPU time cut by a control group's quota) records the quota
(``cpu_quota``, CPUs), and the budget's line says how many times slower that made the machine.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

BUDGET_S = 30 * 60
"""The suite's goal: 30 minutes of tests on the slowest 2-core machine (issue #60)."""

PHASES = ("setup", "call", "teardown")
RUN_FIELDS = ("commit", "command", "cpu", "cores", "cpu_quota", "workers", "load_before", "load_after",
              "steal_fraction", "busy_fraction", "wall_s", "exit_status")


def _file(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def _folder(nodeid: str) -> str:
    parts = _file(nodeid).split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def summarise(times: dict, slowest: int = 20, files: int = 25) -> dict:
    """The budget of one run from ``times`` (tests/conftest.py's record: ``items`` maps a test's node id to its
    seconds per phase); the run's own fields (commit, CPU, load, ...) are kept as they are."""
    items = times["items"]
    phases = [(nodeid, phase, float(seconds)) for nodeid, record in items.items()
              for phase, seconds in record.items() if phase in PHASES]
    total = sum(s for _, _, s in phases)
    if total <= 0:
        raise ValueError("no test took any time: is this a test-times file of a run?")
    by_phase, by_folder, by_file = defaultdict(float), defaultdict(float), defaultdict(float)
    for nodeid, phase, seconds in phases:
        by_phase[phase] += seconds
        by_folder[_folder(nodeid)] += seconds
        by_file[_file(nodeid)] += seconds

    def shares(table: dict, top: int = 0) -> list:
        rows = sorted(table.items(), key=lambda kv: (-kv[1], kv[0]))
        return [{"name": name, "s": round(s, 1), "share": round(s / total, 4)} for name, s in rows[:top or None]]

    top = sorted(phases, key=lambda p: (-p[2], p[0], p[1]))[:slowest]
    summary = {key: times[key] for key in RUN_FIELDS if key in times}
    measured = float(times["wall_s"]) if times.get("workers") else total
    summary.update({
        "tests": len(items), "failed": sum(1 for r in items.values() if r.get("outcome") == "failed"),
        "tests_s": round(total, 1), "budget_s": BUDGET_S, "over_s": round(measured - BUDGET_S, 1),
        "by_phase": shares(by_phase), "by_folder": shares(by_folder), "by_file": shares(by_file, files),
        "slowest": [{"nodeid": n, "phase": p, "s": round(s, 1), "share": round(s / total, 4)} for n, p, s in top],
        "slowest_share": round(sum(s for _, _, s in top) / total, 4),
    })
    return summary


def launch_summary(lines: list, tests_s: float, longest: int = 20) -> dict:
    """What the suite's launches cost, from the launch log's records (``test``, ``launcher``, ``script``,
    ``wall_s``, ``cpu_s``): their count, wall and CPU seconds in all and per launcher, the share of the tests'
    seconds spent inside them, and the ``longest`` launches. A launch's CPU seconds are its processes' that were
    waited for (srun's tasks are slurmd's children: 0 here)."""
    if not lines:
        raise ValueError("the launch log holds no launch")
    per = defaultdict(lambda: {"launches": 0, "wall_s": 0.0, "cpu_s": 0.0})
    for line in lines:
        row = per[line["launcher"]]
        row["launches"] += 1
        row["wall_s"] += float(line["wall_s"])
        row["cpu_s"] += float(line["cpu_s"])
    wall = sum(float(line["wall_s"]) for line in lines)
    ranked = sorted(lines, key=lambda line: (-float(line["wall_s"]), line["test"]))[:longest]
    return {
        "launches": len(lines), "wall_s": round(wall, 1), "cpu_s": round(sum(float(x["cpu_s"]) for x in lines), 1),
        "share_of_tests": round(wall / tests_s, 4) if tests_s else None,
        "timed_out": sum(1 for line in lines if line.get("timed_out")),
        "by_launcher": [{"name": name, "launches": row["launches"], "wall_s": round(row["wall_s"], 1),
                         "cpu_s": round(row["cpu_s"], 1), "mean_wall_s": round(row["wall_s"] / row["launches"], 1)}
                        for name, row in sorted(per.items(), key=lambda kv: (-kv[1]["wall_s"], kv[0]))],
        "longest": [{"test": line["test"], "launcher": line["launcher"], "script": line["script"],
                     "wall_s": float(line["wall_s"]), "cpu_s": float(line["cpu_s"]),
                     "cpu_per_wall": round(float(line["cpu_s"]) / float(line["wall_s"]), 2)
                     if float(line["wall_s"]) > 0 else None} for line in ranked],
    }


def table(summary: dict) -> list:
    """docs/testing.md's lines: the budget against the measured run, then the slowest phases with their share."""
    minutes = summary["tests_s"] / 60
    verdict = (f"{summary['over_s'] / 60:.1f} min over" if summary["over_s"] > 0
               else f"{-summary['over_s'] / 60:.1f} min under")
    where = f"on {summary.get('cpu', 'an unrecorded CPU')}, {summary.get('cores', '?')} cores"
    quota = summary.get("cpu_quota")
    if quota is not None and summary.get("cores"):
        where += (f", its CPU time cut to {quota:.2f} CPUs (bench/suite_time/slower.py: this machine made "
                  f"{summary['cores'] / quota:.2f} times slower)")
    wall = summary["wall_s"] / 60
    if summary.get("workers"):
        first = (f"- {summary['tests']} tests on {summary['workers']} pytest-xdist workers, **{wall:.1f} min wall** "
                 f"({minutes:.1f} min of test phases summed over the workers) {where}")
    else:
        first = f"- {summary['tests']} tests, **{minutes:.1f} min of tests** ({wall:.1f} min wall) {where}"
    busy = summary.get("busy_fraction")
    lines = [f"{first}: {verdict} the budget of {summary['budget_s'] / 60:.0f} min."
             + (f" The cores were busy {busy:.0%} of the run." if busy is not None else ""),
             "- By folder: " + ", ".join(f"`{r['name']}` {r['s'] / 60:.1f} min ({r['share']:.0%})"
                                         for r in summary["by_folder"]) + ".",
             "- By phase: " + ", ".join(f"{r['name']} {r['s'] / 60:.1f} min ({r['share']:.0%})"
                                        for r in summary["by_phase"])
             + " (set-up: mostly the shared launches of module-scoped fixtures).",
             f"- The {len(summary['slowest'])} slowest phases below take {summary['slowest_share']:.0%} of it:", "",
             "| test | phase | seconds | share |", "|---|---|---:|---:|"]
    lines += [f"| `{r['nodeid']}` | {r['phase']} | {r['s']:.0f} | {r['share']:.1%} |" for r in summary["slowest"]]
    launches = summary.get("launches")
    if launches:
        lines += ["", f"- {launches['launches']} launches took {launches['wall_s'] / 60:.1f} min of wall "
                  f"({launches['share_of_tests']:.0%} of the test phases) and {launches['cpu_s'] / 60:.1f} CPU-min; "
                  "by launcher: " + ", ".join(f"{r['name']} {r['launches']} x {r['mean_wall_s']:.1f} s"
                                              for r in launches["by_launcher"]) + ".",
                  f"- The {len(launches['longest'])} longest launches (CPU seconds per wall second: about 2 when "
                  "two processes work on the 2 cores, well under 1 when the launch waits):", "",
                  "| test | launcher | wall s | CPU s | CPU/wall |", "|---|---|---:|---:|---:|"]
        lines += [f"| `{r['test']}` | {r['launcher']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['cpu_per_wall']} |"
                  for r in launches["longest"]]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("times", help="the test-times file make test wrote (build/test-times.json)")
    parser.add_argument("--launches", help="the launch log make test wrote (build/launches.jsonl)")
    parser.add_argument("--out", help="the results file to write (bench/suite_time/results/suite_time.json)")
    args = parser.parse_args(argv)
    try:
        summary = summarise(json.loads(Path(args.times).read_text()))
        if args.launches:
            lines = [json.loads(line) for line in Path(args.launches).read_text().splitlines() if line.strip()]
            summary["launches"] = launch_summary(lines, summary["tests_s"])
    except (OSError, ValueError, KeyError) as exc:
        print(f"suite_time: cannot read {args.times}{' or ' + args.launches if args.launches else ''} ({exc}); "
              "run `make test` first", file=sys.stderr)
        return 2
    summary["summarised_by"] = " ".join(["python", "bench/suite_time/suite_time.py", *(argv or sys.argv[1:])])
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print("\n".join(table(summary)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
