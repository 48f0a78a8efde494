"""Two hosts on one machine for multi-node tests, and the launch lines users type on real ones.

:class:`Hosts` wraps the pair of network namespaces that ``tools/netns_hosts.sh`` makes
(``ud-h1-SUFFIX`` at 192.0.2.1, ``ud-h2-SUFFIX`` at 192.0.2.2, joined by a veth named ``udnet0``
on both sides, no default route). Every command a test starts runs inside one of them under
that namespace's own host name, in its own process group, with a deadline; after each job,
whatever is still alive inside the namespaces (stray workers, ssh sessions) is killed, except
the long-lived servers registered with :meth:`Hosts.keep` (sshd).

The ``*_commands`` functions return, per host, the exact native command line a user runs on
that node of a two-node job with one process per node.
"""
from __future__ import annotations

import itertools
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Set, Tuple

from unified_dist.testing.launchers import BIN, ROOT, child_env

NETNS_SCRIPT = ROOT / "tools" / "netns_hosts.sh"
NIC = "udnet0"
ADDRS = ("192.0.2.1", "192.0.2.2")  # documentation range (RFC 5737) only; see tools/netns_hosts.sh
FAIL_GRACE_S = 20.0  # after one node's launcher fails, how long the others get before they are killed

# (host index, argv, extra environment) for each process a job starts on the hosts
NodeCommand = Tuple[int, List[str], Dict[str, str]]


@dataclass
class NodeRun:
    host: str
    argv: List[str]
    returncode: Optional[int]  # -N: died of signal N (-9: killed at the deadline or after another node failed)
    log: Path

    def output(self, tail: int = 3000) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return text[-tail:]


@dataclass
class JobResult:
    name: str
    runs: List[NodeRun]
    timed_out: bool
    seconds: float

    def output(self, tail: int = 3000) -> str:
        return "\n".join(f"----- {run.host} (exit {run.returncode}): {' '.join(run.argv)}\n{run.output(tail)}"
                         for run in self.runs)

    def check(self) -> "JobResult":
        assert not self.timed_out, f"{self.name} timed out after {self.seconds:.0f}s\n{self.output()}"
        bad = [run for run in self.runs if run.returncode != 0]
        exits = ", ".join(f"{r.host} exit {r.returncode}" for r in bad)
        assert not bad, f"{self.name}: {exits}\n{self.output()}"
        return self


