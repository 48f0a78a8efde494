"""The hot path of issue #28, in one run: the example's training step eager vs ``torch.compile``
through ``ud.prepare``, and the facade's step against each backend's native step.

    python bench/hotpath/hotpath.py [--repeats 3] [--steps 10] [--warmup 3] [--paired-steps 24] [--out FILE]
    python bench/hotpath/hotpath.py --smoke      # seconds: tiny batches, dynamo's 'eager' backend, torch only

(a) **Eager vs compiled** (torchrun x 2, torch backend): bench/step/facade.py (the example's MiniLM-L6
classifier on its Rotten Tomatoes batches, padded to --max-length so that every step has the same
shapes; AdamW, clipping, one thread per process) launched once plain and once with
``UNIFIED_DIST_COMPILE=1`` (what ``--compile``, ``unified-dist launch --compile inductor`` and
``accelerate launch --dynamo_backend inductor`` set: ``ud.prepare`` compiles the module DDP wraps in place),
alternately, ``--repeats`` times (the order swaps every repeat). Steady state: the median step after
``--warmup`` steps; compile time, reported apart: the warm-up steps' seconds minus as many steady
steps. The ratio compiled / eager is paired within a repeat (adjacent launches), median over repeats.
Each compiled launch starts with a fresh inductor cache (TORCHINDUCTOR_CACHE_DIR in a temporary
folder): every compile time is a cold one.

(b) **Facade vs native** per backend (torch, accelerate, horovod; 2 processes): bench/step/paired.py,
facade and native steps alternating in one launch (the order swapping every pair); the median of the
paired ratios.

Results: bench/hotpath/results/hotpath.json with the commit, the command, the load and steal around the run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))

import provenance  # noqa: E402
from run import BACKENDS, launch  # noqa: E402  (bench/shared/run.py)

TARGET_COMPILED = 0.85  # compiled / eager step time (issue #28)
TARGET_FACADE = 1.01  # facade / native step time


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3, help="eager/compiled launch pairs")
    p.add_argument("--steps", type=int, default=10, help="timed steps per eager/compiled launch")
    p.add_argument("--warmup", type=int, default=3, help="untimed first steps (compiling happens in them)")
    p.add_argument("--paired-steps", type=int, default=24, help="facade/native pairs per backend")
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--model", default=None, help="the steps' model folder (default: the example's, the offline "
                                                 "MiniLM-L6; the suite's smoke run gives the tests' 2-layer BERT)")
    p.add_argument("--compile-backend", default="inductor", help="what UNIFIED_DIST_COMPILE names")
    p.add_argument("--backends", default=",".join(BACKENDS), help="for (b), comma-separated")
    p.add_argument("--smoke", action="store_true",
                   help="seconds: 1 repeat of 2 steps, batches of 2 x 8 tokens, dynamo's eager backend, torch only")
    p.add_argument("--out", default=str(ROOT / "bench" / "hotpath" / "results" / "hotpath.json"))
    args = p.parse_args(argv)
    if args.smoke:
        args.repeats, args.steps, args.warmup, args.paired_steps = 1, 2, 2, 3
        args.batch_size, args.max_length, args.compile_backend, args.backends = 2, 8, "eager", "torch"
    return args


def compile_seconds(warmup_times: list, steady: float) -> float:
    """What the warm-up steps took beyond as many steady-state steps: compiling (and first-call costs)."""
    return sum(warmup_times) - len(warmup_times) * steady


def eager_vs_compiled(runs: list) -> dict:
    """``runs``: per repeat, ``{"eager": report, "compiled": report}`` of bench/step/facade.py."""
    ratios = [r["compiled"]["median_step_s"] / r["eager"]["median_step_s"] for r in runs]
    return {"eager_step_s": statistics.median(r["eager"]["median_step_s"] for r in runs),
            "compiled_step_s": statistics.median(r["compiled"]["median_step_s"] for r in runs),
            "compiled_over_eager": statistics.median(ratios), "compiled_over_eager_per_repeat": ratios,
            "compile_s_per_repeat": [compile_seconds(r["compiled"]["warmup_step_times_s"],
                                                     r["compiled"]["median_step_s"]) for r in runs],
            "eager_warmup_extra_s_per_repeat": [compile_seconds(r["eager"]["warmup_step_times_s"],
                                                                r["eager"]["median_step_s"]) for r in runs],
            "target": TARGET_COMPILED}


def facade_vs_native(paired: dict) -> dict:
    """A bench/step/paired.py report, summarised."""
    ratios = paired["paired_ratios"]
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [ratios[0]] * 3
    return {"facade_step_s": paired["median_step_s"]["facade"], "native_step_s": paired["median_step_s"]["native"],
            "ratio": paired["median_paired_ratio"], "ratio_iqr": [q[0], q[2]], "paired_steps": len(ratios),
            "target": TARGET_FACADE}


def main(argv=None) -> int:
    args = parse_args(argv)
    record = provenance.start()
    record["settings"] = {k: getattr(args, k) for k in ("repeats", "steps", "warmup", "paired_steps", "batch_size",
                                                        "max_length", "compile_backend", "backends", "smoke", "model")}
    record["loads"] = {}
    shape = ["--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
             *(["--model", args.model] if args.model else [])]
    with tempfile.TemporaryDirectory(prefix="hotpath-") as tmp:
        tmp = Path(tmp)
        runs = []
        for repeat in range(args.repeats):
            order = ("eager", "compiled") if repeat % 2 == 0 else ("compiled", "eager")
            pair = {}
            for variant in order:
                path = tmp / f"{variant}-{repeat}.json"
                env = {"UNIFIED_DIST_COMPILE": args.compile_backend if variant == "compiled" else "0",
                       "TORCHINDUCTOR_CACHE_DIR": str(tmp / f"inductor-{variant}-{repeat}")}
                record["loads"][f"{variant}-{repeat}"] = os.getloadavg()
                launch("torch", 2, "bench/step/facade.py",
                       ["--out", str(path), "--steps", str(args.steps), "--warmup", str(args.warmup), *shape],
                       result=path, extra_env=env)
                pair[variant] = json.loads(path.read_text())
                print(f"{variant} repeat {repeat}: median step {pair[variant]['median_step_s']:.3f} s, warm-up "
                      f"{[round(t, 2) for t in pair[variant]['warmup_step_times_s']]} s", flush=True)
            runs.append(pair)
        record["eager_vs_compiled"] = {**eager_vs_compiled(runs), "launcher": "torchrun x 2", "runs": runs}
        summary = record["eager_vs_compiled"]
        print(f"compiled / eager: {summary['compiled_over_eager']:.3f} (per repeat "
              f"{[round(r, 3) for r in summary['compiled_over_eager_per_repeat']]}); compile "
              f"{[round(s, 1) for s in summary['compile_s_per_repeat']]} s", flush=True)

        record["facade_vs_native"] = {}
        for backend in args.backends.split(","):
            path = tmp / f"paired-{backend}.json"
            record["loads"][f"paired-{backend}"] = os.getloadavg()
            launch(backend, 2, "bench/step/paired.py",
                   ["--out", str(path), "--steps", str(args.paired_steps), "--warmup", "2", *shape], result=path)
            paired = json.loads(path.read_text())
            record["facade_vs_native"][backend] = {**facade_vs_native(paired), "paired": paired}
            row = record["facade_vs_native"][backend]
            print(f"facade / native {backend}: {row['ratio']:.3f} [{row['ratio_iqr'][0]:.3f}-"
                  f"{row['ratio_iqr'][1]:.3f}] over {row['paired_steps']} paired steps", flush=True)
    provenance.finish(record)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
