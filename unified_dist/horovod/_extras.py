"""``hvd.join``, ``hvd.SyncBatchNorm`` and the names only Horovod's own engine provides (refused)."""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from .. import sync_batchnorm
from . import _ops
from ._ops import NotOffHorovod, Sum, global_process_set, synchronize


def join(device: int = -1) -> int:
    """Wait until every rank has called ``join``; returns the rank that called it last.

    Horovod's joined ranks keep answering the others' allreduces with zeros; here every rank must
    reach ``join`` without collectives pending on the others (a rank that is still reducing times out
    with a :class:`~unified_dist.errors.CollectiveTimeout` instead of hanging silently). For uneven
    data, give every rank the same number of steps (``ud.prepare`` of the loader does)."""
    arrived = torch.tensor([time.time(), float(_ops._world.rank)], dtype=torch.float64)
    rows = synchronize(_ops.allgather_async(arrived.reshape(1, 2)))
    return int(rows[int(torch.argmax(rows[:, 0]))][1].item())


class SyncBatchNorm(sync_batchnorm.SyncBatchNorm):
    """BatchNorm over the global batch of the job (Horovod's ``hvd.SyncBatchNorm``, same arguments and
    state dict); runs on CPU too. Statistics are merged exactly, uneven per-rank batches weighted by
    their counts (:mod:`unified_dist.sync_batchnorm`)."""

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


def sparse_allreduce_async(tensor: Any, name: Any, op: int, process_set: Any = global_process_set) -> int:
    """Refused: sparse gradients."""
    raise NotOffHorovod("hvd.sparse_allreduce_async reduces sparse tensors with Horovod's engine; reduce "
                        "tensor.to_dense() with hvd.allreduce_async, or use dense embeddings (sparse=False)")
