"""``unified-dist plan`` measured: time and memory of 512-rank plans of a 1.1 B-parameter Llama, the
worked example of docs/plan.md (a tiny Llama at 8, 64 and 512 ranks), and the plan of the memory
benchmark's own worker (BERT and Llama, DDP, FSDP, HSDP 2 x 2, FSDP x TP 2 x 2) at 4 ranks against
the bytes its real ranks counted (bench/memory_layouts/results/memory_layouts.json, rank 0): held and saved
for backward;
and the collectives of one step of a tiny Llama planned and counted on real rank 0 under torchrun x 4
(bench/plan/plan_real_worker.py: the same dispatch-mode counter on the real process group).

    python bench/plan/plan_scale.py            # writes bench/plan/results/plan_scale.json

Each plan is one ``python -m unified_dist plan --json`` command, timed from outside (wall seconds);
its memory is the planning process's peak resident set (``peak_rss_bytes``, from the simulated
rank itself: the command's parent process only waits).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))
import provenance  # noqa: E402  (bench/shared/provenance.py)

LLAMA = "bench/plan/plan_llama.py"
WORKER = "bench/memory_layouts/memory_layouts_worker.py"

SCALE = {  # name -> (nnodes, nproc, flags, script args)
    "1b_fsdp_512": (64, 8, ["--sharding", "fsdp"], ["--size", "1b"]),
    "1b_fsdp_tp4_512": (64, 8, ["--sharding", "fsdp", "--tp", "4"], ["--size", "1b"]),
}
EXAMPLE = {
    "tiny_fsdp_8": (1, 8, ["--sharding", "fsdp"], ["--size", "tiny"]),
    "tiny_hsdp_64": (8, 8, ["--sharding", "fsdp", "--dp-replicate", "8"], ["--size", "tiny"]),
    "tiny_fsdp_tp_512": (64, 8, ["--sharding", "fsdp", "--tp", "8", "--activation-checkpointing",
                                 "--compare-checkpointing"], ["--size", "tiny"]),
    "tiny_tp16_512": (64, 8, ["--sharding", "fsdp", "--tp", "16"], ["--size", "tiny"]),
}
AGREEMENT = {  # the memory benchmark's layouts at 4 ranks (its worker sets them with ud.init itself)
    f"{model}_{layout}": (1, 4, [], ["--model", model, "--layouts", layout, "--steps", "1", "--out", "/tmp"])
    for model in ("bert", "llama") for layout in ("ddp", "fsdp", "hsdp", "fsdp_tp")
}
REAL = "bench/plan/plan_real_worker.py"
REAL_LAYOUTS = ("ddp", "fsdp", "hsdp", "fsdp_tp")
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast")
LIMITS = {"seconds": 60.0, "peak_rss_bytes": 4 * 2 ** 30, "agreement": 0.01, "collectives_differing": 0}


def plan(nnodes: int, nproc: int, flags: list, script: str, script_args: list) -> dict:
    """One ``unified-dist plan --json``: its report plus the command and its wall time."""
    cmd = [sys.executable, "-m", "unified_dist", "plan", "--json", "--nnodes", str(nnodes), "--nproc", str(nproc),
           *flags, script, *script_args]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    wall = time.perf_counter() - start
    crashed = {"error": {"type": "crash", "message": done.stderr[-500:]}}
    report = json.loads(done.stdout) if done.stdout.strip() else crashed
    report.update(command=" ".join(cmd[1:]).replace(sys.executable, "python"), wall_s=round(wall, 2))
    return report


def agreement(reports: dict, real_file: Path) -> dict:
    """Per model and layout: the plan's rank-0 bytes over the real rank 0's (memory_layouts.json)."""
    real = json.loads(real_file.read_text())
    out = {}
    for name, report in reports.items():
        model, _, layout = name.partition("_")
        row = next(r for r in real["rows"] if (r["model"], r["processes"], r["layout"]) == (model, 4, layout))
        planned = report["bytes"]["total"]
        out[name] = {"planned_total": planned, "real_total": row["bytes_per_rank"][0],
                     "ratio": planned / row["bytes_per_rank"][0],
                     "planned_saved": report["saved_for_backward"]["bytes"], "real_saved": row["saved_for_backward"],
                     "saved_ratio": report["saved_for_backward"]["bytes"] / row["saved_for_backward"],
                     "real_commit": real["commit"]}
    return out


def per_kind(rows: list) -> dict:
    """Bytes per collective kind (DDP's derived all-reduce included), and calls (``None`` where derived)."""
    out = {kind: {"bytes": 0, "calls": 0} for kind in KINDS}
    for row in rows:
        entry = out.setdefault(row["kind"], {"bytes": 0, "calls": 0})
        entry["bytes"] += row["bytes"]
        entry["calls"] = None if row["calls"] is None or entry["calls"] is None else entry["calls"] + row["calls"]
    return out


def collectives(tmp: Path) -> dict:
    """Per layout: the tiny Llama's step collectives planned at 4 ranks (rank 0) and counted on real rank 0
    (one ``torchrun`` x 4 launch of bench/plan/plan_real_worker.py), bytes per kind."""
    cmd = ["torchrun", "--standalone", "--nproc_per_node", "4", REAL, "--layouts", ",".join(REAL_LAYOUTS),
           "--out", str(tmp)]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "bench" / "shared")])}
    subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900, check=True)
    real = json.loads((tmp / "rank0.json").read_text())
    out = {"command": "OMP_NUM_THREADS=1 " + " ".join(cmd)}
    for layout in REAL_LAYOUTS:
        planned = plan(1, 4, [], REAL, ["--layouts", layout, "--out", str(tmp)])
        mine, theirs = per_kind(planned["collectives"]), per_kind(real[layout]["collectives"])
        out[layout] = {"planned": mine, "real": theirs, "held_planned": planned["bytes"]["total"],
                       "held_real": real[layout]["bytes"]["total"],
                       "differing": sorted(k for k in KINDS if mine[k]["bytes"] != theirs[k]["bytes"])}
    return out