class Hosts:
    """The two namespaces: run commands on them, hand out fresh ports, clean up after each job."""

    def __init__(self, suffix: str, workdir: Path):
        self.suffix = suffix
        self.names = (f"ud-h1-{suffix}", f"ud-h2-{suffix}")
        self.addrs = ADDRS
        self.nic = NIC
        self.workdir = workdir
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        # Fresh port per launch, below the kernel's ephemeral range (32768-60999) that gloo and
        # horovod's rendezvous draw from; the namespaces are new, so nothing else holds them.
        self._ports = itertools.count(random.randrange(20000, 30000, 10))
        self._kept: Set[int] = set()
        self._jobs = itertools.count()

    # ------------------------------------------------------------------ commands
    def port(self) -> int:
        return next(self._ports)

    def argv(self, host: int, cmd: Sequence[str]) -> List[str]:
        """``cmd`` on ``host`` (0 or 1): its network namespace, under its own host name."""
        name = self.names[host]
        return ["ip", "netns", "exec", name, "unshare", "--uts", "--",
                "sh", "-c", 'hostname "$1" && shift && exec "$@"', "sh", name, *map(str, cmd)]

    def start(self, host: int, cmd: Sequence[str], log: Path, extra_env: Optional[Dict[str, str]] = None,
              env: Optional[Dict[str, str]] = None) -> subprocess.Popen:
        """Start ``cmd`` on ``host`` in a new session (its own process group), output to ``log``."""
        env = dict(env or child_env(extra_env))
        env.setdefault("PYTHONFAULTHANDLER", "1")  # a Python stack in the log if a process dies of a signal
        with open(log, "wb") as out:
            return subprocess.Popen(self.argv(host, cmd), cwd=ROOT, env=env,
                                    stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)

    def keep(self, pid: int) -> None:
        """A long-lived server (sshd) that :meth:`reap` leaves alone."""
        self._kept.add(pid)

    def run(self, name: str, commands: Sequence[NodeCommand], timeout: float,
            env: Optional[Dict[str, str]] = None) -> JobResult:
        """Start every command at once, wait for all (``timeout`` in total), then reap the namespaces.

        When one node's launcher exits non-zero, the others get :data:`FAIL_GRACE_S` seconds
        to notice before they are killed, so a failure never waits for the full deadline.
        """
        job = f"{next(self._jobs):02d}-{name}"
        procs, runs = [], []
        start = time.monotonic()
        timed_out = False
        try:
            for host, cmd, extra in commands:
                log = self.logs / f"{job}-h{host + 1}.log"
                procs.append(self.start(host, cmd, log, extra, env))
                runs.append(NodeRun(self.names[host], [str(c) for c in cmd], None, log))
            failed_at = None
            while True:
                codes = [p.poll() for p in procs]
                if all(c is not None for c in codes):
                    break
                now = time.monotonic()
                if failed_at is None and any(c not in (None, 0) for c in codes):
                    failed_at = now
                if now - start > timeout:
                    timed_out = True
                    break
                if failed_at is not None and now - failed_at > FAIL_GRACE_S:
                    break
                time.sleep(0.2)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    kill_group(proc)
            self.reap()
        for run, proc in zip(runs, procs):
            run.returncode = proc.returncode
        return JobResult(job, runs, timed_out, time.monotonic() - start)

    # ------------------------------------------------------------------ cleanup
    def pids(self, host: int) -> List[int]:
        out = subprocess.run(["ip", "netns", "pids", self.names[host]], capture_output=True, text=True, timeout=30)
        return [int(p) for p in out.stdout.split()]

    def reap(self, everything: bool = False) -> None:
        """SIGKILL every process inside both namespaces (but the kept servers, unless ``everything``)."""
        for _ in range(50):
            left = [p for h in (0, 1) for p in self.pids(h) if everything or p not in self._kept]
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)

    def down(self) -> None:
        """Kill everything inside, delete both namespaces (the veth goes with them) and their /etc/netns files."""
        try:
            self.reap(everything=True)
        finally:
            subprocess.run([str(NETNS_SCRIPT), "down", self.suffix], timeout=120, check=False)


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def cannot_make_namespaces() -> Optional[str]:
    """Why two namespace hosts cannot be made here, or ``None``."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); run the multi-node tests as root"
    if shutil.which("ip") is None:
        return "iproute2 is missing: apt-get install -y iproute2"
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is missing: apt-get install -y util-linux"
    check = subprocess.run([str(NETNS_SCRIPT), "check"], capture_output=True, text=True, timeout=60)
    if check.returncode != 0:
        return (check.stderr.strip() or check.stdout.strip() or "tools/netns_hosts.sh check failed")
    return None


# ---------------------------------------------------------------------- launch lines
def script_line(script: str, args: Sequence[str]) -> List[str]:
    return [script, *map(str, args)]


def torchrun_static_commands(hosts: Hosts, script: str, args: Sequence[str]) -> List[NodeCommand]:
    """``torchrun --nnodes 2 --node_rank R --master_addr 192.0.2.1 --master_port P``, GLOO_SOCKET_IFNAME pinned."""
    port = hosts.port()
    return [(r, [str(BIN / "torchrun"), "--nnodes", "2", "--node_rank", str(r), "--nproc_per_node", "1",
                 "--master_addr", hosts.addrs[0], "--master_port", str(port), *script_line(script, args)],
             {"GLOO_SOCKET_IFNAME": hosts.nic}) for r in (0, 1)]


def torchrun_c10d_commands(hosts: Hosts, script: str, args: Sequence[str]) -> List[NodeCommand]:
    """The same command on both nodes: ``--rdzv_backend c10d --rdzv_endpoint 192.0.2.1:P --rdzv_id ID``."""
    port = hosts.port()
    return [(r, [str(BIN / "torchrun"), "--nnodes", "2", "--nproc_per_node", "1", "--rdzv_backend", "c10d",
                 "--rdzv_endpoint", f"{hosts.addrs[0]}:{port}", "--rdzv_id", f"ud-test-{port}",
                 *script_line(script, args)],
             {"GLOO_SOCKET_IFNAME": hosts.nic}) for r in (0, 1)]


def accelerate_commands(hosts: Hosts, script: str, args: Sequence[str]) -> List[NodeCommand]:
    """``accelerate launch --multi_gpu --num_processes 2 --num_machines 2 --machine_rank R ...``."""
    port = hosts.port()
    return [(r, [str(BIN / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "2",
                 "--machine_rank", str(r), "--main_process_ip", hosts.addrs[0], "--main_process_port", str(port),
                 "--mixed_precision", "no", "--dynamo_backend", "no", *script_line(script, args)],
             {"GLOO_SOCKET_IFNAME": hosts.nic}) for r in (0, 1)]


def horovodrun_commands(hosts: Hosts, script: str, args: Sequence[str], ssh: "SshSetup") -> List[NodeCommand]:
    """Once, on the first host: ``horovodrun -np 2 -H 192.0.2.1:1,192.0.2.2:1 --gloo`` (ssh to the second)."""
    return [(0, [str(BIN / "horovodrun"), "-np", "2", "-H", f"{hosts.addrs[0]}:1,{hosts.addrs[1]}:1", "--gloo",
                 "--ssh-port", "22", "--ssh-identity-file", str(ssh.identity), "--start-timeout", "60",
                 "python", *script_line(script, args)], ssh.env())]


def unified_commands(hosts: Hosts, backend: str, script: str, args: Sequence[str],
                     ssh: Optional["SshSetup"] = None) -> List[NodeCommand]:
    """``python -m unified_dist launch --backend B --nproc 1 --nnodes 2 ...`` on each node (horovod: once)."""
    head = [str(BIN / "python"), "-m", "unified_dist", "launch", "--backend", backend, "--nproc", "1", "--nnodes", "2"]
    if backend == "horovod":
        assert ssh is not None
        return [(0, [*head, "--hosts", f"{hosts.addrs[0]}:1,{hosts.addrs[1]}:1", "--network-interface", hosts.nic,
                     *script_line(script, args)], ssh.env())]
    port = hosts.port()
    return [(r, [*head, "--node-rank", str(r), "--master-addr", hosts.addrs[0], "--master-port", str(port),
                 "--network-interface", hosts.nic, *script_line(script, args)], {}) for r in (0, 1)]


LAUNCHES: Dict[str, Tuple[str, bool]] = {
    # name: (backend the ranks must detect, ranks pinned to hosts in order?)
    "torchrun-static": ("torch", True),
    "torchrun-c10d": ("torch", False),  # the c10d rendezvous numbers the nodes in arrival order
    "accelerate": ("accelerate", True),
    "horovodrun": ("horovod", True),
    "unified-dist-torch": ("torch", True),
    "unified-dist-accelerate": ("accelerate", True),
    "unified-dist-horovod": ("horovod", True),
}
"""Every multi-node launch line the tests run; each names its commands in :func:`launch_commands`."""

MODULE_OF = {"torch": "torch", "accelerate": "accelerate", "horovod": "horovod"}


def launch_commands(name: str, hosts: Hosts, script: str, args: Sequence[str],
                    ssh: Optional["SshSetup"] = None) -> List[NodeCommand]:
    """The per-host commands of launch ``name`` (a key of :data:`LAUNCHES`)."""
    if name == "torchrun-static":
        return torchrun_static_commands(hosts, script, args)
    if name == "torchrun-c10d":
        return torchrun_c10d_commands(hosts, script, args)
    if name == "accelerate":
        return accelerate_commands(hosts, script, args)
    if name == "horovodrun":
        assert ssh is not None
        return horovodrun_commands(hosts, script, args, ssh)
    if name.startswith("unified-dist-"):
        return unified_commands(hosts, name[len("unified-dist-"):], script, args, ssh)
    raise ValueError(f"unknown launch {name!r}")


# ---------------------------------------------------------------------- ssh for horovodrun
@dataclass
class SshSetup:
    """sshd on the second host, and an ssh client configured for it, all in one temporary directory.

    horovodrun runs ``ssh`` by name. OpenSSH reads ``~/.ssh/config`` from the passwd home, not
    ``$HOME``, so the test puts a two-line ``ssh`` wrapper first on PATH that adds ``-F`` with
    this directory's config (key, port 22, no known_hosts file): the moral equivalent of a user's
    ``~/.ssh/config``, and nothing is written outside the directory.
    """

    directory: Path
    identity: Path
    wrapper_dir: Path
    sshd: subprocess.Popen

    def env(self) -> Dict[str, str]:
        return {"PATH": f"{self.wrapper_dir}{os.pathsep}{child_env()['PATH']}"}


SSHD_CONFIG = """\
ListenAddress {addr}
Port 22
HostKey {dir}/host_ed25519
PidFile {dir}/sshd.pid
AuthorizedKeysFile {dir}/authorized_keys
PermitRootLogin prohibit-password
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
StrictModes no
UsePAM no
PrintMotd no
X11Forwarding no
AllowTcpForwarding no
"""

SSH_CONFIG = """\
Host {addrs}
  User root
  Port 22
  IdentityFile {dir}/id_ed25519
  IdentitiesOnly yes
  BatchMode yes
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  GlobalKnownHostsFile /dev/null
  LogLevel ERROR
  ConnectTimeout 10
