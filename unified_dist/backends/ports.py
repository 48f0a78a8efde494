"""The rendezvous port's default and a free port: shared by the launch paths (torch-free: `unified-dist launch` reads it
without importing torch), the process group's set-up, the command line's self-checks, tests and benchmarks."""
from __future__ import annotations

import socket

DEFAULT_MASTER_PORT = 29500
"""The rendezvous port when neither the launcher nor the user names one (torch's own default)."""


def free_port() -> int:
    """A TCP port on the loopback address that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
