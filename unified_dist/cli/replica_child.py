"""The processes ``unified-dist launch --replica-groups`` starts besides torchrun (:mod:`unified_dist.cli.replicas`).

``python -m unified_dist.cli.replica_child lighthouse FLAGS``: torchft's lighthouse server (``LighthouseServer``,
what ``torchft_lighthouse`` runs) with ``torchft_lighthouse``'s flags. It binds the port itself (``--bind
[::]:0``: one the OS picks) and prints :data:`READY` and the port once it listens, so no other program can take
the port between the choice and the bind; a port that is taken is one line and exit status 1. It loads torchft's
compiled module alone, without torchft's package (which imports torch): a restart takes a fraction of a second.

``python -m unified_dist.cli.replica_child run SCRIPT ARGS`` (torchrun's ``-m``, in each process of a group):
runs the script as ``python SCRIPT ARGS`` would and writes how it ended to
``$REPLICA_GROUP_STATUS_DIR/rank<RANK>.json``. torchrun exits 1 whenever a process failed, whatever its status:
the launcher reads these records to tell a requeue (75) or a usage error from a crash.

This module imports only the standard library at its top.
"""
from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import json
import os
import re
import runpy
import signal
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

STATUS_VAR = "REPLICA_GROUP_STATUS_DIR"
"""The folder where each process of a group writes how it ended (``rank<R>.json``): set by the launcher."""
READY = "unified-dist lighthouse: listening on port "
"""The line the lighthouse prints, with its port, once it listens."""
_READY_LINE = re.compile(re.escape(READY) + r"(\d+)\n")


def _torchft_extension() -> Any:
    """torchft's compiled module (``torchft._torchft``), loaded without running ``torchft/__init__``."""
    spec = importlib.util.find_spec("torchft")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("unified-dist lighthouse: torchft is not installed: "
                         "pip install 'unified_dist[fault-tolerance]'")
    folder = spec.submodule_search_locations[0]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = os.path.join(folder, "_torchft" + suffix)
        if os.path.exists(path):
            found = importlib.util.spec_from_file_location("torchft._torchft", path)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
            return module
    import torchft._torchft as module  # another layout: through the package

    return module


def _say(line: str) -> None:
    """``line`` and its newline in one write: torchft's server logs to the same file from its own threads, and an
    unbuffered ``print`` (PYTHONUNBUFFERED) writes the text and the newline apart, so a log line could land between
    the port and its newline (seen: the launcher read port ``343952026-11-28T15:41:16.315``)."""
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), f"{line}\n".encode())


def ready_port(log: str) -> Optional[int]:
    """The port in the lighthouse's :data:`READY` line in ``log`` (``None`` before it is there). The line is one
    write (:func:`_say`), so it is whole in the file, but not always at a line's start: torchft's logger writes its
    own lines in pieces, and ours can land inside one (seen: ``...09:12:05.396 [unified-dist lighthouse: listening
    on port 37045\nINFO] [torchft::lighthouse] ...``)."""
    found = _READY_LINE.search(log)
    return int(found.group(1)) if found else None


def serve_lighthouse(argv: List[str]) -> int:
    """The lighthouse with ``torchft_lighthouse``'s flags, until SIGTERM (or SIGKILL)."""
    parser = argparse.ArgumentParser(prog="unified-dist lighthouse")
    for flag in ("--min_replicas", "--quorum_tick_ms", "--join_timeout_ms", "--heartbeat_timeout_ms"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--bind", required=True)
    args = parser.parse_args(argv)
    try:
        server = _torchft_extension().LighthouseServer(
            bind=args.bind, min_replicas=args.min_replicas, join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms, heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except RuntimeError as exc:
        _say(f"unified-dist lighthouse: cannot bind {args.bind}: {exc}")
        return 1
    _say(f"{READY}{server.address().rsplit(':', 1)[1]}")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        while True:
            signal.pause()
    finally:
        server.shutdown()


def run_script(argv: List[str], environ: Mapping[str, str] = os.environ) -> None:
    """Run ``argv[0]`` as ``__main__`` with its arguments, as ``python script.py`` would, and write how it ended
    to ``$REPLICA_GROUP_STATUS_DIR/rank<RANK>.json``: ``{"code": exit status, "usage": bool}`` (``usage``: a
    :class:`~unified_dist.errors.UnifiedDistError` before the process's first optimizer step)."""
    folder = environ.get(STATUS_VAR)
    record: Dict[str, Any] = {"code": 1, "usage": False}
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))  # as `python script.py` would
    try:
        runpy.run_path(argv[0], run_name="__main__")
        record["code"] = 0
    except SystemExit as exc:
        record["code"] = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        raise
    except BaseException as exc:
        record["usage"] = before_the_first_step(exc)
        raise
    finally:
        if folder:
            path = Path(folder) / f"rank{environ.get('RANK', '0')}.json"
            path.with_suffix(".tmp").write_text(json.dumps(record))
            os.replace(path.with_suffix(".tmp"), path)


def before_the_first_step(exc: BaseException) -> bool:
    """Whether ``exc`` is a usage error: a :class:`~unified_dist.errors.UnifiedDistError` (not a lost peer or a
    timeout, which another start may not meet) before this process took its first optimizer step."""
    if "unified_dist.errors" not in sys.modules:  # the script never reached unified_dist
        return False
    from .. import session
    from ..errors import CollectiveTimeout, PeerLost, UnifiedDistError

    if not isinstance(exc, UnifiedDistError) or isinstance(exc, (PeerLost, CollectiveTimeout)):
        return False
    current = session._session
    return current is None or current.sync.optimizer_steps == 0


def main(argv: List[str]) -> int:
    if argv[:1] == ["lighthouse"]:
        return serve_lighthouse(argv[1:])
    if argv[:1] == ["run"] and len(argv) > 1:
        run_script(argv[1:])
        return 0
    print("usage: python -m unified_dist.cli.replica_child lighthouse FLAGS | run SCRIPT [ARGS]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
