"""What fault tolerance costs per optimizer step (issue #53): the same 2-process data-parallel job with
replica groups off and on, interleaved in one run, and how long a killed group takes to come back.

    OMP_NUM_THREADS=1 python bench/replicas/replica_cost.py [--rounds 4] [--steps 40] [--out FILE]

- off: ``torchrun --standalone --nproc_per_node 2 bench/replicas/replica_cost.py --worker ...``: one DDP world of 2;
- on: ``unified-dist launch --backend torch --nproc 1 --replica-groups 2 bench/replicas/replica_cost.py --worker ...``:
  2 replica groups of 1 process each, the gradients averaged across groups by torchft (one quorum, one
  all-reduce and one ``should_commit`` per step).

Both run the same facade loop (``ud.prepare(model, optimizer, loader)``, ``ud.backward``, ``optimizer.step``):
an MLP ``width -> hidden -> hidden -> width`` (about 6.3 M parameters by default), SGD with momentum, a
prepared DataLoader of fixed random data (``--batch`` examples per process and step, the same 2-way split of
the same data in both layouts), ``--warmup`` untimed steps and then ``--steps`` timed ones. A step's time is
the wall time from the end of the previous optimizer step to the end of this one (it includes the loader's
fetch, where the quorum runs when fault tolerance is on). Each process writes its step times; a run's
figure is the mean over its 2 processes of their median step; the result is the median over runs (rounds
alternate which side goes first). With fault tolerance on, the worker also times torchft's pieces (the
quorum, ``Manager.start_quorum``; the gradient average across groups; ``should_commit``) per step.

Recovery: ``--kill-reps`` launches of tests/launchers/workers/replica_worker.py with 2 groups and
``--kill-group 1 --kill-at K``: seconds from the kill (the worker's ``kill`` event) to the replacement
process's first committed step, and the survivor's longest pause between committed steps.

Writes ``bench/replicas/results/replica_cost.json`` (provenance, settings, every run, a ``summary``).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "replicas" / "results"
REPLICA_WORKER = ROOT / "tests" / "launchers" / "workers" / "replica_worker.py"


# ----------------------------------------------------------------------------------------------- worker
def worker(args) -> None:
    import torch

    import unified_dist as ud
    from unified_dist import session

    ud.init(timeout=args.timeout)
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    data = torch.Generator().manual_seed(7)
    n = 2 * args.batch * 8
    x = torch.randn(n, args.width, generator=data)
    y = torch.randn(n, args.width, generator=data)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(args.width, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU(),
                                torch.nn.Linear(args.hidden, args.width))
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch, shuffle=True)
    model, optimizer, loader = ud.prepare(model, optimizer, loader)

    replicas = session.current_backend().replicas
    pieces = {"quorum": 0.0, "average": 0.0, "commit": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                pieces[name] += time.perf_counter() - t0
        return wrapper

    if replicas is not None:  # instance attributes: what ReplicaGroups and the backend call
        replicas.manager.start_quorum = timed("quorum", replicas.manager.start_quorum)
        replicas.manager.should_commit = timed("commit", replicas.manager.should_commit)
        replicas.average = timed("average", replicas.average)

    total = args.warmup + args.steps
    durations, per_step_pieces, committed = [], [], 0
    last = time.perf_counter()
    while optimizer.steps_taken < total:
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            ud.backward(loss)
            before = optimizer.steps_taken
            optimizer.step()
            optimizer.zero_grad()
            now = time.perf_counter()
            committed += optimizer.steps_taken > before
            durations.append(now - last)
            per_step_pieces.append(dict(pieces))
            for k in pieces:
                pieces[k] = 0.0
            last = now
            if optimizer.steps_taken >= total:
                break
    inner = ud.unwrap(model)
    digest = hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in inner.parameters())).hexdigest()
    record = {"group": group, "rank": ud.rank(), "world": ud.world_size(), "dp": ud.data_parallel_world_size(),
              "params": params, "steps_taken": optimizer.steps_taken, "iterations": len(durations),
              "committed": committed, "durations_s": durations, "digest": digest,
              "replicas": replicas is not None}
    if replicas is not None:
        record["pieces_s"] = per_step_pieces
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"group{group}_rank{ud.rank()}.json").write_text(json.dumps(record))
    ud.shutdown()


# ----------------------------------------------------------------------------------------------- driver
def worker_args(out: Path, args) -> list:
    return ["--worker", "--out", str(out), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--batch", str(args.batch), "--width", str(args.width), "--hidden", str(args.hidden)]


def side_argv(side: str, out: Path, args) -> list:
    from unified_dist.testing.launchers import BIN

    script = [str(Path(__file__).resolve()), *worker_args(out, args)]
    if side == "off":
        return [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", *script]
    return [str(BIN / "unified-dist"), "launch", "--backend", "torch", "--nproc", "1", "--replica-groups", "2",
            *script]


def shown(argv: list) -> str:
    return " ".join([Path(argv[0]).name] + [os.path.relpath(a, ROOT) if a.startswith(str(ROOT)) else a
                                            for a in argv[1:]])


def one_run(side: str, args, round_: int) -> dict:
    from unified_dist.testing.launchers import child_env, run

    out = Path(tempfile.mkdtemp(prefix=f"replica_cost_{side}_"))
    argv = side_argv(side, out, args)
    started = time.perf_counter()
    result = run(argv, args.timeout, child_env(), cwd=ROOT)
    wall = time.perf_counter() - started
    result.check()
    procs = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    assert len(procs) == 2, f"{side}: {len(procs)} process reports in {out}"
    for p in out.iterdir():
        p.unlink()
    out.rmdir()
    medians = [statistics.median(p["durations_s"][args.warmup:]) for p in procs]
    one = {"side": side, "round": round_, "wall_s": wall, "load_after": os.getloadavg(),
           "median_step_s_per_process": medians, "median_step_s": statistics.mean(medians),
           "digests_equal": len({p["digest"] for p in procs}) == 1, "digest": procs[0]["digest"],
           "dp": [p["dp"] for p in procs], "committed": [p["committed"] for p in procs],
           "params": procs[0]["params"],
           "durations_s": [[round(d, 5) for d in p["durations_s"]] for p in procs]}
    if side == "on":
        for name in ("quorum", "average", "commit"):
            one[f"median_{name}_s"] = statistics.mean(
                statistics.median(s[name] for s in p["pieces_s"][args.warmup:]) for p in procs)
    return one, shown(argv)


def recovery_run(args, rep: int) -> dict:
    from unified_dist.testing.launchers import BIN, child_env, run

    out = Path(tempfile.mkdtemp(prefix="replica_cost_kill_"))
    argv = [str(BIN / "unified-dist"), "launch", "--backend", "torch", "--nproc", "1", "--replica-groups", "2",
            str(REPLICA_WORKER), "--out", str(out), "--steps", str(args.kill_steps), "--step-sleep",
            str(args.kill_step_sleep), "--kill-group", "1", "--kill-at", str(args.kill_at)]
    started = time.perf_counter()
    result = run(argv, args.timeout, child_env(), cwd=ROOT)
    wall = time.perf_counter() - started
    result.check()

    def events(g):
        return [json.loads(line) for line in (out / f"group{g}_rank0.jsonl").read_text().splitlines()]

    lost, kept = events(1), events(0)
    kill = next(e for e in lost if e["event"] == "kill")
    pids = [e["pid"] for e in lost if e["event"] == "start"]
    new = [p for p in pids if p != kill["pid"]]
    start_new = next(e for e in lost if e["event"] == "start" and e["pid"] == new[0])
    first = next(e for e in lost if e["pid"] == new[0] and e["event"] == "step" and e["committed"])
    ts = [e["t"] for e in kept if e["event"] == "step" and e["committed"]]
    window = [t for t in ts if kill["t"] - 1 <= t <= first["t"] + 1]
    end = {g: next(e for e in events(g) if e["event"] == "end") for g in (0, 1)}
    for p in out.iterdir():
        p.unlink()
    out.rmdir()
    return {"rep": rep, "wall_s": wall, "kill_step": kill["step"], "restarts": len(pids) - 1,
            "restart_start_after_kill_s": start_new["t"] - kill["t"],
            "recovery_s": first["t"] - kill["t"], "replacement_first_step": first["step"],
            "healed_at": end[1]["healed_at"],
            "survivor_longest_pause_s": max((b - a for a, b in zip(window, window[1:])), default=None),
            "digests_equal": end[0]["digest"] == end[1]["digest"]}, shown(argv)


def ratio_per_round(runs: list) -> list:
    """on / off of each round's two runs (back to back, so they saw nearly the same load)."""
    by = {(x["round"], x["side"]): x["median_step_s"] for x in runs}
    return [round(by[r, "on"] / by[r, "off"], 4) for r in sorted({x["round"] for x in runs})]


