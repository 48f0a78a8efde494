"""What every results file records: the commit measured, the exact command, the load around it,
and the share of CPU time the hypervisor took from this VM while it ran (steal)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def commit() -> str:
    """``git rev-parse --short HEAD``, with ``-dirty`` when tracked files outside the results folders
    (bench/<topic>/results/, tools/mutants/results/) differ
    from it (results an earlier part of the same run wrote do not change what is measured); ``$BENCH_COMMIT``
    instead where the sender of a copy set it (a copy's ``.git`` may be stale)."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    if os.environ.get("BENCH_COMMIT"):
        return os.environ["BENCH_COMMIT"]  # a copy of a checkout sent to another machine (a GPU's)
    try:
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no", "--", ".",
                                       ":(exclude)tools/mutants/results",
                                       ":(exclude,glob)bench/*/results/**") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def cpu_ticks() -> list:
    """The aggregate ``cpu`` line of /proc/stat (user nice system idle iowait irq softirq steal ...),
    in clock ticks since boot; empty where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return []


def steal_fraction(before: list, after: list):
    """Share of all CPU ticks between two :func:`cpu_ticks` readings that the hypervisor stole
    (field 8): time this VM wanted to run but another guest had the core. ``None`` if unknown."""
    if len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    return (after[7] - before[7]) / total if total > 0 else None


def busy_fraction(before: list, after: list):
    """Share of all CPU ticks between two :func:`cpu_ticks` readings in which a core worked (user, nice, system,
    irq, softirq, steal: all but idle and iowait), over every core of the machine: near 1 when the work was
    bound by the CPU, so that more processes side by side would only share the same cores. ``None`` if unknown."""
    if len(before) < 8 or len(after) < 8:
        return None
    total = sum(after[:8]) - sum(before[:8])
    idle = (after[3] + after[4]) - (before[3] + before[4])
    return (total - idle) / total if total > 0 else None


def cpu_model() -> str:
    """/proc/cpuinfo's model name, and whether the CPU has native bf16 (AVX-512 BF16 or AMX): the VM's
    CPU changes between sessions here, and bf16 timings depend on it."""
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    native = [f for f in ("avx512_bf16", "amx_bf16") if f in flags]
    return f"{name}; native bf16: {', '.join(native) if native else 'none'}"


def cpu_quota(proc_cgroup: str = "/proc/self/cgroup", mounts: str = "/sys/fs/cgroup"):
    """The CPUs this process may use per scheduling period by its control groups' quotas (the smallest along its
    group and the groups above it: cgroup v2's ``cpu.max``, v1's ``cpu.cfs_quota_us / cpu.cfs_period_us``), or
    ``None`` where none sets one. bench/suite_time/slower.py sets one to measure a slower machine on this one."""
    try:
        with open(proc_cgroup) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    found = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            base, read = Path(mounts) / "unified", _v2_quota
            if not (base / "cgroup.controllers").exists():
                base = Path(mounts)
        elif "cpu" in controllers.split(","):
            base, read = Path(mounts) / controllers, _v1_quota
            if not base.exists():
                base = Path(mounts) / "cpu"
        else:
            continue
        parts = [part for part in path.split("/") if part]
        for depth in range(len(parts) + 1):
            quota = read(base.joinpath(*parts[:depth]))
            if quota is not None:
                found.append(quota)
    return min(found) if found else None


def _v1_quota(folder: Path):
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v2_quota(folder: Path):
    try:
        quota, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return int(quota) / int(period) if quota != "max" and int(period) > 0 else None


def start() -> dict:
    """Provenance fields to put in a results file before measuring; call :func:`finish` after. ``cpu_quota`` where
    a control group cuts this process's CPU time (:func:`cpu_quota`)."""
    record = {"commit": commit(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
              "cpu": cpu_model(), "load_before": os.getloadavg(), "cpu_ticks_before": cpu_ticks()}
    quota = cpu_quota()
    if quota is not None:
        record["cpu_quota"] = round(quota, 3)
    return record


def finish(record: dict) -> dict:
    """``record`` with the load average after the measurement, and the steal and busy shares over it."""
    record["load_after"] = os.getloadavg()
    ticks = cpu_ticks()
    record["steal_fraction"] = steal_fraction(record.get("cpu_ticks_before", []), ticks)
    record["busy_fraction"] = busy_fraction(record.get("cpu_ticks_before", []), ticks)
    return record
