"""Benchmarks of unified_dist (results and machines: docs/benchmarks/ and docs/changelog.md).

    python bench/shared/run.py [--short] [--only overhead,collectives,scaling,accuracy]

1. overhead     the example's training step through the facade vs hand-written native code,
                per backend (2 processes): facade and native steps alternating in one launch
                (median paired ratio), plus separate interleaved launches for peak RSS per rank.
2. collectives  all_reduce / all_gather through the facade vs the raw backend call, 4 KB-64 MB,
                uneven vs even all_gather, check mode's cost (bench/collectives/collectives_worker.py).
3. scaling      training samples/s with 1 and 2 processes (1 thread each) per backend.
4. accuracy     wall time to 80% test accuracy: the example (1 and 2 processes) vs Hugging Face
                Trainer (bench/time_to_accuracy/time_to_accuracy.py); skipped by --short.
Results: bench/step/results/{overhead,scaling}.json, bench/collectives/results/collectives.json (each
benchmark's folder), bench/summary.md over all four, and PNG plots beside their results.
This file also holds the launch helpers the other benchmarks share (launch_command, launch).
Ratios are always measured side by side in one run; absolute times are for this machine only.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
RESULTS = {"overhead": BENCH / "step" / "results", "scaling": BENCH / "step" / "results",
           "collectives": BENCH / "collectives" / "results"}
"""Where each part's results file goes: the folder of the benchmark it runs."""
TMP = BENCH / "tmp"  # the workers' per-launch files (git ignores it)
sys.path.insert(0, str(ROOT))

import provenance  # noqa: E402  (bench/shared/provenance.py, beside this file)
from unified_dist.backends.buckets import horovod_env  # noqa: E402
from unified_dist.backends.ports import free_port  # noqa: E402
from unified_dist.cli import launch as ud_launch  # noqa: E402
from unified_dist.registry import LAUNCHED  # noqa: E402
from unified_dist.testing.launchers import BIN, TORCH_EXTENSIONS_DIR, run  # noqa: E402

BACKENDS = LAUNCHED
NO_FINITE_CHECK = "facade_without_finite_check"


