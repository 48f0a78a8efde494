"""Per-rank memory of each device-mesh layout (issue #26): bytes of parameters + gradients + AdamW
state each rank holds, bytes saved for backward with and without activation checkpointing, and
step time next to DDP in the same launch.

    python bench/memory_layouts/memory_layouts.py [--models bert,llama] [--steps 3] [--out FILE]

Per model, two launches of bench/memory_layouts/memory_layouts_worker.py through ``torchrun --standalone``
(``OMP_NUM_THREADS=1``), each cycling its layouts with ``ud.init(...)`` .. ``ud.shutdown()``:

- 4 processes: DDP (``ud.init()``), FSDP (``sharding="fsdp"``), HSDP 2x2 (``dp_replicate=2``),
  FSDP x TP 2x2 (``sharding="fsdp", tp=2``), FSDP + activation checkpointing;
- 2 processes: DDP and TP 2 (``tp=2``). Pure TP 2 on 4 ranks would leave 2 data-parallel ranks
  whose gradients only FSDP averages, and the facade refuses it ("add sharding='fsdp' or make tp
  the world size"), so the TP 2 row runs on 2 ranks, next to DDP on the same 2.

Models: the example's (examples/bert_sentiment: the offline MiniLM-L6 BERT classifier the example
loads, 22.7 M parameters, batches of 16 x 64 tokens per data-parallel rank; TP plan
``memory_layouts_worker.BERT_TP_PLAN``) and a ~97 M-parameter ``LlamaForCausalLM(LlamaConfig(...))``
built offline with random weights (``tp_plan="auto"``, 2 x 64 tokens). Byte counts are the largest
over the ranks (``bytes_per_rank`` has each); step time is, per step, the slowest rank, median
over ``--steps`` steps after one warm-up step (the one that counts the saved tensors).

Targets (exit 1 when one is missed or a row is missing), per model:
FSDP <= 1.05 x DDP / 4, HSDP 2x2 <= 1.05 x DDP / 2 (parameters + gradients + optimizer state per
rank, DDP of the same 4-process launch), and FSDP with activation checkpointing saving <= 0.35 x the
bytes FSDP without it saves for backward. Results: bench/memory_layouts/results/memory_layouts.json with the
commit, the command and each launch's command line.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))

import provenance  # noqa: E402
from run import launch, launch_command  # noqa: E402  (bench/shared/run.py)

WORKER = "bench/memory_layouts/memory_layouts_worker.py"
RUNS = ((4, "ddp,fsdp,hsdp,fsdp_tp,fsdp_ac"), (2, "ddp,tp"))
SHARDED = 1.05  # FSDP <= SHARDED x DDP / 4, HSDP 2x2 <= SHARDED x DDP / 2
AC_LIMIT = 0.35  # saved for backward with activation checkpointing <= AC_LIMIT x without
LABELS = {"ddp": "DDP", "fsdp": "FSDP", "hsdp": "HSDP 2x2", "fsdp_tp": "FSDP x TP 2x2", "tp": "TP 2",
          "fsdp_ac": "FSDP + activation checkpointing"}


def rows_of(model: str, nproc: int, per_rank: list) -> list:
    """One row per layout from the ranks' reports (``per_rank[r]`` = rank r's {layout: report})."""
    rows = []
    ddp_step = None
    for layout in per_rank[0]:
        reports = [ranks[layout] for ranks in per_rank]
        steps = [max(r["step_s"][i] for r in reports) for i in range(len(reports[0]["step_s"]))]
        step = statistics.median(steps)
        if layout == "ddp":
            ddp_step = step
        row = {"model": model, "processes": nproc, "layout": layout, "label": LABELS[layout],
               "mesh": reports[0]["mesh"],
               "bytes": {k: max(r["bytes"][k] for r in reports) for k in ("params", "grads", "optimizer", "total")},
               "bytes_per_rank": [r["bytes"]["total"] for r in reports],
               "local_param_numel_per_rank": [r["local_param_numel"] for r in reports],
               "saved_for_backward": max(r["saved_for_backward"]["bytes"] for r in reports),
               "step_s": step, "steps_s": steps, "ddp_step_s": ddp_step,
               "step_vs_ddp": None if ddp_step is None else step / ddp_step}
        rows.append(row)
    return rows


def _row(rows: list, model: str, nproc: int, layout: str):
    return next((r for r in rows if (r["model"], r["processes"], r["layout"]) == (model, nproc, layout)), None)


def verdict(rows: list, models: list) -> dict:
    """{target: {"value", "limit", "met"}} for each model; a missing row is a missed target."""
    out = {}
    for model in models:
        ddp, fsdp, hsdp, ac = (_row(rows, model, 4, name) for name in ("ddp", "fsdp", "hsdp", "fsdp_ac"))
        for name, row, share in (("FSDP <= 1.05 x DDP/4", fsdp, 4), ("HSDP 2x2 <= 1.05 x DDP/2", hsdp, 2)):
            value = None if ddp is None or row is None else row["bytes"]["total"] / (ddp["bytes"]["total"] / share)
            out[f"{model}: {name}"] = {"value": value, "limit": SHARDED,
                                       "met": value is not None and value <= SHARDED,
                                       "what": f"{name.split(' <=')[0]} bytes / (DDP bytes / {share})"}
        value = None if fsdp is None or ac is None or not fsdp["saved_for_backward"] else \
            ac["saved_for_backward"] / fsdp["saved_for_backward"]
        out[f"{model}: saved for backward with AC <= 0.35 x without"] = {
            "value": value, "limit": AC_LIMIT, "met": value is not None and value <= AC_LIMIT,
            "what": "FSDP + activation checkpointing saved bytes / FSDP saved bytes"}
    return out


def table(rows: list) -> str:
    """The Markdown table docs/benchmarks/memory.md shows (tools/docs_hook.py renders it when the site is built)."""
    mib = 2 ** 20
    lines = ["| model | processes | layout | params MiB | grads MiB | AdamW state MiB | **total MiB** | total / DDP "
             "| saved for backward MiB | step s | step / DDP |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ddp = _row(rows, r["model"], r["processes"], "ddp")
        b = r["bytes"]
        lines.append(f"| {r['model']} | {r['processes']} | {r['label']} | {b['params'] / mib:.1f}"
                     f" | {b['grads'] / mib:.1f} | {b['optimizer'] / mib:.1f} | **{b['total'] / mib:.1f}**"
                     f" | {b['total'] / ddp['bytes']['total']:.3f} | {r['saved_for_backward'] / mib:.1f}"
                     f" | {r['step_s']:.2f} | {r['step_vs_ddp']:.2f} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="bert,llama")
    p.add_argument("--steps", type=int, default=3, help="timed steps per layout, after one warm-up step")
    p.add_argument("--out", default=str(ROOT / "bench" / "memory_layouts" / "results" / "memory_layouts.json"))
    args = p.parse_args()
    models = args.models.split(",")
    out = Path(args.out)
    record = {**provenance.start(), "targets": {"sharded": SHARDED, "activation_checkpointing": AC_LIMIT},
              "steps": args.steps, "launches": [], "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="ud-memory-"))
    try:
        for model in models:
            for nproc, layouts in RUNS:
                where = tmp / f"{model}-{nproc}"
                where.mkdir()
                worker_args = ["--model", model, "--layouts", layouts, "--steps", str(args.steps), "--out", str(where)]
                cmd, _ = launch_command("torch", nproc, WORKER, worker_args)
                record["launches"].append("OMP_NUM_THREADS=1 " + " ".join(cmd))
                print(f"{model}, {nproc} processes: {layouts}", flush=True)
                if not launch("torch", nproc, WORKER, worker_args, timeout=1800, result=where / "rank0.json"):
                    record.setdefault("exit_crashes", []).append(record["launches"][-1])  # after the results
                per_rank = [json.loads((where / f"rank{r}.json").read_text()) for r in range(nproc)]
                record["rows"].extend(rows_of(model, nproc, per_rank))
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps(provenance.finish(dict(record)), indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record["verdict"] = verdict(record["rows"], models)
    out.write_text(json.dumps(provenance.finish(record), indent=1))
    print(table(record["rows"]))
    for name, v in record["verdict"].items():
        value = "missing" if v["value"] is None else f"{v['value']:.3f}"
        print(f"{name}: {value} ({'met' if v['met'] else 'MISSED'})")
    return 0 if all(v["met"] for v in record["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
