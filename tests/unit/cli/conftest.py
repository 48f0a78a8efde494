"""Run ``unified-dist ...`` as a user would (``cli``: ``python -m unified_dist`` in a clean child
environment, with a timeout), or its ``main(argv)`` in this process (``cli_in_process``: the same
parser, checks and output without a new interpreter importing torch, about 5 s a call here)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

import pytest

from unified_dist.testing.launchers import (
    BIN,
    LAUNCHER_VARIABLE_PREFIXES,
    ROOT,
    TORCH_VARIABLES,
    child_env,
    run_apart,
)


def unified_dist(*args: str, cwd: Optional[Path] = None, env: Optional[Dict[str, str]] = None,
                 timeout: float = 60, code: Optional[str] = None) -> subprocess.CompletedProcess:
    """``python -m unified_dist ARGS`` (or ``python -c CODE ARGS``) in ``cwd``, in its own process group.

    On timeout its whole process tree (the launcher and its workers) is killed and the test fails.
    """
    cmd = [sys.executable, *(["-c", code] if code else ["-m", "unified_dist"]), *args]
    return run_apart(cmd, timeout, child_env(env), cwd, what=f"unified-dist {' '.join(args)}")


@pytest.fixture
def cli():
    """The ``unified_dist`` runner above."""
    return unified_dist


@pytest.fixture
def cli_in_process(monkeypatch, capsys):
    """``unified-dist ARGS`` as ``unified_dist.cli.main.main(ARGS)`` in this process, in ``cwd``, with a
    launcher-free environment plus ``env``; returns a ``CompletedProcess`` (exit status, stdout, stderr).

    Nothing is ever launched from here: a command that would start its launcher fails the test
    instead of replacing the test process (``launch`` ends in ``os.execvpe``). The console entry point
    itself (a fresh interpreter, its import-time output) is what the ``cli`` tests exercise.
    """
    from unified_dist.cli import launch as launch_command
    from unified_dist.cli.main import main

    def would_run(command):
        raise AssertionError(f"unified-dist would have run: {command.line()}")

    monkeypatch.setattr(launch_command, "run", would_run)

    def run(*args: str, cwd: Optional[Path] = None, env: Optional[Dict[str, str]] = None):
        monkeypatch.chdir(cwd or ROOT)
        for name in list(os.environ):
            if name.startswith(LAUNCHER_VARIABLE_PREFIXES) or name in TORCH_VARIABLES:
                monkeypatch.delenv(name)
        monkeypatch.setenv("PATH", f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}")
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        capsys.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's usage errors
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(["unified-dist", *args], code, out, err)

    return run
