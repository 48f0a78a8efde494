"""The runner of ``unified-dist test --gpu`` (``make gpu-check``): every CUDA path of unified_dist in minutes,
on one GPU.

A GPU is lent rarely and for minutes, and a user with a GPU cluster wants one command to trust a
new install: this runs each check of :mod:`.gpu_checks` (in :data:`CHECKS`' order) in a worker
process, times each from the moment the worker starts it, and kills the worker's whole process
group when a check overruns its budget or the total budget runs out; the next worker goes on with
the checks left. A check that fails, hangs or crashes its worker fails alone. The table and a
results file (``bench/gpu/results/gpu_check_<date>.json`` in a checkout: commit, command, device, torch
and CUDA versions, each check's figure and pass/fail) come out at the end; docs/gpus.md renders
the newest one.

Without a GPU the command says so in one line and exits 0 (CI has none); ``--device cpu`` is the dry run
that runs every check's code on the CPU (it writes a results file only where ``--results`` says).

The command (:mod:`unified_dist.cli.selftest`) reads its options, asks whether there is a GPU and
prints; this module runs the checks and builds the record (:func:`run`). It imports no torch at
module level (docs builds read :data:`CHECKS`).
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from .processes import clean_environment, kill_tree

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TOTAL_S = 480.0
"""The whole run's budget (8 minutes, the first compile included)."""
START_S = 120.0
"""How long a worker may take to import torch and start its first check."""

CHECKS = (  # name, seconds it may take, what it checks (docs/gpus.md lists these)
    ("fsdp2", 60, "FSDP2 through `prepare` (`sharding=\"fsdp\"`) over NCCL: 3 SGD steps equal a CPU float64 run"),
    ("hsdp", 45, "HSDP's (Replicate, Shard) placement on a CUDA mesh: 3 SGD steps equal a CPU float64 run"),
    ("tensor_parallel", 45, "the TP plan (colwise, rowwise) on a CUDA `tp` mesh: 3 SGD steps equal a CPU float64 run"),
    ("pinned_cpu_offload", 45, "`cpu_offload=True`: shards on the CPU in pinned memory, training equal to a CPU "
                               "float64 run"),
    ("host_syncs_per_micro_step", 45, "host syncs per micro-step under NCCL (`torch.cuda.set_sync_debug_mode"
                                      "(\"warn\")`): 0 when accumulating, at most 1 when synchronising"),
    ("compile_speedup", 180, "`init(compile=...)` (inductor) against eager: step times, and the same weights"),
    ("fp16_grad_scaling", 60, "fp16 with the facade's GradScaler and SGD, Adam, AdamW: within 10% of a float64 run"),
    ("accelerate_mixed_precision", 60, "fp16 under the Accelerate backend: the torch backend's weights and skipped "
                                       "steps (Accelerate's GradScaler); float32 outside `ud.autocast()`"),
    ("cuda_rng_states", 30, "`ud.save`/`ud.load` of `ud.RNG` hold CUDA's generator states: the same draws again"),
    ("async_save_from_cuda", 60, "`ud.save(..., async_save=True)` of a model on the GPU: the file holds the weights "
                                 "of the call while the next step changes them; blocked time against a blocking save"),
    ("torch_sync_batchnorm", 90, "torch's CUDA SyncBatchNorm, 2 ranks on one GPU over gloo: equal to BatchNorm "
                                 "on the whole batch"),
    ("horovod_sync_batchnorm", 90, "Horovod's CUDA SyncBatchNorm under `horovodrun -np 2`: equal to BatchNorm on "
                                   "the whole batch"),
)
NAMES = tuple(name for name, _, _ in CHECKS)
BUDGET = {name: float(seconds) for name, seconds, _ in CHECKS}
WORKER = (sys.executable, "-m", "unified_dist.checks.gpu_checks")


# ---------------------------------------------------------------------- running the workers
def _worker_environment(device: str) -> Dict[str, str]:
    env = clean_environment(DEFAULT_TOTAL_S)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the dry run stays on the CPU on a GPU machine too
    return env


def _read(out: Path, name: str) -> Optional[Dict[str, Any]]:
    path = out / f"{name}.json"
    with contextlib.suppress(OSError, ValueError):
        return json.loads(path.read_text())
    return None


def _watch(proc: subprocess.Popen, pending: Sequence[str], out: Path, deadline: float,
           results: Dict[str, Dict[str, Any]], budget: Dict[str, float], poll: float = 0.2) -> None:
    """Collect the records of ``pending`` as the worker ``proc`` writes them; return when it exits,
    when its running check overruns (recorded ``timeout``), or when nothing started in time."""
    spawned = time.monotonic()
    while True:
        exited = proc.poll() is not None
        running = None
        for name in pending:
            record = _read(out, name)
            if record is None or name in results:
                continue
            if record["status"] == "running":
                running = (name, record)
            else:
                results[name] = record
        now = time.monotonic()
        if running:
            name, record = running
            took = time.time() - record["started"]
            if exited:
                results[name] = {"status": "FAIL", "seconds": round(took, 1),
                                 "detail": f"the worker died during it (exit status {proc.returncode})"}
                return
            if took > budget[name] or now > deadline:
                why = f"its {budget[name]:g}s" if took > budget[name] else "the run's total"
                results[name] = {"status": "timeout", "seconds": round(took, 1),
                                 "detail": f"still running after {took:.0f}s: killed at {why} budget"}
                return
        elif exited or now > deadline or now - spawned > START_S and not results.keys() & set(pending):
            return
        time.sleep(poll)


