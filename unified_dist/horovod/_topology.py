"""``hvd.init`` and the questions about the job (size, ranks, what the stack was built with), answered
by the facade's session: ``init`` is ``ud.init()`` (launcher detection is the facade's, never redone
here) plus one gather of host names for the local and cross topology (and of rank 0's token for this session,
which names the keys a failing member leaves in the job's store: :mod:`._alarm`)."""
from __future__ import annotations

import socket
import uuid
from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import facade
from ..errors import UnifiedDistError
from . import _ops
from ._ops import NotOffHorovod, ProcessSet, global_process_set


class _Topology:
    initialized = False
    local_rank = 0
    local_size = 1
    cross_rank = 0
    cross_size = 1
    homogeneous = True


_topology = _Topology()


def init(comm: Any = None, process_sets: Optional[Sequence[ProcessSet]] = None) -> None:
    """Join the job through ``ud.init()`` (whatever launched it) and register ``process_sets``; idempotent."""
    if comm is not None:
        raise NotOffHorovod("hvd.init(comm=...) takes an MPI communicator, which only Horovod built with MPI uses; "
                            "call hvd.init() and use hvd.ProcessSet([...]) for sub-groups")
    if _topology.initialized:
        return
    facade.init()
    world, rank = facade.world_size(), facade.rank()
    distributed = dist.is_available() and dist.is_initialized()
    if world > 1 and not distributed:
        raise UnifiedDistError(f"unified_dist.horovod runs over torch.distributed, but the {facade.backend_name()} "
                               "backend started no torch process group; leave UNIFIED_DIST_BACKEND unset")
    _ops.reset()
    _ops._world.rank, _ops._world.size, _ops._world.distributed = rank, world, distributed and world > 1
    _ops._world.timeout = facade.current_backend().config.timeout
    _ops._world.check = facade.current_backend().config.debug  # also DistributedOptimizer's gradients
    global_process_set.ranks = list(range(world))
    global_process_set._group = None
    global_process_set._control = (dist.new_group(list(range(world)), timeout=_ops._world.timeout)
                                   if _ops._world.distributed else None)
    mine = (socket.gethostname(), uuid.uuid4().hex)
    gathered = facade.all_gather_object(mine) if world > 1 else [mine]
    _ops._world.session = gathered[0][1]  # a store outlives a session (torchrun's agent's): keys never collide
    _learn_hosts([host for host, _ in gathered], rank)
    _topology.initialized = True
    for ps in process_sets or []:
        _ops._register(ps)


def _learn_hosts(hosts: List[str], rank: int) -> None:
    """Local and cross ranks from every rank's host name (hosts in order of their first rank)."""
    order = list(dict.fromkeys(hosts))
    mine = hosts[rank]
    _topology.local_rank = hosts[:rank].count(mine)
    _topology.local_size = hosts.count(mine)
    _topology.cross_size = len(order)
    _topology.cross_rank = order.index(mine)
    _topology.homogeneous = len({hosts.count(h) for h in order}) == 1


def shutdown() -> None:
    """Leave the job (``ud.shutdown()``); the process sets are dropped. A later :func:`init` joins again."""
    if not _topology.initialized:
        return
    for ps in list(_ops._world.sets.values()):
        _ops.remove_process_set(ps)
    if global_process_set._control is not None:
        dist.destroy_process_group(global_process_set._control)
        global_process_set._control = None
    _ops.reset()
    _topology.initialized = False
    facade.shutdown()


def is_initialized() -> bool:
    """Whether :func:`init` ran (and :func:`shutdown` did not since)."""
    return _topology.initialized


def _need() -> None:
    if not _topology.initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def size() -> int:
    """Number of processes in the job."""
    _need()
    return _ops._world.size


def rank() -> int:
    """This process's global rank."""
    _need()
    return _ops._world.rank


def local_size() -> int:
    """Number of processes on this host."""
    _need()
    return _topology.local_size


def local_rank() -> int:
    """This process's index among the processes of its host."""
    _need()
    return _topology.local_rank


def cross_size() -> int:
    """Number of hosts."""
    _need()
    return _topology.cross_size


def cross_rank() -> int:
    """This host's index among the hosts (in order of their lowest rank)."""
    _need()
    return _topology.cross_rank


def is_homogeneous() -> bool:
    """Whether every host runs the same number of processes."""
    _need()
    return _topology.homogeneous


# ---------------------------------------------------------------------- what the stack in use was built with
def _backend_of_group() -> str:
    return dist.get_backend() if dist.is_available() and dist.is_initialized() else ""


def gloo_built() -> bool:
    """Whether torch.distributed (the stack in use) has gloo."""
    return dist.is_available() and dist.is_gloo_available()


def gloo_enabled() -> bool:
    """Whether the job's collectives run over gloo."""
    return _backend_of_group() == "gloo"


def nccl_built() -> int:
    """The NCCL version torch was built with, as Horovod encodes it (e.g. 22105 for 2.21.5); 0 without NCCL."""
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()[:3]
    return major * 10000 + minor * 100 + patch


def mpi_built() -> bool:
    """Whether torch.distributed was built with its MPI backend."""
    return dist.is_available() and dist.is_mpi_available()


def mpi_enabled() -> bool:
    """Whether the job's collectives run over MPI."""
    return _backend_of_group() == "mpi"


def mpi_threads_supported() -> bool:
    """Horovod's question about MPI threads; this stack does not use MPI for its collectives."""
    if not mpi_enabled():
        raise ValueError("Horovod MPI is not enabled: the collectives run over torch.distributed's "
                         f"{_backend_of_group() or 'no'} backend")
    return True


def cuda_built() -> bool:
    """Whether torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built with ROCm."""
    return getattr(torch.version, "hip", None) is not None


def ccl_built() -> bool:
    """Intel oneCCL: not used by this stack."""
    return False


def ddl_built() -> bool:
    """IBM DDL: not used by this stack."""
    return False
