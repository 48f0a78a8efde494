"""Fixtures for multi-node tests: two hosts made of network namespaces, and sshd for horovodrun.

``hosts`` (session): ``ud-h1-<pid>-<hex>`` (192.0.2.1) and ``ud-h2-<pid>-<hex>`` (192.0.2.2)
joined by a veth pair, made by tools/netns_hosts.sh; removed at the end of the session even when
tests fail, after every process inside them is killed. Where namespaces cannot be made (not root,
no iproute2, ``ip netns add`` refused) every multi-node test is skipped with the reason.

``ssh_hosts`` (session): sshd on the second host with a host key and a client key generated for
this session in a temporary directory (deleted afterwards), for the real ``horovodrun``.
"""
from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from unified_dist.testing.launchers import unavailable
from unified_dist.testing.multinode import NETNS_SCRIPT, Hosts, cannot_make_namespaces, kill_group, start_sshd

_NAME = re.compile(r"^ud-h[12]-(\d+)-[0-9a-f]{4}$")


def _remove_stale_namespaces() -> None:
    """Namespaces this fixture made in a session that died without its teardown (its pid is gone)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _NAME.match(name)
        if not match or int(match.group(1)) == os.getpid():
            continue
        try:
            os.kill(int(match.group(1)), 0)
            continue  # its session is alive (ours or a colleague's): leave it
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            if time.time() - os.stat(f"/run/netns/{name}").st_mtime < 120:
                continue
        except OSError:
            pass
        suffix = name.split("-", 2)[2]
        subprocess.run([str(NETNS_SCRIPT), "down", suffix], timeout=120, check=False, capture_output=True)


@pytest.fixture(scope="session")
def hosts(tmp_path_factory):
    reason = cannot_make_namespaces()
    if reason:
        print(f"\nmulti-node tests skipped: {reason}", file=sys.stderr)
        unavailable(f"cannot make network namespaces: {reason}")
    _remove_stale_namespaces()
    suffix = f"{os.getpid()}-{secrets.token_hex(2)}"
    h = Hosts(suffix, tmp_path_factory.mktemp("multinode"))
    try:
        up = subprocess.run([str(NETNS_SCRIPT), "up", suffix], capture_output=True, text=True, timeout=120)
        if up.returncode != 0:
            raise RuntimeError(f"tools/netns_hosts.sh up {suffix} failed: {up.stderr.strip()}")
        yield h
    finally:
        h.down()


@pytest.fixture(scope="session")
def ssh_hosts(hosts):
    """sshd on the second host (horovodrun treats its own host's addresses as local and ssh's only to the others)."""
    sshd = "/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else shutil.which("sshd")
    ssh = shutil.which("ssh")
    if not sshd or not ssh or not shutil.which("ssh-keygen"):
        reason = ("openssh-server/openssh-client missing (horovodrun reaches hosts over ssh): "
                  "apt-get install -y openssh-server")
        print(f"\nmulti-node horovod tests skipped: {reason}", file=sys.stderr)
        unavailable(reason)
    directory = Path(tempfile.mkdtemp(prefix="ud-ssh-"))
    setup = None
    try:
        setup = start_sshd(hosts, directory, sshd, ssh)
        yield setup
    finally:
        if setup is not None:
            kill_group(setup.sshd)
        hosts.reap()
        shutil.rmtree(directory, ignore_errors=True)
