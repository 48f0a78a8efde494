"""Streaming vs map-style data in the BERT example's training loop (issue #27), in one run:
samples per second with 1 and 2 processes, and the bytes of training data each rank reads from a
stream of one CSV file vs a stream of as many files (shards) as ranks.

    python bench/streaming/streaming.py [--rows 512] [--batch-size 16] [--repeats 5] [--out FILE]

Two launches of bench/streaming/streaming_worker.py (``python`` for 1 process, ``torchrun --standalone`` for 2;
``OMP_NUM_THREADS=1``, ``--threads 1``), each running examples/bert_sentiment/train.py's ``main()``
once per repeat and configuration, interleaved (repeat 1: every configuration, then repeat 2, ...):

- ``map``: map-style, ``--no-shuffle`` (tokenised once into an Arrow cache, before the loop);
- ``stream``: ``--streaming --no-shuffle``, one CSV file: every rank reads the whole stream and keeps
  its slice of each global batch (the same batches as ``map``: the same compute, so the difference
  is the data path: reading, tokenising on the fly, cutting the stream);
- ``stream-shuffled``: ``--streaming`` with the default shuffle buffer (1000 rows);
- ``stream-2-shards`` (2 processes): ``--streaming --no-shuffle --stream-shards 2``: each rank reads
  only its own file (read by shards in their canonical order, docs/streaming.md).

The first ``--rows`` training examples, ``--batch-size`` per process, ``--max-length`` tokens, one
epoch; repeat k uses ``--seed k`` in every configuration. Samples per second come from the example's
``metrics.jsonl`` (``--log-every 1``: each step's samples/s over its training time, evaluation and
checkpoints excluded): ``loop`` is rows / the summed step times (the whole epoch, the stream's
start included), ``step`` the median step. Ratios to ``map`` are paired within a repeat (adjacent in
time), median over repeats; on a shared machine another job's load comes and goes between runs, so
the best run of each configuration (the least disturbed) and the ratio of the bests are recorded too.
``loader alone``: after each run, the same training loader through ``ud.prepare`` iterated for an
epoch with no model (bench/streaming/streaming_worker.py's ``data_pass``): the examples of the epoch over the
slowest rank's seconds, median over repeats: what the data path itself costs.
Bytes per rank: the sizes of the training CSV files each rank opened for reading
(bench/streaming/streaming_worker.py says why that is what it read). Results: bench/streaming/results/streaming.json
with the commit, the command and each launch's command line.
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

WORKER = "bench/streaming/streaming_worker.py"
CONFIGS = {  # name -> the example's flags that make it
    "map": ["--no-shuffle"],
    "stream": ["--streaming", "--no-shuffle"],
    "stream-shuffled": ["--streaming"],
    "stream-2-shards": ["--streaming", "--no-shuffle", "--stream-shards", "2"],
}
RUNS = ((1, ("map", "stream", "stream-shuffled")), (2, ("map", "stream", "stream-shuffled", "stream-2-shards")))


def example_args(args: argparse.Namespace, config: str, seed: int, out: Path, cache: Path) -> list:
    return ["--limit-train", str(args.rows), "--limit-eval", str(args.eval_rows), "--max-length", str(args.max_length),
            "--batch-size", str(args.batch_size), "--epochs", "1", "--eval-every", "0", "--log-every", "1",
            "--threads", "1", "--no-progress", "--keep-checkpoints", "1", "--seed", str(seed),
            "--cache-dir", str(cache), "--output-dir", str(out), *(["--model", args.model] if args.model else []),
            *CONFIGS[config]]


def speeds(metrics: list, global_batch: int, rows: int) -> dict:
    """``loop``: rows / the epoch's summed step times; ``step``: the median step's samples/s (each
    logged step trained ``global_batch`` examples: the bench keeps --rows a multiple of it)."""
    steps = [r["samples_per_s"] for r in metrics if r["type"] == "train"]
    if len(steps) * global_batch != rows:
        raise RuntimeError(f"{len(steps)} logged steps of {global_batch} for {rows} rows")
    return {"loop": rows / sum(global_batch / s for s in steps), "step": statistics.median(steps)}


def data_only(reads: list, nproc: int) -> list:
    """Per repeat: the examples of the epoch (every rank's) over the slowest rank's seconds of the
    loader-only pass."""
    return [sum(reads[r][i]["data_only"]["examples"] for r in range(nproc))
            / max(max(reads[r][i]["data_only"]["seconds"] for r in range(nproc)), 1e-9)
            for i in range(len(reads[0]))]


def rows_of(nproc: int, configs: tuple, runs: list, per_rank: list) -> list:
    """One row per configuration: medians over the repeats, paired ratios to ``map`` of the same repeat."""
    rows = []
    for config in configs:
        mine = [run for run in runs if run["config"] == config]
        reads = [[entry for entry in ranks if entry["name"].startswith(config + "/")] for ranks in per_rank]
        row = {"processes": nproc, "config": config, "flags": CONFIGS[config], "repeats": len(mine),
               "loop_samples_per_s": statistics.median(r["loop"] for r in mine),
               "step_samples_per_s": statistics.median(r["step"] for r in mine),
               "loop_samples_per_s_best": max(r["loop"] for r in mine),
               "loop_samples_per_s_runs": [r["loop"] for r in mine],
               "bytes_per_rank": [max(e["bytes"] for e in rank) for rank in reads],
               "files_per_rank": [sorted({Path(o["path"]).name for e in rank for o in e["opened"]}) for rank in reads],
               "data_only_samples_per_s": statistics.median(data_only(reads, nproc)),
               "data_only_samples_per_s_runs": data_only(reads, nproc),
               "opens_per_rank_per_run": [max(len(e["opened"]) for e in rank) for rank in reads]}
        if config != "map":
            pairs = [(r["loop"], m["loop"]) for r in mine for m in runs
                     if m["config"] == "map" and m["seed"] == r["seed"]]
            row["loop_vs_map"] = statistics.median(a / b for a, b in pairs)
            row["best_vs_map"] = row["loop_samples_per_s_best"] / max(m["loop"] for m in runs if m["config"] == "map")
        rows.append(row)
    return rows


def table(rows: list) -> str:
    """The Markdown table docs/benchmarks/streaming.md shows (tools/docs_hook.py renders it when the site is built)."""
    lines = ["| processes | data | loop samples/s: median (runs) | / map-style, paired median | best run "
             "| best / map-style's best | loader alone, samples/s | training CSV bytes read per rank |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['loop_vs_map']:.3f}" if "loop_vs_map" in r else "1"
        best = f"{r['best_vs_map']:.3f}" if "best_vs_map" in r else "1"
        runs = ", ".join(f"{x:.1f}" for x in r["loop_samples_per_s_runs"])
        read = " / ".join(f"{b:,}" for b in r["bytes_per_rank"]) if any(r["bytes_per_rank"]) else "- (Arrow cache)"
        lines.append(f"| {r['processes']} | {r['config']} | {r['loop_samples_per_s']:.1f} ({runs}) | {ratio} "
                     f"| {r['loop_samples_per_s_best']:.1f} | {best} | {r['data_only_samples_per_s']:,.0f} | {read} |")
    return "\n".join(lines)


def summary(rows: list) -> dict:
    """The figures docs/benchmarks/streaming.md quotes: bytes per rank with as many shards as ranks over one shard."""
    one = next((r for r in rows if (r["processes"], r["config"]) == (2, "stream")), None)
    two = next((r for r in rows if (r["processes"], r["config"]) == (2, "stream-2-shards")), None)
    out = {}
    if one and two and max(one["bytes_per_rank"]):
        out["bytes_per_rank_2_shards_over_1_shard"] = max(two["bytes_per_rank"]) / max(one["bytes_per_rank"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=512, help="training rows (a multiple of 2 x --batch-size)")
    p.add_argument("--batch-size", type=int, default=16, help="examples per process per step")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--eval-rows", type=int, default=32, help="--limit-eval (evaluation is not timed)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", default=None, help="the example's --model (default: its own, the offline MiniLM-L6; "
                                                 "the suite's smoke run gives it the tests' 2-layer BERT)")
    p.add_argument("--out", default=str(ROOT / "bench" / "streaming" / "results" / "streaming.json"))
    args = p.parse_args()
    if args.rows % (2 * args.batch_size):
        p.error("--rows must be a multiple of 2 x --batch-size (every step a whole global batch)")
    out = Path(args.out)
    settings = ("rows", "batch_size", "max_length", "eval_rows", "repeats", "model")
    record = {**provenance.start(), "settings": {k: getattr(args, k) for k in settings},
              "launches": [], "runs": [], "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="ud-streaming-"))
    try:
        for nproc, configs in RUNS:
            where = tmp / f"{nproc}proc"
            where.mkdir()
            plan, runs = [], []
            for seed in range(args.repeats):
                for config in configs:
                    run_dir = where / f"{config}-s{seed}"
                    plan.append({"name": f"{config}/{seed}",
                                 "argv": example_args(args, config, seed, run_dir, tmp / "cache")})
                    runs.append({"config": config, "seed": seed, "dir": run_dir})
            (where / "plan.json").write_text(json.dumps(plan))
            worker_args = ["--plan", str(where / "plan.json"), "--out", str(where)]
            backend = "torch" if nproc > 1 else "single"
            cmd, _ = launch_command(backend, nproc, WORKER, worker_args)
            record["launches"].append("OMP_NUM_THREADS=1 " + " ".join(cmd))
            print(f"{nproc} process(es): {len(plan)} runs of the example", flush=True)
            if not launch(backend, nproc, WORKER, worker_args, timeout=3600, result=where / "rank0.json"):
                record.setdefault("exit_crashes", []).append(record["launches"][-1])
            per_rank = [json.loads((where / f"rank{r}.json").read_text()) for r in range(nproc)]
            for run in runs:
                metrics = [json.loads(line) for line in (run.pop("dir") / "metrics.jsonl").read_text().splitlines()]
                run.update(processes=nproc, **speeds(metrics, args.batch_size * nproc, args.rows))
            record["runs"].extend(runs)
            record["rows"].extend(rows_of(nproc, configs, runs, per_rank))
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(provenance.finish(dict(record)), indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    record["summary"] = summary(record["rows"])
    out.write_text(json.dumps(provenance.finish(record), indent=1))
    print(table(record["rows"]))
    print(json.dumps(record["summary"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