def run_checks(names: Sequence[str], device: str, total_s: float, budget: Dict[str, float] = BUDGET,
               worker: Sequence[str] = WORKER) -> List[Dict[str, Any]]:
    """Every check's record, in the order of ``names``: each ``worker`` (given ``--device DEVICE --out
    DIR NAME...``) runs the checks left, and is killed (its process group and descendants) when it
    returns from :func:`_watch`; ``budget`` holds each check's seconds."""

    results: Dict[str, Dict[str, Any]] = {}
    deadline = time.monotonic() + total_s
    env = _worker_environment(device)
    with tempfile.TemporaryDirectory(prefix="unified-dist-gpu-check-") as tmp:
        out = Path(tmp)
        while time.monotonic() < deadline:
            pending = [n for n in names if n not in results]
            if not pending:
                break
            argv = [*worker, "--device", device, "--out", tmp, *pending]
            with open(out / "worker.log", "a") as log:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                try:
                    _watch(proc, pending, out, deadline, results, budget)
                finally:  # the worker of a hung check, or what a finished one left (inductor's compile workers)
                    kill_tree(proc.pid)
                    proc.wait()
            if not results.keys() & set(pending):
                break  # the worker started nothing: another would not either
        log_path = out / "worker.log"
        tail = log_path.read_text(errors="replace").splitlines()[-5:] if log_path.exists() else []
    for name in names:
        results.setdefault(name, {"status": "not run", "detail": "the run's budget ran out or its worker did not start"
                                  + (f": {tail[-1][:200]}" if tail else "")})
    return [{"name": name, **results[name]} for name in names]


# ---------------------------------------------------------------------- the record and the table
def _provenance() -> Dict[str, Any]:
    """bench/shared/provenance.py's fields (commit, command, load, CPU) in a checkout; the command alone elsewhere."""
    path = PACKAGE_ROOT / "bench" / "shared" / "provenance.py"
    if path.exists():
        return _bench_provenance().start()
    return {"commit": "unknown (not a checkout)", "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "load_before": list(os.getloadavg())}


def _bench_provenance():
    """The checkout's bench/shared/provenance.py as a module (the library does not import its test helpers)."""
    import importlib.util

    path = PACKAGE_ROOT / "bench" / "shared" / "provenance.py"
    spec = importlib.util.spec_from_file_location("bench_provenance", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _finish(record: Dict[str, Any]) -> Dict[str, Any]:
    if (PACKAGE_ROOT / "bench" / "shared" / "provenance.py").exists():
        return _bench_provenance().finish(record)
    record["load_after"] = list(os.getloadavg())
    return record


def machine(device: str) -> Dict[str, Any]:
    """The device's name, torch's and CUDA's versions."""
    import torch

    name = torch.cuda.get_device_name(0) if device == "cuda" else "cpu (dry run: --device cpu)"
    return {"device": name, "torch": torch.__version__, "cuda": torch.version.cuda,
            "date": datetime.date.today().isoformat()}


def default_results_path(device: str, results: Optional[str]) -> Optional[Path]:
    """``--results``; else, for a GPU run, bench/gpu/results/gpu_check_<YYYYMMDD>.json in a checkout (the
    current folder elsewhere); the dry run writes none unless asked."""
    if results:
        return Path(results)
    if device != "cuda":
        return None
    folder = PACKAGE_ROOT / "bench" / "gpu" / "results"
    return (folder if folder.is_dir() else Path.cwd()) / f"gpu_check_{datetime.date.today():%Y%m%d}.json"


def figure_text(value: Any) -> str:
    """A check's figure in a few words (a number in 3 digits; a mapping's numbers with their names)."""
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {figure_text(v)}" for k, v in value.items() if not isinstance(v, list))
    return "-" if value is None else str(value)


def table(checks: Sequence[Dict[str, Any]]) -> str:
    lines = [f"{'check':<28}{'result':<9}{'seconds':>8}  figure / detail"]
    for c in checks:
        seconds = f"{c['seconds']:.1f}" if isinstance(c.get("seconds"), (int, float)) else "-"
        text = figure_text(c.get("figure")) if c["status"] in ("pass", "FAIL") and c.get("figure") is not None else ""
        text = "; ".join(filter(None, [text, c.get("detail", "")]))
        lines.append(f"{c['name']:<28}{c['status']:<9}{seconds:>8}  {text[:200]}".rstrip())
    return "\n".join(lines)


# ---------------------------------------------------------------------- the whole run
def run(names: Sequence[str], device: str, total_s: float) -> Dict[str, Any]:
    """The results file's record of checking ``names`` on ``device`` within ``total_s`` seconds: provenance,
    :func:`machine`, ``wall_s``, every check's record (``checks``), how many ``passed`` (or were skipped) of
    ``total``."""
    record = {**_provenance(), **machine(device)}
    start = time.perf_counter()
    checks = run_checks(names, device, total_s)
    record.update(_finish(record), wall_s=round(time.perf_counter() - start, 1), checks=checks,
                  passed=sum(c["status"] in ("pass", "skip") for c in checks), total=len(checks))
    record.pop("cpu_ticks_before", None)
    return record
