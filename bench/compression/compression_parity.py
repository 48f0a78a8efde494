"""The example with and without gradient compression: per-step losses and final accuracy, per backend.

    python bench/compression/compression_parity.py [--backends torch,accelerate,horovod] [--format bf16]
                                       [--short] [--out FILE]

For each backend, examples/bert_sentiment/train.py runs twice with 2 processes under its launcher
(``unified-dist launch``'s line, as bench/shared/run.py starts it), once in float32 and once with
``UNIFIED_DIST_GRADIENT_COMPRESSION`` (bf16; fp16 on Horovod, which has no bf16 compressor), the
same seed, no dropout. Reported: the largest relative difference of the logged per-step losses
(the stated tolerance: 1e-4 over the first steps; a bf16-rounded gradient moves each AdamW update
by about 2^-8 of the learning rate, which changes these losses by ~1e-6; later steps compound the
rounding and are reported, not checked), and the test accuracy of both runs and their difference
in points (target: within 0.5 points). A lower bound says the compression ran: both runs are
deterministic (same seed, no dropout, one thread), so without compression every loss would be the
same float32 bit for bit; at least one loss (any step) must differ by more than one float32 rounding
step, 2^-23 relative (measured: 3.5e-7 with fp16 and 9.2e-7 with bf16 over the 8 steps of
``--short``). The run exits 1 when any check fails. ``--short``: 8 steps on 256 training and 50
test examples (the loss checks only); the default is the example's full epoch.
The results JSON (default bench/compression/results/compression_parity[_short].json) records the commit and
the command lines.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))

import provenance  # noqa: E402
from run import launch_command  # noqa: E402  (bench/shared/run.py)
from unified_dist.settings import TABLE  # noqa: E402

ENV_VAR = TABLE["gradient_compression"].variable

SCRIPT = "examples/bert_sentiment/train.py"
SHORT = ["--max-steps", "8", "--limit-train", "256", "--limit-eval", "50", "--max-length", "32", "--batch-size", "8"]
COMMON = ["--no-dropout", "--log-every", "1", "--no-progress", "--eval-every", "0"]
SIXTEEN_BIT = {"horovod": "fp16"}  # Horovod has no bf16 compressor (unified_dist.backends.compression)
LOSS_RTOL = 1e-4
FLOAT32_STEP = 2.0 ** -23  # the relative spacing of float32s near a value is 2^-24..2^-23 of it
FIRST_STEPS = 8  # the loss tolerance holds over the first steps; later, rounding differences compound
ACCURACY_POINTS = 0.5  # full run: compressed test accuracy within this many points of float32


def run_example(backend: str, fmt: str, args: list, out: Path) -> dict:
    cmd, env = launch_command(backend, 2, SCRIPT, [*args, "--output-dir", str(out)])
    env[ENV_VAR] = fmt
    done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}")
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if line.strip() and json.loads(line)["type"] == "train"]
    results = json.loads((out / "results.json").read_text())
    return {"command": f"{ENV_VAR}={fmt} {' '.join(cmd)}", "losses": losses,
            "test_accuracy": results["test_accuracy"], "wall_time_s": results["wall_time_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="torch,accelerate,horovod")
    p.add_argument("--format", default="bf16", choices=("bf16", "fp16"))
    p.add_argument("--short", action="store_true")
    p.add_argument("--out")
    args = p.parse_args()
    out = (Path(args.out) if args.out
           else ROOT / "bench" / "compression" / "results" / f"compression_parity{'_short' if args.short else ''}.json")
    example_args = [*(SHORT if args.short else []), *COMMON]
    record = {**provenance.start(), "loss_rtol": LOSS_RTOL, "example_args": example_args, "rows": []}
    tmp = Path(tempfile.mkdtemp(prefix="ud-parity-"))
    try:
        for backend in args.backends.split(","):
            fmt = SIXTEEN_BIT.get(backend, args.format) if args.format == "bf16" else args.format
            plain = run_example(backend, "none", example_args, tmp / f"{backend}-none")
            packed = run_example(backend, fmt, example_args, tmp / f"{backend}-{fmt}")
            rel = [abs(a - b) / abs(a) for a, b in zip(plain["losses"], packed["losses"])]
            worst = max(rel[:FIRST_STEPS])
            points = 100 * (packed["test_accuracy"] - plain["test_accuracy"])
            row = {"backend": backend, "compression": fmt, "max_loss_rel_diff": worst, "first_steps": FIRST_STEPS,
                   "max_loss_rel_diff_all_steps": max(rel), "steps": len(rel),
                   "losses_within_tolerance": worst <= LOSS_RTOL and len(plain["losses"]) == len(packed["losses"]),
                   "compression_changed_losses": max(rel) > FLOAT32_STEP,
                   "accuracy_points_diff": points,
                   "accuracy_within_target": None if args.short else abs(points) <= ACCURACY_POINTS,
                   "float32": plain, "compressed": packed}
            record["rows"].append(row)
            print(f"{backend} {fmt}: max loss rel diff {worst:.2e} over the first {FIRST_STEPS} steps "
                  f"({max(rel):.2e} over all {len(rel)}"
                  f"{'' if row['compression_changed_losses'] else ': NOT above float32 rounding, no compression'}); "
                  "test accuracy "
                  f"{plain['test_accuracy']:.4f} -> {packed['test_accuracy']:.4f} "
                  f"({row['accuracy_points_diff']:+.2f} points)", flush=True)
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(provenance.finish(dict(record)), indent=1))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out.write_text(json.dumps(provenance.finish(record), indent=1))
    return 0 if all(r["losses_within_tolerance"] and r["compression_changed_losses"]
                    and r["accuracy_within_target"] is not False for r in record["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
