"""The facade's contract across two hosts (network namespaces), under every multi-node launch line.

Two nodes x one process each. Each (launch, suite) runs tests/launchers/workers/contract_worker.py's
``core`` checks (every launch line) or ``accum`` checks (one native line per backend) once, through
tests/launchers/multinode/node_worker.py which also records the
host each rank ran on; every check must be "ok" on both ranks, and the ranks must have run on
different hosts. Launches:

- torchrun, static master (``--master_addr/--master_port``) and c10d rendezvous (``--rdzv_endpoint``)
- accelerate launch ``--num_machines 2 --machine_rank R --main_process_ip ...``
- horovodrun ``-H 192.0.2.1:1,192.0.2.2:1 --gloo``, once on the first host, ssh to the second
- ``unified-dist launch --nnodes 2 ...`` for torch, accelerate and horovod

Each launch runs once: a process that dies at exit fails the test (issue 12, item 9).
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Tuple

import pytest

from unified_dist.testing.multinode import LAUNCHES, MODULE_OF, JobResult, launch_commands

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "workers"))
import contract_worker  # noqa: E402  (the check names; the checks run in the launched processes)

pytestmark = [pytest.mark.multinode, pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/launchers/multinode/node_worker.py"
TIMEOUT = 180  # seconds per launch, both nodes together; then every process group is killed
SUITES = ("core", "accum")


def run(name: str, suite: str, hosts, ssh) -> Tuple[JobResult, Path]:
    """Launch ``name`` with ``suite`` on the two hosts (each test item is one (launch, suite) pair)."""
    out = hosts.workdir / f"{name}-{suite}"
    out.mkdir()
    result = hosts.run(f"{name}-{suite}",
                       launch_commands(name, hosts, WORKER, ["--suite", suite, "--out", str(out)], ssh), TIMEOUT)
    print(f"{name} {suite}: {result.seconds:.1f}s")
    return result, out


ACCUM_LINES = ("torchrun-static", "accelerate", "horovodrun")
"""The launch lines that also run the ``accum`` suite over two hosts: one native line per backend.
Accumulation's arithmetic does not depend on how the job met (static or c10d rendezvous, or the
same native line built by ``unified-dist launch``); every line runs ``core`` over the network."""
CASES = [(name, suite) for name in LAUNCHES for suite in SUITES if suite == "core" or name in ACCUM_LINES]


@pytest.mark.parametrize("name,suite", CASES, ids=[f"{n}-{s}" for n, s in CASES])
def test_contract_on_two_hosts(name, suite, hosts, request):
    backend, pinned = LAUNCHES[name]
    if importlib.util.find_spec(MODULE_OF[backend]) is None:
        pytest.skip(f"{MODULE_OF[backend]} is not installed")
    ssh = request.getfixturevalue("ssh_hosts") if backend == "horovod" else None
    result, out = run(name, suite, hosts, ssh)
    result.check()
    expected_checks = {fn.__name__ for fn in contract_worker.CHECKS[suite]}
    ran_on = {}
    for rank in (0, 1):
        path = out / f"{suite}_rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results\n{result.output()}"
        data = json.loads(path.read_text())
        identity = data["identity"]
        assert (identity["backend"], identity["world_size"], identity["rank"]) == (backend, 2, rank), identity
        assert set(data["results"]) == expected_checks, sorted(data["results"])
        failed = {check: text for check, text in data["results"].items() if text != "ok"}
        assert not failed, f"rank {rank}: " + "\n".join(f"{c}: {t}" for c, t in failed.items())
        where = json.loads((out / f"where_{suite}_rank{rank}.json").read_text())
        assert hosts.nic in where["interfaces"], where
        ran_on[rank] = where["hostname"]
    if pinned:
        assert [ran_on[0], ran_on[1]] == list(hosts.names), ran_on
    else:
        assert sorted(ran_on.values()) == sorted(hosts.names), ran_on
