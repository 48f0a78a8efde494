"""Run ``python -m unified_dist ...`` as a user would: a clean child environment and a timeout."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from launchers import ROOT, child_env


def unified_dist(*args: str, cwd: Optional[Path] = None, env: Optional[Dict[str, str]] = None,
                 timeout: float = 60, code: Optional[str] = None) -> subprocess.CompletedProcess:
    """``python -m unified_dist ARGS`` (or ``python -c CODE ARGS``) in ``cwd``, in its own process group.

    On timeout the whole group (the launcher and its workers) is killed and the test fails.
    """
    cmd = [sys.executable, *(["-c", code] if code else ["-m", "unified_dist"]), *args]
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=child_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"unified-dist {' '.join(args)} did not finish in {timeout}s\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture
def cli():
    """The ``unified_dist`` runner above."""
    return unified_dist
