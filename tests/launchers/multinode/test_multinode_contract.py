"""The facade's contract across two hosts (network namespaces), under every multi-node launch line.

Two nodes x one process each. Each launch line runs tests/launchers/workers/contract_worker.py's
``core`` checks, and one native line per backend its ``accum`` checks: torchrun's and accelerate's in the same
processes (``--then accum``: ``ud.init`` again after the core suite's ``ud.shutdown()``), horovodrun's in a
launch of its own (Horovod 0.28.1 over gloo on two hosts segfaults in a second ``hvd.init`` after
``hvd.shutdown``; on one host it does not). Each launch runs once, through
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


def run(name: str, suites: Tuple[str, ...], hosts, ssh) -> Tuple[JobResult, Path]:
    """Launch ``name`` on the two hosts, running ``suites`` one after the other in the same processes (each test
    item is one launch line)."""
    label = "-".join((name, *suites))
    out = hosts.workdir / label
    out.mkdir()
    then = ["--then", suites[1]] if len(suites) > 1 else []
    result = hosts.run(label, launch_commands(name, hosts, WORKER, ["--suite", suites[0], *then, "--out", str(out)],
                                             ssh), TIMEOUT)
    print(f"{name} {'+'.join(suites)}: {result.seconds:.1f}s")
    return result, out


ACCUM_LINES = ("torchrun-static", "accelerate", "horovodrun")
"""The launch lines that also run the ``accum`` suite over two hosts: one native line per backend.
Accumulation's arithmetic does not depend on how the job met (static or c10d rendezvous, or the
same native line built by ``unified-dist launch``); every line runs ``core`` over the network."""
AGAIN_AFTER_SHUTDOWN = ("torchrun-static", "accelerate")
"""The lines whose processes run ``accum`` after ``core`` (``--then``); horovodrun's runs it in a second launch."""
CASES = {}
"""Test id -> (launch line, the suites its one launch runs in order)."""
for _name in LAUNCHES:
    if _name in ACCUM_LINES and _name not in AGAIN_AFTER_SHUTDOWN:
        CASES.update({f"{_name}-{suite}": (_name, (suite,)) for suite in SUITES})
    else:
        CASES[_name] = (_name, SUITES if _name in AGAIN_AFTER_SHUTDOWN else SUITES[:1])


@pytest.mark.parametrize("case", list(CASES))
def test_contract_on_two_hosts(case, hosts, request):
    name, suites = CASES[case]
    backend, pinned = LAUNCHES[name]
    if importlib.util.find_spec(MODULE_OF[backend]) is None:
        pytest.skip(f"{MODULE_OF[backend]} is not installed")
    ssh = request.getfixturevalue("ssh_hosts") if backend == "horovod" else None
    result, out = run(name, suites, hosts, ssh)
    result.check()
    ran_on = {}
    for rank in (0, 1):
        for suite in suites:
            path = out / f"{suite}_rank{rank}.json"
            assert path.exists(), f"rank {rank} wrote no {suite} results\n{result.output()}"
            data = json.loads(path.read_text())
            identity = data["identity"]
            assert (identity["backend"], identity["world_size"], identity["rank"]) == (backend, 2, rank), identity
            assert set(data["results"]) == {fn.__name__ for fn in contract_worker.CHECKS[suite]}, \
                sorted(data["results"])
            failed = {check: text for check, text in data["results"].items() if text != "ok"}
            assert not failed, f"rank {rank}, {suite}: " + "\n".join(f"{c}: {t}" for c, t in failed.items())
        where = json.loads((out / f"where_{suites[0]}_rank{rank}.json").read_text())
        assert hosts.nic in where["interfaces"], where
        ran_on[rank] = where["hostname"]
    if pinned:
        assert [ran_on[0], ran_on[1]] == list(hosts.names), ran_on
    else:
        assert sorted(ran_on.values()) == sorted(hosts.names), ran_on
