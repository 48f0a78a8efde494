"""The self-test ``unified-dist test`` runs in every rank, under a real launcher.

    <launcher> selftest_worker.py --out DIR --backend NAME --world-size N

Every rank joins with ``ud.init()`` and runs :data:`unified_dist.checks.contract.CHECKS` (the
contract the tests check too) in order. Each rank rewrites ``DIR/rank<R>.json`` before and after
every check, so when a launch hangs the parent still sees which check each rank was in.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script: don't let this folder's modules shadow top-level ones

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Callable, Dict  # noqa: E402

import unified_dist as ud  # noqa: E402
from unified_dist.checks.contract import CHECKS, Context  # noqa: E402


class _Results:
    """This rank's results file, rewritten atomically after every change."""

    def __init__(self, out: str, rank: int) -> None:
        self.path = os.path.join(out, f"rank{rank}.json")
        self.data: Dict[str, Any] = {"rank": rank, "checks": {}}

    def record(self, name: str, status: str, seconds: float = 0.0, error: str = "") -> None:
        self.data["checks"][name] = {"status": status, "seconds": round(seconds, 4), "error": error}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def _run(results: _Results, name: str, fn: Callable[[], None]) -> bool:
    results.record(name, "running")
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # recorded for the parent's table
        lines = str(exc).strip().splitlines()
        results.record(name, "fail", time.perf_counter() - start,
                       f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)
        traceback.print_exc()  # the full story goes to the launcher's output
        return False
    results.record(name, "pass", time.perf_counter() - start)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    args = parser.parse_args()

    from unified_dist.detection import detect

    results = _Results(args.out, detect(os.environ).rank)  # the launcher's rank, known before joining
    if not _run(results, "init", ud.init):
        sys.exit(1)
    context = Context(out=args.out, backend=args.backend, world_size=args.world_size)
    for check in CHECKS:
        _run(results, check.__name__, lambda: check(context))  # noqa: B023 - _run calls it now
    ud.barrier()
    ud.shutdown()


if __name__ == "__main__":
    main()