def launch_command(backend: str, nproc: int, script: str, args: list) -> tuple:
    """``(argv, env)`` that start ``script`` under ``backend``'s launcher on a free port (``python``
    for ``single``), one thread per process, this checkout's unified_dist first on the path, and the
    environment's bin/ first on PATH with the tests' ``TORCH_EXTENSIONS_DIR``: DeepSpeed's compiled op,
    which ``make setup`` builds once there, is built again (minutes) under another ``ninja``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               PATH=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    env.setdefault("TORCH_EXTENSIONS_DIR", TORCH_EXTENSIONS_DIR)
    if backend == "single":
        return [sys.executable, script, *args], env
    if backend == "horovod":  # the cycle the facade would set, given to native Horovod too: same settings on both sides
        from unified_dist.backends.base import Backend

        env.update(horovod_env(None, env, on_cpu=Backend.device_for(0).type == "cpu"))
    plan = ud_launch.Plan(backend=backend, script=script, script_args=tuple(args), nproc=nproc,
                          master_port=free_port())
    command = ud_launch.build(plan)
    return list(command.argv), ud_launch.environment(command, env)


def launch(backend: str, nproc: int, script: str, args: list, timeout: float = 900, result: Path = None,
           extra_env: dict = None) -> bool:
    """Run ``script`` under ``backend``'s launcher (``python`` for nproc=1 without backend).

    Returns False when the job failed *after* writing ``result`` (its timings are complete):
    plain DDP/Accelerate scripts sometimes abort at exit ("terminate called without an active
    exception", gloo threads racing interpreter shutdown); that is counted, not hidden.
    """
    if result is not None and result.exists():
        result.unlink()
    cmd, env = launch_command(backend, nproc, script, args)
    env.update(extra_env or {})
    done = run(cmd, timeout, env=env, cwd=ROOT)  # on timeout the launcher's whole process tree is killed
    if done.returncode == 0:
        return True
    if done.timed_out:
        raise RuntimeError(f"{' '.join(cmd)} timed out after {timeout:g}s:\n{done.output[-3000:]}")
    if result is not None and result.exists() and "terminate called without an active exception" in done.output:
        print(f"  (exit crash after the measurement: {' '.join(cmd[:3])} ... {script})", flush=True)
        return False
    raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.output[-3000:]}")


def overhead(short: bool) -> dict:
    """Step-time ratio from facade/native steps alternating in one launch (bench/step/paired.py),
    plus separate launches of each (interleaved) for peak RSS per rank and a cross-check."""
    reps = 1 if short else 2
    steps = ["--steps", "6" if short else "14", "--warmup", "2"]
    paired_steps = ["--steps", "8" if short else "24", "--warmup", "2"]
    out = {}
    TMP.mkdir(parents=True, exist_ok=True)
    for backend in BACKENDS:
        path = TMP / f"paired_{backend}.json"
        launch(backend, 2, "bench/step/paired.py", ["--out", str(path), *paired_steps], result=path)
        paired = json.loads(path.read_text())
        # torch also runs the facade with its per-step finite-loss exchange off (UNIFIED_DIST_CHECK_FINITE=0)
        variants = ("facade", "native") + ((NO_FINITE_CHECK,) if backend == "torch" else ())
        runs = {v: [] for v in variants}
        crashes = {v: 0 for v in variants}
        for rep in range(reps):  # interleaved: facade, native, [facade without the check,] facade, native...
            for variant in variants:
                script = f"bench/step/{'native_' + backend if variant == 'native' else 'facade'}.py"
                path = TMP / f"step_{backend}_{variant}_{rep}.json"
                crashes[variant] += not launch(backend, 2, script, ["--out", str(path), *steps], result=path,
                                               extra_env={"UNIFIED_DIST_CHECK_FINITE": "0"}
                                               if variant == NO_FINITE_CHECK else None)
                runs[variant].append(json.loads(path.read_text()))
        med = {v: statistics.median(r["median_step_s"] for r in runs[v]) for v in runs}
        rss = {v: max(max(r["peak_rss_mib_per_rank"]) for r in runs[v]) for v in runs}
        q = statistics.quantiles(paired["paired_ratios"], n=4)
        out[backend] = {"facade_step_s": paired["median_step_s"]["facade"],
                        "native_step_s": paired["median_step_s"]["native"],
                        "ratio": paired["median_paired_ratio"], "ratio_iqr": [q[0], q[2]],
                        "paired_steps": len(paired["paired_ratios"]),
                        "separate_launch_ratio": med["facade"] / med["native"],
                        "separate_launch_medians": {v: [r["median_step_s"] for r in runs[v]] for v in runs},
                        "facade_peak_rss_mib": rss["facade"], "native_peak_rss_mib": rss["native"],
                        "reps": reps, "exit_crashes": crashes}
        print(f"overhead {backend}: paired ratio {out[backend]['ratio']:.3f} [{q[0]:.3f}-{q[2]:.3f}] "
              f"(separate launches {out[backend]['separate_launch_ratio']:.3f}); peak RSS facade "
              f"{rss['facade']:.0f} MiB native {rss['native']:.0f} MiB; exit crashes {crashes}", flush=True)
        if NO_FINITE_CHECK in med:
            out[backend]["finite_check_off_vs_on"] = med[NO_FINITE_CHECK] / med["facade"]
            print(f"overhead {backend}: separate-launch median step, facade {med['facade']:.3f} s, without the "
                  f"finite check {med[NO_FINITE_CHECK]:.3f} s, native {med['native']:.3f} s", flush=True)
    return out


def collectives(short: bool) -> dict:
    sizes = "4,1024,65536" if short else "4,64,1024,16384,65536"
    out = {}
    for backend in BACKENDS:
        path = TMP / f"collectives_{backend}.json"
        launch(backend, 2, "bench/collectives/collectives_worker.py",
               ["--out", str(path), "--sizes-kb", sizes, "--rounds", "5" if short else "21"])
        out[backend] = json.loads(path.read_text())["rows"]
        for row in out[backend]:
            print(f"collectives {backend} {row['size_kb']:>6} KB: all_reduce x{row['all_reduce_ratio']:.3f} "
                  f"all_gather x{row['all_gather_ratio']:.3f} uneven/even x{row['uneven_vs_even_ratio']:.3f} "
                  f"checkmode x{row['checkmode_ratio']:.3f} | facade CPU {row['all_reduce_cpu_overhead_us']:+.0f} / "
                  f"{row['all_gather_cpu_overhead_us']:+.0f} us per call", flush=True)
    return out


def scaling(short: bool) -> dict:
    steps = ["--steps", "5" if short else "10", "--warmup", "2"]
    out = {}
    for backend in BACKENDS:
        row = {}
        for nproc in (1, 2):
            path = TMP / f"scaling_{backend}_{nproc}.json"
            launch(backend, nproc, "bench/step/facade.py", ["--out", str(path), *steps])
            data = json.loads(path.read_text())
            row[f"samples_per_s_{nproc}"] = data["batch_size"] * nproc / data["median_step_s"]
        row["efficiency"] = row["samples_per_s_2"] / (2 * row["samples_per_s_1"])
        out[backend] = row
        print(f"scaling {backend}: {row['samples_per_s_1']:.1f} -> {row['samples_per_s_2']:.1f} samples/s "
              f"(efficiency {row['efficiency']:.2f})", flush=True)
    return out


def machine() -> dict:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--short", action="store_true", help="the quick version (make bench): fewer reps and sizes")
    p.add_argument("--only", default="overhead,collectives,scaling,accuracy")
    args = p.parse_args()
    parts = args.only.split(",")
    if args.short and "accuracy" in parts:
        parts.remove("accuracy")
    TMP.mkdir(parents=True, exist_ok=True)
    suffix = "_short" if args.short else ""
    for name, fn in (("overhead", overhead), ("collectives", collectives), ("scaling", scaling)):
        if name in parts:
            record = provenance.start()
            data = {**record, "machine": machine(), "short": args.short, "results": fn(args.short)}
            provenance.finish(data)
            (RESULTS[name] / f"{name}{suffix}.json").write_text(json.dumps(data, indent=1))
    if "accuracy" in parts:
        subprocess.run([sys.executable, "bench/time_to_accuracy/time_to_accuracy.py"], cwd=ROOT, check=True)
    subprocess.run([sys.executable, "bench/shared/report.py", *(["--short"] if args.short else [])], cwd=ROOT,
                   check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
