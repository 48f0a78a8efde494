"""A "punisher" soak of replica groups (issue #53): one long ``unified-dist launch --replica-groups 3`` run
while a driver SIGKILLs a random group's whole process tree at random times; the launcher must start each
killed group again, the new group must heal from a live peer, and the job must end well with every group
holding the same weights. Written for this repository (the idea is torchft's SLURM punisher example's).

    OMP_NUM_THREADS=1 python bench/replicas/replica_soak.py [--short] [--seed N] [--out FILE]

The job is ``unified-dist launch --backend torch --nproc 1 --replica-groups 3 --max-group-restarts 10
tests/launchers/workers/replica_worker.py --out DIR --steps S --step-sleep X``. The driver follows the
workers' JSON lines (``DIR/group<g>_rank0.jsonl``) and makes ``--kills`` kills: the next one is drawn
``uniform(--gap-min, --gap-max)`` seconds after the previous one (a seeded RNG; the seed is recorded), and
is held back until every group's current process has committed a step since the previous kill (so the
other groups are running and a live peer exists, and the previous victim has come back) and the job is
not within ``--margin`` steps of its end (a group killed then would find no peer left to heal from).
A kill is SIGKILL of the victim's worker (the pid of its latest ``start`` event), its parent torchrun and
every descendant of that torchrun.

Checked and written to ``bench/replicas/results/replica_soak.json`` (``--short``: ``replica_soak_short.json``): the
launch's exit status (under a timeout: no hang); per group and incarnation (worker pid) the committed steps,
which must be contiguous; the never-killed groups' steps, which must be 1..S; the groups' final digests,
which must be equal; kills and restarts (start events beyond the first per group, and the launcher's
"starting it again" lines); per kill, the seconds from the kill to the replacement's first committed step
and the longest pause the surviving groups saw between two committed steps around it.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "replicas" / "results"
WORKER = ROOT / "tests" / "launchers" / "workers" / "replica_worker.py"
GROUPS = 3


class Follower:
    """Reads the complete JSON lines appended to each group's rank-0 file since the last call."""

    def __init__(self, folder: Path, groups: int) -> None:
        self.paths = [folder / f"group{g}_rank0.jsonl" for g in range(groups)]
        self.offsets = [0] * groups
        self.events = [[] for _ in range(groups)]
        self.bad_lines = 0

    def poll(self) -> None:
        for g, path in enumerate(self.paths):
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[g])
                    chunk = f.read()
            except FileNotFoundError:
                continue
            end = chunk.rfind(b"\n")
            if end < 0:
                continue
            self.offsets[g] += end + 1
            for line in chunk[:end].splitlines():
                try:
                    self.events[g].append(json.loads(line))
                except ValueError:  # a line cut by a SIGKILL mid-write
                    self.bad_lines += 1

    def current_pid(self, g: int):
        starts = [e for e in self.events[g] if e["event"] == "start"]
        return starts[-1]["pid"] if starts else None

    def committed_since(self, g: int, t: float) -> bool:
        """Whether group ``g``'s current process committed a step after time ``t``."""
        pid = self.current_pid(g)
        return any(e["event"] == "step" and e["committed"] and e["pid"] == pid and e["t"] > t
                   for e in reversed(self.events[g][-50:]))

    def max_step(self) -> int:
        return max((e["step"] for evs in self.events for e in evs if e["event"] == "step"), default=0)


def kill_tree(worker_pid: int) -> dict:
    """SIGKILL the worker, its parent torchrun and every descendant of that torchrun."""
    import psutil

    victims = []
    try:
        worker = psutil.Process(worker_pid)
        parent = worker.parent()
        root = parent if parent is not None and "torchrun" in " ".join(parent.cmdline()) else worker
        victims = [root, *root.children(recursive=True)]
    except psutil.Error as e:
        return {"worker": worker_pid, "killed": [], "error": repr(e)}
    killed = []
    for p in victims:
        try:
            p.send_signal(signal.SIGKILL)
            killed.append({"pid": p.pid, "name": p.name()})
        except psutil.Error:
            pass
    return {"worker": worker_pid, "killed": killed}


def launch_argv(folder: Path, args) -> list:
    from unified_dist.testing.launchers import BIN

    return [str(BIN / "unified-dist"), "launch", "--backend", "torch", "--nproc", "1", "--replica-groups",
            str(GROUPS), "--max-group-restarts", str(args.max_restarts), str(WORKER), "--out", str(folder),
            "--steps", str(args.steps), "--step-sleep", str(args.step_sleep)]


