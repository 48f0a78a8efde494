"""Pipeline parallelism's cost on this machine (issue 61, item 7): the step time of GPipe and 1F1B
against the unpipelined step, and the bubble fraction, measured and in theory.

    python bench/pipeline/pipeline_bench.py [--steps 7] [--out bench/pipeline/results/pipeline.json]

One launch of bench/pipeline/pipeline_worker.py under ``torchrun --standalone --nproc_per_node 2``
(``OMP_NUM_THREADS=1``): 2 stages, microbatches 2, 4 and 8, both schedules, and the unpipelined step
(one process, the whole model and batch) in the same processes, so the ratios compare times taken
side by side; absolute times are for this machine only. Per configuration:

- ``step_s``: the median over ``--steps`` steps of the slowest rank's step;
- ``ratio_to_unpipelined``: that over the unpipelined step's median (2 stages on 2 cores: 0.5 would be
  a perfect pipeline, no bubble, no messages);
- ``bubble_measured``: ``1 - mean busy / step``, where a rank's busy time is its stage's forward and
  backward of the step's microbatches run alone (the rest of the step it waits for the other stage or
  for a message); ``bubble_theory``: ``(P - 1) / (M + P - 1)``, the idle share of a balanced pipeline
  of P stages and M microbatches with free messages (GPipe's and 1F1B's alike: 1F1B holds fewer
  activations, not fewer bubbles);
- ``parameter_bytes_per_rank``: what each stage holds, against the whole model's bytes;
- ``activation_peak_bytes_per_rank``: the most bytes of activations autograd held for backward at once on each
  rank during one step (the worker's ``ActivationBytes``), and ``activation_peak_vs_gpipe_per_rank`` that over GPipe's
  at the same microbatch count, beside its theory ``in_flight / M`` (:func:`in_flight`).

Results carry their provenance (commit, command, load, steal; bench/shared/provenance.py).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))

import provenance  # noqa: E402
from run import TMP, launch  # noqa: E402  (bench/shared/run.py)

WORKER = "bench/pipeline/pipeline_worker.py"
STAGES = 2


def summarise(raw: dict) -> dict:
    """The results file's body from the worker's record: medians, ratios and bubbles per configuration."""
    plain = statistics.median(raw["unpipelined_step_s"])
    whole = raw["model"]["parameters"] * 4  # float32
    rows = []
    for row in raw["pipelined"]:
        step = statistics.median(row["step_s"])
        busy = statistics.mean(row["busy_s_per_rank"])
        m = row["microbatches"]
        rows.append({**row, "step_s_median": step, "ratio_to_unpipelined": step / plain,
                     "bubble_measured": 1 - busy / step, "bubble_theory": (STAGES - 1) / (m + STAGES - 1),
                     "parameter_share_per_rank": [b / whole for b in row["parameter_bytes_per_rank"]]})
    for row in rows:  # each schedule's activation peak against GPipe's at the same microbatches, per rank
        gpipe = next(r for r in rows if r["schedule"] == "gpipe" and r["microbatches"] == row["microbatches"])
        row["activation_peak_vs_gpipe_per_rank"] = [mine / theirs for mine, theirs in zip(
            row["activation_peak_bytes_per_rank"], gpipe["activation_peak_bytes_per_rank"])]
        row["activation_peak_vs_gpipe_theory"] = [in_flight(row["schedule"], row["microbatches"], i) /
                                                  row["microbatches"] for i in range(STAGES)]
    return {"stages": STAGES, "model": raw["model"], "unpipelined_step_s": raw["unpipelined_step_s"],
            "unpipelined_step_s_median": plain, "configs": rows}


def in_flight(schedule: str, microbatches: int, stage: int) -> int:
    """Microbatches whose activations stage ``stage`` (of :data:`STAGES`) holds at once: GPipe runs every forward
    before any backward (all M); torch's 1F1B runs ``min(M, P - stage)`` forwards, then a backward before each
    further forward (``Schedule1F1B``'s warm-up), so it never holds more."""
    return microbatches if schedule == "gpipe" else min(microbatches, STAGES - stage)


def report(record: dict) -> list:
    """The results as Markdown lines (a table per configuration)."""
    lines = [f"unpipelined step (1 process, whole model and batch): {record['unpipelined_step_s_median']:.3f} s",
             "", "| schedule | microbatches | step (s) | / unpipelined | bubble measured | bubble theory |"
             " parameters per rank | activations at peak per rank (MiB) | / GPipe's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in record["configs"]:
        share = ", ".join(f"{s:.0%}" for s in row["parameter_share_per_rank"])
        peaks = ", ".join(f"{b / 2**20:.1f}" for b in row["activation_peak_bytes_per_rank"])
        versus = ", ".join(f"{r:.3g}" for r in row["activation_peak_vs_gpipe_per_rank"])
        lines.append(f"| {row['schedule']} | {row['microbatches']} | {row['step_s_median']:.3f} | "
                     f"{row['ratio_to_unpipelined']:.2f} | {row['bubble_measured']:.0%} | {row['bubble_theory']:.0%} |"
                     f" {share} | {peaks} | {versus} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--out", default=str(ROOT / "bench" / "pipeline" / "results" / "pipeline.json"))
    args = parser.parse_args()
    record = provenance.start()
    TMP.mkdir(parents=True, exist_ok=True)
    raw_path = TMP / "pipeline_raw.json"
    launch("torch", 2, WORKER, ["--out", str(raw_path), "--steps", str(args.steps)], result=raw_path)
    record.update(summarise(json.loads(raw_path.read_text())))
    record["launch"] = f"torchrun --standalone --nproc_per_node 2 {WORKER} --steps {args.steps}"
    provenance.finish(record)
    record.pop("cpu_ticks_before", None)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(report(record)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