def drive(args) -> dict:
    import provenance

    record = provenance.start()
    record["settings"] = {k: getattr(args, k) for k in ("rounds", "steps", "warmup", "batch", "width", "hidden",
                                                        "kill_reps", "kill_steps", "kill_step_sleep", "kill_at")}
    record["settings"]["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS")
    runs, commands = [], {}
    for r in range(args.rounds):
        for side in (("off", "on") if r % 2 == 0 else ("on", "off")):
            one, commands[side] = one_run(side, args, r)
            runs.append(one)
            extra = f" (quorum {one['median_quorum_s'] * 1e3:.1f} ms)" if side == "on" else ""
            print(f"round {r} {side}: median step {one['median_step_s'] * 1e3:.1f} ms{extra}", flush=True)
    recovery = []
    for rep in range(args.kill_reps):
        one, commands["kill"] = recovery_run(args, rep)
        recovery.append(one)
        print(f"kill {rep}: recovery {one['recovery_s']:.2f} s", flush=True)
    med = {side: statistics.median(x["median_step_s"] for x in runs if x["side"] == side) for side in ("off", "on")}
    on = [x for x in runs if x["side"] == "on"]
    pieces = {name: statistics.median(x[f"median_{name}_s"] for x in on) for name in ("quorum", "average", "commit")}
    rec = [x["recovery_s"] for x in recovery]
    record.update(commands=commands, runs=runs, recovery=recovery, summary={
        "params": runs[0]["params"],
        "step_ms_off": med["off"] * 1e3, "step_ms_on": med["on"] * 1e3, "ratio_on_off": med["on"] / med["off"],
        "goal_ratio_at_most": 1.10, "meets_goal": med["on"] / med["off"] <= 1.10,
        "step_ms_off_per_run": [round(x["median_step_s"] * 1e3, 2) for x in runs if x["side"] == "off"],
        "step_ms_on_per_run": [round(x["median_step_s"] * 1e3, 2) for x in runs if x["side"] == "on"],
        "ratio_per_round": ratio_per_round(runs),
        "on_quorum_ms": pieces["quorum"] * 1e3, "on_quorum_share": pieces["quorum"] / med["on"],
        "on_cross_group_average_ms": pieces["average"] * 1e3, "on_should_commit_ms": pieces["commit"] * 1e3,
        "weights_equal_within_each_run": all(x["digests_equal"] for x in runs),
        "same_final_weights_on_and_off": len({x["digest"] for x in runs}) == 1,
        "recovery_s": rec, "recovery_s_median": statistics.median(rec) if rec else None,
        "recovery_digests_equal": all(x["digests_equal"] for x in recovery)})
    return provenance.finish(record)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help="(internal) one training process")
    p.add_argument("--out", default=None)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=40, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=128, help="examples per process and step")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--kill-reps", type=int, default=3)
    p.add_argument("--kill-steps", type=int, default=100)
    p.add_argument("--kill-step-sleep", type=float, default=0.15)
    p.add_argument("--kill-at", type=int, default=8)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    sys.path[:0] = [str(ROOT / "bench" / "shared"), str(ROOT)]
    record = drive(args)
    out = Path(args.out) if args.out else RESULTS / "replica_cost.json"
    out.write_text(json.dumps(record, indent=1) + "\n")
    s = record["summary"]
    print(json.dumps({k: v for k, v in s.items()}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
