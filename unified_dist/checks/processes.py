"""The child processes the ``unified-dist test`` commands start (the CPU contract runs and the GPU
checks): whether a backend's launcher is here, a clean environment for them, and a kill that reaches
every process they started."""
from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
from pathlib import Path
from typing import Dict

from ..detection import LAUNCHER_VARIABLE_PREFIXES, TORCH_VARIABLES
from ..registry import SPECS, launcher_path
from ..settings import TIMEOUT_ENV

PACKAGE_ROOT = Path(__file__).resolve().parents[2]


def installed(backend: str) -> bool:
    """The backend's library and its launcher are present (whether they work is what a check finds out)."""
    library = SPECS[backend].library
    has_library = library is None or importlib.util.find_spec(library) is not None
    return has_library and launcher_path(backend) is not None


def clean_environment(timeout: float) -> Dict[str, str]:
    """This environment minus launcher and unified_dist variables (we may be inside a job), plus test settings."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(LAUNCHER_VARIABLE_PREFIXES) and k not in TORCH_VARIABLES}
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    # A collective stuck for half the launch's budget gives up with a clear error before the kill.
    env[TIMEOUT_ENV] = str(max(1, int(timeout / 2)))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), env.get("PYTHONPATH", "")) if p)
    return env


def kill_tree(pid: int) -> None:
    """Kill the live process ``pid``, its process group, and every descendant that left the group.

    horovodrun's workers run in sessions of their own, hence the descendants (found with psutil,
    which Horovod installs; without it the group kill still applies).
    """
    descendants = []
    with contextlib.suppress(Exception):
        import psutil

        descendants = psutil.Process(pid).children(recursive=True)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for child in descendants:
        with contextlib.suppress(Exception):
            child.kill()
