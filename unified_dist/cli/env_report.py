"""``unified-dist env``: what is installed, what works, what would run here and why, with which settings.

:func:`collect` builds one JSON-ready dict; :func:`render` turns it into text. Anything
broken is reported with its fix, never raised: the report is most useful when things fail.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import platform
import sys
import sysconfig
from typing import Any, Dict, List, Mapping, Optional

from .. import settings
from ..errors import summary as _first_line
from ..registry import SPECS
from . import launch

PACKAGES = ("unified_dist", *(spec.library for spec in SPECS.values() if spec.library), "transformers", "datasets")
NOT_INSTALLED = "not installed"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return NOT_INSTALLED


def _backend_status(ok: bool, detail: str, fix: Optional[str], backend: str,
                    environ: Mapping[str, str]) -> Dict[str, Any]:
    launcher = launch.find_launcher(backend, environ)
    if ok and launcher is None:
        ok, detail = False, f"{detail}, but {launch.LAUNCHER_OF[backend]} is not on PATH"
        fix = launch.INSTALL_FIX[backend]
    return {"ok": ok, "detail": detail, "launcher": launcher, "fix": None if ok else fix}


# ---------------------------------------------------------------------- backends
# Each backend's probe (named by its spec in unified_dist.registry): environ -> the status dict.
def probe_torch(environ: Mapping[str, str]) -> Dict[str, Any]:
    import torch.distributed as dist

    fix = "install a torch build with distributed support in this environment (`make setup`)"
    if not dist.is_available():
        return _backend_status(False, "this torch has no torch.distributed", fix, "torch", environ)
    groups = [name for name, available in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available()),
                                           ("mpi", dist.is_mpi_available())) if available]
    if "gloo" not in groups and "nccl" not in groups:
        return _backend_status(False, "torch.distributed has neither gloo nor nccl", fix, "torch", environ)
    return _backend_status(True, f"torch.distributed ({', '.join(groups)})", None, "torch", environ)


def probe_accelerate(environ: Mapping[str, str]) -> Dict[str, Any]:
    fix = SPECS["accelerate"].install_fix
    try:
        import accelerate
    except ImportError as exc:
        detail = NOT_INSTALLED if _version("accelerate") == NOT_INSTALLED else f"import failed ({_first_line(exc)})"
        return _backend_status(False, detail, fix, "accelerate", environ)
    return _backend_status(True, f"accelerate {accelerate.__version__}", None, "accelerate", environ)


def probe_deepspeed(environ: Mapping[str, str]) -> Dict[str, Any]:
    """Whether ``import deepspeed`` works, with the accelerator and the communication backend it picks here."""
    fix = SPECS["deepspeed"].install_fix
    # DeepSpeed's logger writes to the stdout it finds at import ("Setting accelerator to CPU"): to stderr here,
    # so that `unified-dist env --json` prints JSON alone
    with contextlib.redirect_stdout(sys.stderr):
        try:
            import deepspeed
            from deepspeed.accelerator import get_accelerator
        except Exception as exc:  # an sdist built against another torch fails with more than ImportError
            detail = NOT_INSTALLED if _version("deepspeed") == NOT_INSTALLED else f"import failed ({_first_line(exc)})"
            return _backend_status(False, detail, fix, "deepspeed", environ)
        accelerator = get_accelerator()
    return _backend_status(True, f"deepspeed {deepspeed.__version__} ({accelerator.device_name()} accelerator, "
                                 f"{accelerator.communication_backend_name()})", None, "deepspeed", environ)


def _horovod_import():
    try:
        import horovod.torch as hvd
    except Exception as exc:  # a build against another torch fails with OSError/ImportError (undefined symbol)
        return None, exc
    return hvd, None


def probe_horovod(environ: Mapping[str, str]) -> Dict[str, Any]:
    fix = SPECS["horovod"].install_fix
    hvd, exc = _horovod_import()
    if hvd is None:
        detail = NOT_INSTALLED if _version("horovod") == NOT_INSTALLED else f"import failed ({_first_line(exc)})"
        return _backend_status(False, detail, fix, "horovod", environ)
    controllers = [name for name, built in (("gloo", hvd.gloo_built()), ("mpi", hvd.mpi_built())) if built]
    if not controllers:
        return _backend_status(False, "horovod.torch has neither a Gloo nor an MPI controller",
                               f"rebuild it with Gloo: {fix}", "horovod", environ)
    return _backend_status(True, f"horovod.torch {_version('horovod')} ({', '.join(controllers)} controller)",
                           None, "horovod", environ)


def probe_single(environ: Mapping[str, str]) -> Dict[str, Any]:
    """Plain ``python``: always there."""
    return {"ok": True, "detail": "one plain process (no launcher)", "launcher": sys.executable, "fix": None}


def horovod_build() -> Optional[Dict[str, Dict[str, bool]]]:
    """What ``horovodrun --check-build`` shows, read from ``horovod.torch`` in this process (None if unusable)."""
    hvd, _ = _horovod_import()
    if hvd is None:
        return None
    import horovod

    package = os.path.dirname(horovod.__file__)
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"

    def extension(*parts: str) -> bool:
        return os.path.exists(os.path.join(package, *parts[:-1], parts[-1] + suffix))

    return {
        "frameworks": {"TensorFlow": extension("tensorflow", "mpi_lib"), "PyTorch": True,
                       "MXNet": extension("mxnet", "mpi_lib")},
        "controllers": {"MPI": bool(hvd.mpi_built()), "Gloo": bool(hvd.gloo_built())},
        "tensor_operations": {"NCCL": bool(hvd.nccl_built()), "DDL": bool(hvd.ddl_built()),
                              "CCL": bool(hvd.ccl_built()), "MPI": bool(hvd.mpi_built()),
                              "Gloo": bool(hvd.gloo_built())},
    }


# ---------------------------------------------------------------------- machine and detection
def hardware() -> Dict[str, Any]:
    import torch

    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            gpus.append({"index": index, "name": props.name, "memory_gib": round(props.total_memory / 2**30, 1)})
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu_count": os.cpu_count(), "usable_cpus": usable, "cuda_available": torch.cuda.is_available(),
            "cuda_version": torch.version.cuda, "gpus": gpus}


def detection(environ: Mapping[str, str], cuda: bool) -> Dict[str, Any]:
    from ..backends.precision import Precision
    from ..detection import detect
    from ..errors import UnifiedDistError

    try:
        found = detect(environ)
    except UnifiedDistError as exc:  # a launcher variable or UNIFIED_DIST_SLURM that does not read
        return {"error": str(exc)}
    try:
        precision = settings.resolve("mixed_precision", None, environ)
        Precision(precision).check_device(cuda)
    except UnifiedDistError as exc:
        precision = f"error: {exc}"
    return {"backend": found.backend, "launcher": found.launcher, "reason": found.reason,
            "world_size": found.world_size, "rank": found.rank, "local_rank": found.local_rank,
            "rendezvous": f"{found.master_addr}:{found.master_port}" if found.master_addr else None,
            "mixed_precision": precision, "warnings": list(found.warnings),
            "problems": list(getattr(found, "problems", ()))}  # contradictions init() refuses to start on


def collect(environ: Mapping[str, str] = os.environ) -> Dict[str, Any]:
    """Everything ``unified-dist env`` reports, as one JSON-ready dict."""
    backends = {name: spec.load("probe")(environ) for name, spec in SPECS.items()}
    machine = hardware()
    chosen = detection(environ, machine["cuda_available"])
    problems: List[str] = [f"{name}: {info['detail']}; fix: {info['fix']}"
                           for name, info in backends.items() if not info["ok"]]
    problems += [f"detection: {p} (ud.init() refuses to start here)" for p in chosen.get("problems", [])]
    problems += [f"detection: {w}" for w in chosen.get("warnings", [])]
    if "error" in chosen:
        problems.append(f"detection: {chosen['error']}")
    unknown = settings.unknown_variables(environ)
    problems += [f"settings: {settings.describe_unknown(name, close)}" for name, close in unknown]
    rows = settings.in_effect(environ)
    problems += [f"settings: {row['problem']} (ud.init() refuses to start here)" for row in rows if row["problem"]]
    return {
        "python": {"version": platform.python_version(), "executable": sys.executable},
        "packages": {name: _version(name) for name in PACKAGES},
        "backends": backends,
        "horovod_build": horovod_build(),
        "hardware": machine,
        "detection": chosen,
        "settings": rows,
        "unknown_settings": [{"variable": name, "suggestion": close} for name, close in unknown],
        "problems": problems,
    }


# ---------------------------------------------------------------------- text
def _checks(flags: Dict[str, bool]) -> str:
    return "  ".join(f"[{'X' if on else ' '}] {name}" for name, on in flags.items())


def render(report: Dict[str, Any]) -> str:
    """The human-readable report."""
    rows: List[str] = ["versions"]
    py = report["python"]
    rows.append(f"  {'python':<14}{py['version']} ({py['executable']})")
    rows += [f"  {name:<14}{version}" for name, version in report["packages"].items()]

    rows += ["", "backends"]
    for name, info in report["backends"].items():
        state = "ok" if info["ok"] else "BROKEN"
        rows.append(f"  {name:<14}{state:<8}{info['detail']}")
        if info["ok"] and info["launcher"]:
            rows.append(f"  {'':<22}launcher {info['launcher']}")
        if info["fix"]:
            rows.append(f"  {'':<22}fix: {info['fix']}")

    rows += ["", "horovod build (as `horovodrun --check-build` reports it)"]
    build = report["horovod_build"]
    if build is None:
        rows.append("  unavailable: horovod.torch does not import (see backends above)")
    else:
        rows.append(f"  {'frameworks':<20}{_checks(build['frameworks'])}")
        rows.append(f"  {'controllers':<20}{_checks(build['controllers'])}")
        rows.append(f"  {'tensor operations':<20}{_checks(build['tensor_operations'])}")

    hw = report["hardware"]
    rows += ["", "hardware", f"  {'cpus':<14}{hw['cpu_count']} ({hw['usable_cpus']} usable by this process)"]
    if hw["gpus"]:
        rows += [f"  {'gpu ' + str(g['index']):<14}{g['name']} ({g['memory_gib']} GiB)" for g in hw["gpus"]]
    else:
        rows.append(f"  {'gpus':<14}none (torch.cuda.is_available() is False; processes use the CPU and gloo)")

    rows += ["", "this environment would run (unified_dist.detection.detect(os.environ))"]
    found = report["detection"]
    if "error" in found:
        rows.append(f"  error: {found['error']}")
    else:
        rows.append(f"  {'backend':<14}{found['backend']}")
        rows.append(f"  {'launcher':<14}{found['launcher']}")
        rows.append(f"  {'reason':<14}{found['reason']}")
        rows.append(f"  {'rank':<14}{found['rank']} of world size {found['world_size']}")
        if found["rendezvous"]:
            rows.append(f"  {'rendezvous':<14}{found['rendezvous']} (derived for {found['launcher']}; "
                        "MASTER_ADDR/MASTER_PORT override)")
        rows.append(f"  {'precision':<14}{found['mixed_precision']}")
        rows += [f"  {'problem':<14}{p}" for p in found["problems"]]
        rows += [f"  {'warning':<14}{w}" for w in found["warnings"]]

    rows += ["", "settings (UNIFIED_DIST_* variables; an init(...) keyword in the script wins over its variable, "
             "and contradicting the launcher is an error)"]
    width = max(len(row["variable"]) for row in report["settings"]) + 2
    for row in report["settings"]:
        value = row["value"] or "''"
        rows.append(f"  {row['variable']:<{width}}{value} ({row['source']})")

    rows += ["", "problems"]
    rows += [f"  {p}" for p in report["problems"]] or ["  none"]
    return "\n".join(rows)


# ---------------------------------------------------------------------- subcommand
def add_arguments(parser) -> None:
    """The ``env`` subcommand's options."""
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def main(args) -> int:
    """Print the report; always exits 0 (problems are part of the report)."""
    report = collect()
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0
