"""The test hosts themselves: isolated, reachable from each other, and cleaned up after a hung job."""
from __future__ import annotations

import ipaddress
import subprocess

import pytest

from unified_dist.testing.multinode import ADDRS

pytestmark = [pytest.mark.multinode, pytest.mark.distributed]

NET = ipaddress.ip_network("192.0.2.0/24")


def _ip(hosts, host, *args):
    return subprocess.run(["ip", "-n", hosts.names[host], *args], capture_output=True, text=True, timeout=30,
                          check=True).stdout


def test_hosts_reach_each_other_and_nothing_else(hosts):
    for host in (0, 1):
        addrs = {line.split()[3].split("/")[0] for line in _ip(hosts, host, "-4", "-o", "addr").splitlines()}
        assert addrs == {"127.0.0.1", ADDRS[host]}, addrs
        routes = _ip(hosts, host, "-4", "route", "show", "table", "all").splitlines()
        for route in routes:
            dest = route.split()[0] if route.split()[0] not in ("local", "broadcast") else route.split()[1]
            assert dest != "default", route
            net = ipaddress.ip_network(dest, strict=False)
            assert net.subnet_of(NET) or net.subnet_of(ipaddress.ip_network("127.0.0.0/8")), route
    # each host knows itself and the other by name, and reaches the other over the veth
    port = hosts.port()
    server = ("import socket; s = socket.create_server(('{a}', {p})); s.settimeout(30); c, peer = s.accept(); "
              "print(socket.gethostname(), 'got', c.recv(64).decode(), 'from', peer[0])").format(a=ADDRS[1], p=port)
    client = ("import socket, time\n"
              "for _ in range(100):\n"
              "    try:\n"
              "        c = socket.create_connection((socket.gethostbyname('{peer}'), {p}), timeout=5); break\n"
              "    except OSError: time.sleep(0.1)\n"
              "c.sendall(socket.gethostname().encode())").format(peer=hosts.names[1], p=port)
    result = hosts.run("reach", [(1, ["python", "-c", server], {}), (0, ["python", "-c", client], {})],
                       timeout=60).check()
    assert f"{hosts.names[1]} got {hosts.names[0]} from {ADDRS[0]}" in result.runs[0].output(), result.output()


def test_job_past_its_deadline_is_killed_and_reaped(hosts):
    """A hung job is killed at its deadline, with everything it started (here a process that left its group)."""
    hung = ["sh", "-c", "setsid sleep 300 & sleep 300"]
    result = hosts.run("hung", [(0, hung, {}), (1, hung, {})], timeout=3)
    assert result.timed_out and result.seconds < 30, result
    assert all(run.returncode == -9 for run in result.runs), result
    assert hosts.pids(0) == [] and [p for p in hosts.pids(1) if p not in hosts._kept] == [], "processes left behind"
