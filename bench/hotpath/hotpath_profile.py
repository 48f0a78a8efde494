"""Where the example's step spends its time, eager vs inductor, in one process (no DDP, no facade):
the reason behind bench/hotpath/hotpath.py's compiled / eager ratio on this CPU.

    python bench/hotpath/hotpath_profile.py [--steps 6] [--out bench/hotpath/results/hotpath_profile.json]

The example's MiniLM-L6 classifier on its batches (bench/step/common.py: 16 x 64 tokens, one thread,
AdamW), once eager and once ``model.compile()`` (what ``ud.prepare`` does to a one-process model),
steps alternating between the two copies; then one step of each under ``torch.profiler``: the ops
with the most self CPU time. Results with the commit and command.
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))
sys.path.insert(0, str(ROOT / "bench" / "step"))

import torch  # noqa: E402

import provenance  # noqa: E402
from common import model_and_batches  # noqa: E402  (bench/step/common.py)
from native_torch import train_step as make_step  # noqa: E402  (the plain step: forward, backward, clip, AdamW)


def top_ops(step, batch, n=12):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(batch)
    rows = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in rows)
    return {"self_cpu_total_ms": total / 1e3,
            "top": [{"op": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in rows[:n]]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "bench" / "hotpath" / "results" / "hotpath_profile.json"))
    args = p.parse_args(argv)
    record = provenance.start()
    args.warmup = 2
    model, batches = model_and_batches(args, 0, 1)
    twin = copy.deepcopy(model)
    twin.compile()
    steps = {"eager": make_step(model), "compiled": make_step(twin)}
    times = {"eager": [], "compiled": []}
    first = {}
    for i, batch in enumerate(batches):
        for name in (("eager", "compiled") if i % 2 == 0 else ("compiled", "eager")):
            start = time.perf_counter()
            steps[name](batch)
            elapsed = time.perf_counter() - start
            if i == 0:
                first[name] = elapsed
            elif i >= args.warmup:
                times[name].append(elapsed)
    ratios = [c / e for c, e in zip(times["compiled"], times["eager"])]
    record.update({"settings": vars(args), "threads": torch.get_num_threads(), "first_step_s": first,
                   "step_times_s": times, "median_step_s": {k: statistics.median(v) for k, v in times.items()},
                   "median_paired_ratio": statistics.median(ratios),
                   "profile": {name: top_ops(steps[name], batches[-1]) for name in steps}})
    provenance.finish(record)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps({k: record[k] for k in ("first_step_s", "median_step_s", "median_paired_ratio")}), flush=True)
    for name in steps:
        print(name, [(r["op"], round(r["self_cpu_ms"])) for r in record["profile"][name]["top"][:8]], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
