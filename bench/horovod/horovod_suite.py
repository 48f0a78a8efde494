"""Horovod's own torch test suite (``test/parallel/test_torch.py`` of v0.28.1) against unified_dist.horovod.

The suite is Horovod's, not ours: it is read from a Horovod checkout outside this repository (``--src``,
e.g. a clone of the v0.28.1 tag), copied with its ``test/utils/common.py`` to a scratch folder, and run
whole, no test deselected, under ``torchrun --nproc_per_node 2`` with the ``--horovod-api`` directory first
on ``PYTHONPATH`` (so its ``import horovod.torch`` is unified_dist.horovod). Each rank runs the same pytest
and writes a JUnit file; this script counts each rank's outcomes and writes them, with the failures'
names, to ``bench/horovod/results/horovod_suite.json``.

    OMP_NUM_THREADS=1 python bench/horovod/horovod_suite.py --src /path/to/horovod   # needs `mock` installed

Not part of ``make test`` (it needs Horovod's source, which this repository does not ship).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "shared"))
import provenance  # noqa: E402

RUNNER = """import os, sys, pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "test_torch.py",
                      "--junitxml=" + os.path.join(sys.argv[1], "rank%s.xml" % os.environ["RANK"])]))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def outcomes(junit: Path) -> dict:
    """passed / failed / skipped counts and the failed tests' names of one rank's JUnit file."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
    for case in ET.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            counts["failures"].append(case.get("name"))
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--src", required=True, help="a Horovod checkout (v0.28.1) outside this repository")
    parser.add_argument("--timeout", type=int, default=1200)
    parser.add_argument("--out", default=str(ROOT / "bench" / "horovod" / "results" / "horovod_suite.json"))
    args = parser.parse_args()
    src = Path(args.src)
    record = provenance.start()
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        (work / "parallel").mkdir()
        (work / "utils").mkdir()
        shutil.copy(src / "test" / "parallel" / "test_torch.py", work / "parallel")
        shutil.copy(src / "test" / "utils" / "common.py", work / "utils")
        (work / "parallel" / "run_rank.py").write_text(RUNNER)
        sys.path.insert(0, str(ROOT))
        from unified_dist.horovod.redirect import pythonpath

        env = {**os.environ, "PYTHONPATH": pythonpath({"PYTHONPATH": str(ROOT)}),
               "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        command = [str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port",
                   str(free_port()), "run_rank.py", str(work)]
        began = time.monotonic()
        result = subprocess.run(command, cwd=work / "parallel", env=env, capture_output=True, text=True,
                                timeout=args.timeout)
        record["seconds"] = round(time.monotonic() - began, 1)
        record["suite"] = "horovod v0.28.1 test/parallel/test_torch.py, whole (no test deselected)"
        record["launch"] = "torchrun --nproc_per_node 2 (unified_dist.horovod as horovod.torch)"
        record["torchrun_exit"] = result.returncode
        record["ranks"] = {r: outcomes(work / f"rank{r}.xml") for r in (0, 1) if (work / f"rank{r}.xml").exists()}
    if len(record["ranks"]) != 2:
        sys.exit(f"a rank wrote no JUnit file; torchrun said: {result.stderr[-2000:]}")
    Path(args.out).write_text(json.dumps(provenance.finish(record), indent=1) + "\n")
    for rank, counts in record["ranks"].items():
        print(f"rank {rank}: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped; "
              f"failed: {', '.join(counts['failures']) or 'none'}")


if __name__ == "__main__":
    main()
