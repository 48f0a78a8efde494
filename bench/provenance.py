"""What every results file records: the commit measured, the exact command, the load around it."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def commit() -> str:
    """``git rev-parse --short HEAD``, with ``-dirty`` when tracked files differ from it."""
    def git(*args):
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD") or "unknown"
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def start() -> dict:
    """Provenance fields to put in a results file before measuring; call :func:`finish` after."""
    return {"commit": commit(), "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "load_before": os.getloadavg()}


def finish(record: dict) -> dict:
    """``record`` with the load average after the measurement."""
    record["load_after"] = os.getloadavg()
    return record