def soak(args) -> dict:
    from unified_dist.testing.launchers import child_env, kill_session

    rng = random.Random(args.seed)
    folder = Path(tempfile.mkdtemp(prefix="replica_soak_"))
    argv = launch_argv(folder, args)
    log_path = folder / "launch.log"
    follow = Follower(folder, GROUPS)
    kills = []
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            last_kill = started
            next_at = started + args.first_after + rng.uniform(args.gap_min, args.gap_max)
            while proc.poll() is None:
                now = time.time()
                if now - started > args.timeout:
                    break
                time.sleep(0.2)
                follow.poll()
                if len(kills) >= args.kills or now < next_at:
                    continue
                if follow.max_step() > args.steps - args.margin:
                    continue  # too close to the end: a killed group would find no peer to heal from
                if not all(follow.committed_since(g, last_kill) for g in range(GROUPS)):
                    continue  # a group is down or has not stepped since the last kill
                victim = rng.randrange(GROUPS)
                pid = follow.current_pid(victim)
                step_before = max((e["step"] for e in follow.events[victim] if e["event"] == "step"), default=0)
                t_kill = time.time()
                what = kill_tree(pid)
                kills.append({"n": len(kills) + 1, "group": victim, "t": t_kill, "scheduled_t": next_at,
                              "delay_for_eligibility_s": t_kill - next_at, "since_start_s": t_kill - started,
                              "victim_last_step_seen": step_before, **what})
                print(f"kill {len(kills)}: group {victim} pid {pid} at {t_kill - started:.1f} s "
                      f"(step ~{step_before}); killed {[k['pid'] for k in what['killed']]}", flush=True)
                last_kill = t_kill
                next_at = t_kill + rng.uniform(args.gap_min, args.gap_max)
            timed_out = proc.poll() is None
            rc = proc.wait(timeout=5) if not timed_out else None
        finally:
            if proc.poll() is None:
                kill_session(proc.pid)
                proc.wait()
    wall = time.time() - started
    follow.poll()
    output = log_path.read_text(errors="replace")
    record = analyse(follow, kills, args, started)
    record.update(rc=rc, timed_out=timed_out, wall_s=wall, folder=str(folder), launch=" ".join(
        [Path(argv[0]).name, *[os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a for a in argv[1:]]]),
        launcher_restart_lines=output.count("starting it again"),
        healed_lines=output.count("healed from a live peer"),
        error_lines=[line for line in output.splitlines()
                     if ("Error" in line or "error" in line or "Traceback" in line) and "UserWarning" not in line][:20],
        output_tail=output[-3000:])
    return record


def contiguous(steps: list) -> bool:
    return all(b == a + 1 for a, b in zip(steps, steps[1:]))


