"""HSDP across two hosts (issue 26): torchrun with a static master on each of the two hosts (network
namespaces with their own host names), 2 processes per host, ``ud.init(sharding="fsdp",
dp_replicate="nodes")``: one replica per machine, each machine's two ranks sharding the model between
them, gradients all-reduced across the machines. tests/launchers/workers/mesh_worker.py's checks (the ``hsdp_nodes``
layout) must all pass on every rank: the same parameters as one plain process, and the replicas are
the machines."""
from __future__ import annotations

import json

import pytest

from unified_dist.testing.launchers import BIN

pytestmark = [pytest.mark.multinode, pytest.mark.distributed, pytest.mark.slow]
WORKER = "tests/launchers/workers/mesh_worker.py"
TIMEOUT = 240


def test_hsdp_replicates_across_hosts_and_shards_inside_each(hosts):
    out = hosts.workdir / "mesh-hsdp-nodes"
    out.mkdir()
    port = hosts.port()
    commands = [(r, [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(r), "--nproc_per_node", "2",
                     "--master_addr", hosts.addrs[0], "--master_port", str(port),
                     WORKER, "--layouts", "hsdp_nodes", "--out", str(out)],
                 {"GLOO_SOCKET_IFNAME": hosts.nic}) for r in (0, 1)]
    result = hosts.run("mesh-hsdp-nodes", commands, TIMEOUT)
    print(f"hsdp across hosts: {result.seconds:.1f}s")
    result.check()
    for rank in range(4):
        path = out / f"mesh_rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no results\n{result.output()}"
        checks = json.loads(path.read_text())["hsdp_nodes"]
        failed = {name: text for name, text in checks.items() if name != "config" and text != "ok"}
        assert not failed, f"rank {rank}: {failed}"
        assert len(checks) == 9, sorted(checks)  # the 8 checks and the config
