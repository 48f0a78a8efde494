"""How long a checkpoint stops training, blocking and in the background (``async_save=True``).

    python bench/checkpoint/async_checkpoint.py [--params-m 102] [--saves 4] [--repeats 2] [--dir DIR] [--out FILE]

Launches this file under torchrun with 2 processes (CPU, gloo; one thread each). Each rank builds the
same model of ``--params-m`` million float32 parameters (a stack of square ``Linear`` layers, DDP
through ``ud.prepare``) and SGD, and takes training steps; after each step the state
``{"model", "optimizer", "step"}`` is saved with ``ud.save_checkpoint(..., keep_last=2)``, first
``--saves`` times blocking, then ``--saves`` times with ``async_save=True``. Rank 0 records, per save:

- ``blocked_s``: how long the call kept rank 0 from its next step (a blocking save: the whole write;
  an async one: the arrival check, the settling exchange, the copy of the state and the thread's start);
- for async saves ``write_s``: from the call's return to the end of the background write (rename and
  fsync included), while training went on; and ``steps_during_write``, the step times meanwhile;
- ``idle_write_s``: one more async save waited for at once (``ud.barrier()``): the write alone.

A process's first async save is special (its staging copy needs new memory from the operating system),
so the launch is made ``--repeats`` times without and as many times with ``ud.reserve_async_save(state)``
after the warm-up step, in turn; ``first_save`` records each launch's first async blocked time over the
median of its own blocking saves (``first_ratio``; ``later_ratio`` for its other async saves) and the
medians ``ratio_without_reserve``, ``ratio_with_reserve``. The other figures are the first launch's.

Then ``dd if=/dev/zero of=DIR/dd.bin bs=16M count=N conv=fsync`` writes as many bytes as one
checkpoint to the same directory (the bytes/s the disk gives a plain sequential write). Writes a JSON
(default bench/checkpoint/results/async_checkpoint.json) with the provenance (bench/shared/provenance.py), every save's
figures, the medians, ``blocked_ratio`` (median async blocked / median blocking save) and
``write_vs_dd`` (checkpoint bytes / median async write while training, over dd's bytes/s; also for the
idle write). docs/benchmarks/async-checkpoint.md renders it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "shared"))


def _model(params_m: float):
    import torch

    width = 2048
    layers = max(1, round(params_m * 1e6 / (width * width + width)))
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)]), width


def _step(model, opt, width, ud):
    import torch

    start = time.perf_counter()
    x = torch.randn(4, width)
    ud.backward(model(x).pow(2).mean())
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - start


def _written_at(job) -> dict:
    """When the background ``job`` ends (a watcher thread fills ``["t"]``)."""
    seen = {}
    threading.Thread(target=lambda: (job.done.wait(), seen.setdefault("t", time.perf_counter())), daemon=True).start()
    return seen


def worker(args) -> None:
    import torch

    import unified_dist as ud
    from unified_dist.checkpoint.background import WRITER

    ud.init()
    model, width = _model(args.params_m)
    params = sum(p.numel() for p in model.parameters())
    model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-4))
    state = {"model": model, "optimizer": opt, "step": 0}
    _step(model, opt, width, ud)  # warm-up
    if args.reserve:  # the staging copy is made in the background while the blocking saves run
        ud.reserve_async_save(state)
    rows, step = [], 0
    for mode in ("sync", "async"):
        folder = os.path.join(args.dir, mode)
        for _ in range(args.saves):
            step += 1
            state["step"] = step
            _step(model, opt, width, ud)
            start = time.perf_counter()
            ud.save_checkpoint(state, folder, step, keep_last=2, async_save=mode == "async")
            returned = time.perf_counter()
            row = {"mode": mode, "step": step, "blocked_s": returned - start}
            if mode == "async":  # train on while rank 0 writes; it says after each step whether the write ended
                done = _written_at(WRITER.job) if ud.is_main() else {}
                row["steps_during_write"] = []
                while ud.broadcast("t" not in done, 0):
                    row["steps_during_write"].append(_step(model, opt, width, ud))
                row["write_s"] = done.get("t", returned) - returned
            rows.append(row)
        ud.barrier()
    start = time.perf_counter()
    ud.save_checkpoint(state, os.path.join(args.dir, "idle"), step, keep_last=1, async_save=True)
    ud.barrier()
    idle = time.perf_counter() - start
    size = os.path.getsize(ud.latest_checkpoint(os.path.join(args.dir, "idle")))
    plain = [_step(model, opt, width, ud) for _ in range(3)]
    if ud.is_main():
        with open(args.worker_out, "w") as f:
            json.dump({"params": params, "checkpoint_bytes": size, "saves": rows, "idle_write_s": idle,
                       "plain_step_s": plain, "world_size": ud.world_size(), "backend": ud.backend_name()}, f)
    ud.shutdown()


def _launch(args, folder: str, reserve: bool) -> dict:
    """One torchrun launch of the worker; its figures."""
    from run import launch_command
    from unified_dist.testing.launchers import run

    worker_out = os.path.join(folder, "worker.json")
    if os.path.exists(worker_out):
        os.unlink(worker_out)
    argv, env = launch_command("torch", 2, str(Path(__file__).resolve()),
                               ["--params-m", str(args.params_m), "--saves", str(args.saves), "--dir",
                                os.path.join(folder, f"run-{reserve:d}"), "--worker-out", worker_out]
                               + (["--reserve"] if reserve else []))
    launched = run(argv, 1800, env=env, cwd=ROOT)
    if launched.timed_out or not os.path.exists(worker_out):
        raise SystemExit(f"the torchrun launch failed:\n{launched.output[-3000:]}")
    got = json.loads(Path(worker_out).read_text())
    shutil.rmtree(os.path.join(folder, f"run-{reserve:d}"), ignore_errors=True)
    return got


def dd_bytes_per_s(folder: str, nbytes: int) -> dict:
    """``dd`` of ``nbytes`` (rounded up to 16 MiB blocks) of zeros to ``folder``, fsynced: its bytes/s."""
    count = max(1, -(-nbytes // (16 * 2**20)))
    target = os.path.join(folder, "dd.bin")
    start = time.perf_counter()
    done = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=16M", f"count={count}", "conv=fsync"],
                          capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    os.unlink(target)
    said = re.search(r"copied, ([\d.]+) s, ([\d.]+ \w+/s)", done.stderr)
    return {"bytes": count * 16 * 2**20, "seconds": seconds, "bytes_per_s": count * 16 * 2**20 / seconds,
            "dd_said": said.group(0) if said else done.stderr.strip().splitlines()[-1:]}


def summarise(record: dict) -> dict:
    saves = record["saves"]
    sync = [s["blocked_s"] for s in saves if s["mode"] == "sync"]
    blocked = [s["blocked_s"] for s in saves if s["mode"] == "async"]
    writes = [s["write_s"] for s in saves if s["mode"] == "async"]
    during = [t for s in saves if s["mode"] == "async" for t in s["steps_during_write"]]
    size, dd = record["checkpoint_bytes"], record["dd"]["bytes_per_s"]
    return {"sync_blocked_s": statistics.median(sync), "async_blocked_s": statistics.median(blocked),
            "blocked_ratio": statistics.median(blocked) / statistics.median(sync),
            "async_write_s": statistics.median(writes),
            "write_bytes_per_s": size / statistics.median(writes),
            "write_vs_dd": size / statistics.median(writes) / dd,
            "idle_write_bytes_per_s": size / record["idle_write_s"],
            "idle_write_vs_dd": size / record["idle_write_s"] / dd,
            "sync_write_vs_dd": size / statistics.median(sync) / dd,
            "step_s_plain": statistics.median(record["plain_step_s"]),
            "step_s_during_write": statistics.median(during) if during else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params-m", type=float, default=102.0, help="million parameters (default 102)")
    parser.add_argument("--saves", type=int, default=4, help="saves of each kind (default 4)")
    parser.add_argument("--dir", default=None, help="where the checkpoints and dd's file go (default: a new "
                        "folder in the system's temporary directory)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "checkpoint" / "results" / "async_checkpoint.json"))
    parser.add_argument("--repeats", type=int, default=2, help="launches of each kind for the first save's ratio "
                        "(default 2: without, then with ud.reserve_async_save, in turn)")
    parser.add_argument("--reserve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_out:
        return worker(args)
    import provenance

    record = provenance.start()
    folder = args.dir or tempfile.mkdtemp(prefix="async_checkpoint_")
    os.makedirs(folder, exist_ok=True)
    first = []
    for repeat in range(args.repeats):
        for reserve in (False, True):
            got = _launch(args, folder, reserve)
            sync = statistics.median(r["blocked_s"] for r in got["saves"] if r["mode"] == "sync")
            first_async = next(r for r in got["saves"] if r["mode"] == "async")
            later = statistics.median(r["blocked_s"] for r in got["saves"] if r["mode"] == "async"
                                      and r is not first_async)
            first.append({"repeat": repeat, "reserved": reserve, "first_async_blocked_s": first_async["blocked_s"],
                          "later_async_blocked_s": later, "sync_blocked_s": sync,
                          "first_ratio": first_async["blocked_s"] / sync, "later_ratio": later / sync})
            if repeat == 0 and not reserve:
                record.update(got)  # the full figures: the first launch (no reservation)
    record["first_save"] = {
        "runs": first,
        "ratio_without_reserve": statistics.median(r["first_ratio"] for r in first if not r["reserved"]),
        "ratio_with_reserve": statistics.median(r["first_ratio"] for r in first if r["reserved"]),
        "later_ratio": statistics.median(r["later_ratio"] for r in first)}
    record["launcher"] = "torchrun --nproc_per_node 2 (CPU, gloo, OMP_NUM_THREADS=1)"
    record["dd"] = dd_bytes_per_s(folder, record["checkpoint_bytes"])
    record["summary"] = summarise(record)
    provenance.finish(record)
    record.pop("cpu_ticks_before", None)
    if not args.dir:
        shutil.rmtree(folder, ignore_errors=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    s, first = record["summary"], record["first_save"]
    print(f"blocked per save: sync {s['sync_blocked_s']:.3f} s, async {s['async_blocked_s']:.3f} s "
          f"(ratio {s['blocked_ratio']:.3f}); write {s['write_bytes_per_s'] / 1e6:.0f} MB/s while training "
          f"({s['write_vs_dd']:.2f} of dd's {record['dd']['bytes_per_s'] / 1e6:.0f} MB/s), idle "
          f"{s['idle_write_vs_dd']:.2f}; first async save / blocking: {first['ratio_without_reserve']:.3f} "
          f"({first['ratio_with_reserve']:.3f} after ud.reserve_async_save); results in {args.out}")


if __name__ == "__main__":
    main()
