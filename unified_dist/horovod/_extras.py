"""``hvd.join``, ``hvd.SyncBatchNorm``, ``hvd.sparse_allreduce_async`` and the names only Horovod's own engine
provides (refused)."""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..parallel import sync_batchnorm
from . import _ops
from ._ops import NotOffHorovod, Sum, global_process_set, synchronize


def join(device: int = -1) -> int:
    """This rank is done (Horovod's ``join``); returns, on every rank, the rank that joined last.

    Until every rank has joined, a joined rank answers the others' ``hvd`` allreduces (named or not)
    with zeros, so ``Average`` divides the others' sum by the full size, as Horovod's; any other
    collective the others issue meanwhile raises :class:`~unified_dist.horovod._ops.HorovodInternalError`
    on them (Horovod's too). ``DistributedOptimizer``'s gradient reductions are not answered (they skip
    the negotiation): a rank still stepping fails with the collective timeout, never a wrong value;
    give every rank the same number of steps (``ud.prepare`` of the loader does). ``device`` is accepted
    and not needed."""
    return _ops.join()


class SyncBatchNorm(sync_batchnorm.SyncBatchNorm):
    """BatchNorm over the global batch of the job (Horovod's ``hvd.SyncBatchNorm``, same arguments and
    state dict); runs on CPU too. Statistics are merged exactly, uneven per-rank batches weighted by
    their counts (:mod:`unified_dist.parallel.sync_batchnorm`)."""

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: Optional[float] = 0.1, affine: bool = True,
                 track_running_stats: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats)
        self.gather = lambda t: synchronize(_ops.allgather_async(t))
        self.reduce_sum = lambda t: synchronize(_ops.allreduce_async(t, op=Sum))
        self.rank_world = lambda: (global_process_set.rank(), global_process_set.size())


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Refused: the timeline is Horovod's engine's trace."""
    raise NotOffHorovod("hvd.start_timeline records Horovod's own engine, which does not run here; profile with "
                        "torch.profiler.profile() (it records the torch.distributed collectives)")


def stop_timeline() -> None:
    """Refused: see :func:`start_timeline`."""
    raise NotOffHorovod("hvd.stop_timeline records Horovod's own engine, which does not run here; profile with "
                        "torch.profiler.profile() (it records the torch.distributed collectives)")


def sparse_allreduce_async(tensor: torch.Tensor, name: Any, op: int, process_set: Any = global_process_set) -> Any:
    """Start reducing a sparse ``tensor`` (Horovod's contract: returns a *function* that waits and returns the
    sparse result): every member's indices and values are gathered, so the result holds every member's
    entries (uncoalesced: repeated indices add up), values divided by the set's size for ``Average``."""
    if op not in (_ops.Average, _ops.Sum):
        raise ValueError("sparse_allreduce_async takes op=hvd.Average or hvd.Sum")
    indices = synchronize(_ops.allgather_async(tensor._indices().transpose(0, 1).contiguous(),
                                               process_set=process_set))
    values = synchronize(_ops.allgather_async(tensor._values(), process_set=process_set))

    def result() -> torch.Tensor:
        scaled = values / len(process_set.ranks) if op == _ops.Average else values
        return torch.sparse_coo_tensor(indices.transpose(0, 1), scaled, tensor.size())
    return result