def analyse(follow: Follower, kills: list, args, started: float) -> dict:
    groups = {}
    for g in range(GROUPS):
        evs = follow.events[g]
        pids = [e["pid"] for e in evs if e["event"] == "start"]
        incarnations = []
        for pid in pids:
            mine = [e for e in evs if e["pid"] == pid]
            committed = [e["step"] for e in mine if e["event"] == "step" and e["committed"]]
            start_t = next(e["t"] for e in mine if e["event"] == "start")
            first_t = next((e["t"] for e in mine if e["event"] == "step" and e["committed"]), None)
            ends = [e for e in mine if e["event"] == "end"]
            incarnations.append({
                "pid": pid, "start_s": start_t - started, "first_committed_step": committed[0] if committed else None,
                "last_committed_step": committed[-1] if committed else None, "committed": len(committed),
                "contiguous": contiguous(committed),
                "dropped": sum(1 for e in mine if e["event"] == "step" and not e["committed"]),
                "start_to_first_commit_s": None if first_t is None else first_t - start_t,
                "healed_at": ends[0].get("healed_at") if ends else None,
                "digest": ends[0]["digest"] if ends else None, "end_step": ends[0]["step"] if ends else None})
        later = all(b["first_committed_step"] is None or a["last_committed_step"] is None
                    or b["first_committed_step"] > a["last_committed_step"]
                    for a, b in zip(incarnations, incarnations[1:]))
        killed = sum(1 for k in kills if k["group"] == g)
        all_steps = [e["step"] for e in evs if e["event"] == "step" and e["committed"]]
        groups[g] = {"kills": killed, "starts": len(pids), "restarts": len(pids) - 1,
                     "incarnations": incarnations, "incarnations_in_order": later,
                     "every_incarnation_contiguous": all(i["contiguous"] for i in incarnations),
                     "full_1_to_S": all_steps == list(range(1, args.steps + 1)),
                     "final_digest": incarnations[-1]["digest"] if incarnations else None,
                     "final_step": incarnations[-1]["end_step"] if incarnations else None}
    for k in kills:  # recovery: the kill to the replacement's first committed step
        g = k["group"]
        after = [i for i in groups[g]["incarnations"] if i["pid"] not in (k["worker"],) and
                 i["start_s"] + started > k["t"]]
        rep = after[0] if after else None
        first = None
        if rep is not None:
            first = next((e for e in follow.events[g] if e["pid"] == rep["pid"] and e["event"] == "step"
                          and e["committed"]), None)
        k["replacement_pid"] = rep["pid"] if rep else None
        k["replacement_start_after_kill_s"] = rep["start_s"] + started - k["t"] if rep else None
        k["recovery_s"] = first["t"] - k["t"] if first else None
        k["replacement_first_step"] = first["step"] if first else None
        # the survivors' longest pause between two committed steps from just before the kill to the recovery
        until = first["t"] if first else k["t"] + 30
        pauses = []
        for s in range(GROUPS):
            if s == g:
                continue
            ts = [e["t"] for e in follow.events[s] if e["event"] == "step" and e["committed"]]
            window = [t for t in ts if k["t"] - 2 <= t <= until + 2]
            before = [t for t in ts if t < k["t"]]
            if before:
                window = [before[-1]] + [t for t in window if t > before[-1]]
            pauses.append(max((b - a for a, b in zip(window, window[1:])), default=None))
        k["survivors_longest_pause_s"] = max((p for p in pauses if p is not None), default=None)
    digests = {groups[g]["final_digest"] for g in groups}
    never = [g for g in groups if groups[g]["kills"] == 0]
    recovery = [k["recovery_s"] for k in kills if k["recovery_s"] is not None]
    checks = {
        "every_incarnation_contiguous": all(groups[g]["every_incarnation_contiguous"] for g in groups),
        "incarnations_in_order": all(groups[g]["incarnations_in_order"] for g in groups),
        "never_killed_groups_have_1_to_S": all(groups[g]["full_1_to_S"] for g in never),
        "final_digests_equal": len(digests) == 1 and None not in digests,
        "every_group_ended_at_S": all(groups[g]["final_step"] == args.steps for g in groups),
        "restarts_equal_kills": all(groups[g]["restarts"] == groups[g]["kills"] for g in groups),
        "every_kill_recovered": len(recovery) == len(kills),
    }
    return {"groups": groups, "kills": kills, "never_killed": never, "checks": checks,
            "bad_json_lines": follow.bad_lines, "recovery_s": recovery}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--short", action="store_true", help="3 kills, 400 steps (a quick check of the script)")
    p.add_argument("--seed", type=int, default=None, help="the kills' RNG seed (default: drawn and recorded)")
    p.add_argument("--kills", type=int, default=None)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--gap-min", type=float, default=None, help="least seconds from one kill to the next")
    p.add_argument("--gap-max", type=float, default=None)
    p.add_argument("--first-after", type=float, default=5.0, help="seconds after the launch before the first gap")
    p.add_argument("--margin", type=int, default=None, help="no kill within this many steps of the end")
    p.add_argument("--max-restarts", type=int, default=10)
    p.add_argument("--timeout", type=float, default=1200)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    defaults = dict(kills=3, steps=400, gap_min=4.0, gap_max=8.0, margin=120) if args.short else \
        dict(kills=10, steps=2000, gap_min=8.0, gap_max=20.0, margin=300)
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.seed is None:
        args.seed = random.SystemRandom().randrange(2 ** 31)
    sys.path[:0] = [str(ROOT / "bench" / "shared"), str(ROOT)]
    import provenance

    record = provenance.start()
    record["settings"] = {k: getattr(args, k) for k in ("short", "seed", "kills", "steps", "step_sleep", "gap_min",
                                                        "gap_max", "first_after", "margin", "max_restarts",
                                                        "timeout")}
    record["settings"].update(groups=GROUPS, nproc=1, omp_num_threads=os.environ.get("OMP_NUM_THREADS"))
    record.update(soak(args))
    checks = record["checks"]
    rec = record["recovery_s"]
    record["summary"] = {
        "ok": record["rc"] == 0 and not record["timed_out"] and all(checks.values()),
        "rc": record["rc"], "timed_out": record["timed_out"], "wall_s": round(record["wall_s"], 1),
        "seed": args.seed, "kills": len(record["kills"]),
        "restarts": sum(record["groups"][g]["restarts"] for g in record["groups"]),
        "launcher_restart_lines": record["launcher_restart_lines"],
        "kills_per_group": [record["groups"][g]["kills"] for g in record["groups"]],
        "never_killed": record["never_killed"],
        "recovery_s_median": statistics.median(rec) if rec else None,
        "recovery_s_min": min(rec) if rec else None, "recovery_s_max": max(rec) if rec else None,
        "survivors_longest_pause_s_max": max((k["survivors_longest_pause_s"] or 0 for k in record["kills"]),
                                             default=None),
        "dropped_steps": sum(i["dropped"] for g in record["groups"].values() for i in g["incarnations"]),
        "final_digests_equal": checks["final_digests_equal"], **{f"check_{k}": v for k, v in checks.items()}}
    record = provenance.finish(record)
    out = Path(args.out) if args.out else RESULTS / ("replica_soak_short.json" if args.short else "replica_soak.json")
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(json.dumps(record["summary"], indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