"""


def start_sshd(hosts: Hosts, directory: Path, sshd: str, ssh: str, host: int = 1) -> SshSetup:
    """Keys (made here, no passphrase, never reused), sshd listening on ``host``'s address, an ssh wrapper."""
    for key in ("host_ed25519", "id_ed25519"):
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"unified-dist-test-{key}",
                        "-f", str(directory / key)], check=True, timeout=60)
    shutil.copy(directory / "id_ed25519.pub", directory / "authorized_keys")
    (directory / "sshd_config").write_text(SSHD_CONFIG.format(addr=hosts.addrs[host], dir=directory))
    (directory / "ssh_config").write_text(SSH_CONFIG.format(addrs=" ".join(hosts.addrs), dir=directory))
    wrapper_dir = directory / "bin"
    wrapper_dir.mkdir()
    wrapper = wrapper_dir / "ssh"
    wrapper.write_text(f'#!/bin/sh\nexec {ssh} -F {directory}/ssh_config "$@"\n')
    wrapper.chmod(0o755)
    os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
    proc = hosts.start(host, [sshd, "-D", "-e", "-f", str(directory / "sshd_config")], directory / "sshd.log")
    hosts.keep(proc.pid)
    setup = SshSetup(directory, directory / "id_ed25519", wrapper_dir, proc)
    # ready when the other host gets in (bounded)
    deadline = time.monotonic() + 20
    while True:
        probe = subprocess.run(hosts.argv(1 - host, [str(wrapper), hosts.addrs[host], "true"]),
                               capture_output=True, text=True, timeout=30, env=child_env(setup.env()))
        if probe.returncode == 0:
            return setup
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_group(proc)
            log = (directory / "sshd.log").read_text(errors="replace")
            raise RuntimeError(f"sshd on {hosts.names[host]} not reachable: {probe.stderr.strip()}\n{log[-2000:]}")
        time.sleep(0.3)
