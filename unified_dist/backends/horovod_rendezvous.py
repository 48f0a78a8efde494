"""Horovod in processes that another launcher started (torchrun, accelerate launch, srun, mpirun,
``ud.launch(backend="torch")``): ``init(backend="horovod")`` joins them on one host.

``hvd.init()`` with the Gloo controller reads its identity from ``HOROVOD_*`` variables and meets
its peers through an HTTP key-value server that horovodrun runs (``HOROVOD_GLOO_RENDEZVOUS_ADDR``/
``_PORT``). Here rank 0 runs that server itself (Horovod's own ``RendezvousServer``, in a thread of
this process), tells the others its port through a torch ``TCPStore`` (torchrun's agent store where
there is one, else one that rank 0 holds on the port detection derived), and every rank exports the
variables horovodrun would have set. :func:`withdraw` removes them at shutdown, so a later ``init``
detects the real launcher again. One host only (loopback): detection refuses several hosts.
"""
from __future__ import annotations

import datetime
import os
from typing import Any, Dict, Mapping, Optional, Tuple

from ..detection import Detection

_stores: Dict[Tuple[str, int], Any] = {}
"""The store of each rendezvous, kept for the process's life: a re-init reuses it (no port taken twice)."""
_server: Optional[Tuple[Any, int]] = None
"""Rank 0's Horovod rendezvous server and its port, started once per process."""
_joins = 0


def _store(detection: Detection, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    key = (str(detection.master_addr), int(detection.master_port or 0))
    if key not in _stores:
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's: a client of it
        _stores[key] = dist.TCPStore(key[0], key[1], detection.world_size,
                                     is_master=detection.rank == 0 and not agent, timeout=timeout)
    return _stores[key]


def _serve(size: int) -> int:
    """Rank 0: (re)start Horovod's rendezvous server for ``size`` ranks on this host; its port."""
    global _server
    from horovod.runner.common.util.hosts import SlotInfo
    from horovod.runner.http.http_server import RendezvousServer

    if _server is None:
        server = RendezvousServer(False)
        _server = (server, server.start())
    _server[0].init([SlotInfo("localhost", r, r, 0, size, size, 1) for r in range(size)])  # clears the last keys
    return _server[1]


def join(detection: Detection, timeout: datetime.timedelta) -> Dict[str, str]:
    """Export the ``HOROVOD_*`` variables that make ``hvd.init()`` join ``detection``'s processes (every
    rank must call it, the same number of times); returns them for :func:`withdraw`."""
    global _joins
    from torch.distributed import PrefixStore

    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = PrefixStore(f"unified_dist/horovod/attempt_{restart}/join_{_joins}/", _store(detection, timeout))
    _joins += 1
    size, rank, local = detection.world_size, detection.rank, detection.local_rank or 0
    if rank == 0:
        store.set("port", str(_serve(size)))
    values = {"HOROVOD_RANK": rank, "HOROVOD_SIZE": size, "HOROVOD_LOCAL_RANK": local, "HOROVOD_LOCAL_SIZE": size,
              "HOROVOD_CROSS_RANK": 0, "HOROVOD_CROSS_SIZE": 1, "HOROVOD_HOSTNAME": "localhost",
              "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1", "HOROVOD_GLOO_RENDEZVOUS_PORT": store.get("port").decode(),
              "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo", "HOROVOD_GLOO_IFACE": "lo"}
    exported = {key: str(value) for key, value in values.items()}
    os.environ.update(exported)
    return exported


def withdraw(exported: Mapping[str, str]) -> None:
    """Remove the variables :func:`join` set (those still holding its values)."""
    for key, value in exported.items():
        if os.environ.get(key) == value:
            del os.environ[key]