def verdict(record: dict) -> dict:
    scale = record["scale"].values()
    ratios = [abs(a[key] - 1) for a in record["agreement"].values() for key in ("ratio", "saved_ratio")]
    return {
        "seconds": {"value": max(r["wall_s"] for r in scale), "limit": LIMITS["seconds"]},
        "peak_rss_bytes": {"value": max(r["peak_rss_bytes"] for r in scale), "limit": LIMITS["peak_rss_bytes"]},
        "agreement": {"value": max(ratios), "limit": LIMITS["agreement"]},
        "collectives_differing": {"value": sum(len(record["collectives"][name]["differing"]) for name in REAL_LAYOUTS),
                                  "limit": LIMITS["collectives_differing"]},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "bench" / "plan" / "results" / "plan_scale.json"))
    args = p.parse_args()
    record = {**provenance.start(), "limits": LIMITS}
    record["scale"] = {name: plan(n, g, flags, LLAMA, a) for name, (n, g, flags, a) in SCALE.items()}
    record["example"] = {name: plan(n, g, flags, LLAMA, a) for name, (n, g, flags, a) in EXAMPLE.items()}
    worker = {name: plan(n, g, flags, WORKER, a) for name, (n, g, flags, a) in AGREEMENT.items()}
    record["agreement"] = agreement(worker, ROOT / "bench" / "memory_layouts" / "results" / "memory_layouts.json")
    tmp = Path(tempfile.mkdtemp(prefix="ud-plan-real-"))
    try:
        record["collectives"] = collectives(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record["verdict"] = {k: {**v, "met": v["value"] is not None and v["value"] <= v["limit"]}
                         for k, v in verdict(record).items()}
    Path(args.out).write_text(json.dumps(provenance.finish(record), indent=1))
    for name, v in record["verdict"].items():
        print(f"{name}: {v['value']:.4g} (limit {v['limit']:.4g}, {'met' if v['met'] else 'MISSED'})")
    return 0 if all(v["met"] for v in record["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
