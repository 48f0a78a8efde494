"""DeepSpeed ZeRO against FSDP2 (issue 59): the paired step time of ZeRO-2 and ZeRO-3 against FSDP2, and the bytes
each rank holds at every ZeRO stage.

    python bench/deepspeed/deepspeed_bench.py [--repeats 3] [--steps 3] [--out FILE]

One launch of bench/deepspeed/deepspeed_worker.py through ``torchrun --standalone --nproc_per_node 2``
(``OMP_NUM_THREADS=1``): the example's model (examples/bert_sentiment's offline MiniLM-L6 BERT classifier, 22.7 M
parameters, AdamW over its decay groups, 16 x 64 tokens per rank and step) trained through the facade as FSDP2
(``ud.init(sharding="fsdp")``) and as DeepSpeed's engine (``ud.init(backend="deepspeed", zero_stage=S)``), one
session after another in the same two processes. Step time: per step the slowest rank, the median over
``--steps`` steps after a warm-up step; the ratios ZeRO-2 / FSDP2 and ZeRO-3 / FSDP2 are taken within each
repeat (the three layouts run back to back, in an order rotated by the repeat), and their median and range over
the repeats are reported. Bytes: parameters, DeepSpeed's float32 master copies and the AdamW state each rank holds
(the worker's docstring says how each is counted), per rank, for FSDP2 and ZeRO 0-3.

Results: bench/deepspeed/results/deepspeed.json with the commit, the command and the launch's command line.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))

import provenance  # noqa: E402
from run import launch, launch_command  # noqa: E402  (bench/shared/run.py)
from unified_dist.testing.launchers import TORCH_EXTENSIONS_DIR  # noqa: E402

WORKER = "bench/deepspeed/deepspeed_worker.py"
NPROC = 2
LABELS = {"fsdp": "FSDP2", "zero0": "ZeRO-0", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3"}
OUT = ROOT / "bench" / "deepspeed" / "results" / "deepspeed.json"


def step_time(reports: list) -> float:
    """The median over the timed steps of the slowest rank's time (``reports[r]``: rank r's layout report)."""
    return statistics.median(max(r["step_s"][i] for r in reports) for i in range(len(reports[0]["step_s"])))


def paired(per_rank: list) -> dict:
    """Per repeat, each timed layout's step time and ZeRO-2 / FSDP2, ZeRO-3 / FSDP2; then the ratios' median,
    lowest and highest over the repeats."""
    repeats = []
    for i in range(len(per_rank[0]["repeats"])):
        times = {name: step_time([ranks["repeats"][i][name] for ranks in per_rank])
                 for name in per_rank[0]["repeats"][i]}
        repeats.append({"order": list(per_rank[0]["repeats"][i]), "step_s": times,
                        **{f"{name}_vs_fsdp": times[name] / times["fsdp"] for name in ("zero2", "zero3")}})
    summary = {}
    for key in ("zero2_vs_fsdp", "zero3_vs_fsdp"):
        values = [r[key] for r in repeats]
        summary[key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return {"repeats": repeats, **summary}


def memory(per_rank: list) -> list:
    """One row per layout: each rank's bytes (from the first repeat, or the memory-only sessions)."""
    rows = []
    for name in LABELS:
        reports = [ranks["repeats"][0].get(name) or ranks["memory_only"][name] for ranks in per_rank]
        rows.append({"layout": name, "label": LABELS[name], "backend": reports[0]["backend"],
                     "stage": reports[0]["stage"], "elements": reports[0]["elements"],
                     "bytes_per_rank": [r["bytes"] for r in reports]})
    return rows


def summary(rows: list) -> dict:
    """Per layout, the larger rank's bytes of each kind (MiB) and its total's share of ZeRO-0's and of FSDP2's."""
    mib = 2 ** 20
    kinds = ("params", "master", "optimizer", "total")
    worst = {r["layout"]: {k: max(x[k] for x in r["bytes_per_rank"]) for k in kinds} for r in rows}
    return {name: {**{f"{k}_mib": v / mib for k, v in b.items()},
                   "total_vs_zero0": b["total"] / worst["zero0"]["total"],
                   "total_vs_fsdp": b["total"] / worst["fsdp"]["total"]} for name, b in worst.items()}


def table(record: dict) -> str:
    """A Markdown table of the per-rank bytes (MiB, the larger rank) and each layout's share of ZeRO-0's."""
    mib = 2 ** 20
    rows = record["memory"]
    zero0 = next(r for r in rows if r["layout"] == "zero0")
    base = max(b["total"] for b in zero0["bytes_per_rank"])
    lines = ["| layout | params MiB | fp32 master MiB | AdamW state MiB | **total MiB** | total / ZeRO-0 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        b = {k: max(x[k] for x in r["bytes_per_rank"]) for k in ("params", "master", "optimizer", "total")}
        lines.append(f"| {r['label']} | {b['params'] / mib:.1f} | {b['master'] / mib:.1f} | {b['optimizer'] / mib:.1f}"
                     f" | **{b['total'] / mib:.1f}** | {b['total'] / base:.3f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3, help="rounds of FSDP2, ZeRO-2 and ZeRO-3 in the launch")
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout and round, after one warm-up step")
    p.add_argument("--out", default=str(OUT))
    args = p.parse_args()
    out = Path(args.out)
    record = {**provenance.start(), "model": "examples/bert_sentiment (MiniLM-L6 BERT classifier), AdamW",
              "batch_per_rank": [16, 64], "processes": NPROC, "repeats": args.repeats, "steps": args.steps}
    tmp = Path(tempfile.mkdtemp(prefix="ud-deepspeed-"))
    try:
        worker_args = ["--repeats", str(args.repeats), "--steps", str(args.steps), "--out", str(tmp)]
        cmd, _ = launch_command("torch", NPROC, WORKER, worker_args)
        record["launch"] = "OMP_NUM_THREADS=1 " + " ".join(cmd)
        # DeepSpeed's CPU collectives op as make setup built it for this environment (not ~/.cache's, shared)
        ops = {"TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)}
        if not launch("torch", NPROC, WORKER, worker_args, timeout=1800, result=tmp / "rank0.json", extra_env=ops):
            record["exit_crash"] = True  # after the results were written: counted, not hidden
        per_rank = [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(NPROC)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record["step"] = paired(per_rank)
    record["memory"] = memory(per_rank)
    record["summary"] = summary(record["memory"])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(provenance.finish(record), indent=1))
    print(table(record))
    for key in ("zero2_vs_fsdp", "zero3_vs_fsdp"):
        s = record["step"][key]
        print(f"{key}: median {s['median']:.3f} (range {s['min']:.3f}-{s['max']:.3f} over {args.repeats} repeats)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
