"""``horovod.torch``'s public API (Horovod 0.28.1) on every launcher: ``import unified_dist.horovod as hvd``.

A Horovod script whose only change is that import runs under python, torchrun, accelerate launch,
srun, mpirun, ``ud.launch`` and horovodrun. Which engine answers is the facade's detection
(:func:`unified_dist.detection.detect`), decided once, on the first name looked up:

- where the facade would run the ``horovod`` backend (horovodrun, with Horovod installed), every name is
  real ``horovod.torch``'s, so results are Horovod's by construction; ``init``/``shutdown`` also start and
  stop the facade's session around Horovod's;
- everywhere else the names are implemented over torch.distributed (the group ``ud.init()`` joined):
  :mod:`._ops` (collectives, handles, process sets), :mod:`._collectives` (their gradients),
  :mod:`._functions` (state broadcasts), :mod:`._optimizer` (``DistributedOptimizer``),
  :mod:`._topology` (``init``, sizes, ranks, build queries), :mod:`.compression`.

What only Horovod's engine provides (``Adasum``, the timeline, MPI communicators) is a
one-line :class:`~unified_dist.horovod._ops.NotOffHorovod` error naming the alternative, never a silent
substitute. ``docs/horovod-migration.md`` maps every name.
"""
from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Dict

__unified_dist_shim__ = True
"""Marks this module, also when it answers for ``horovod.torch`` (the shim), as not being Horovod:
:mod:`unified_dist.detection.live` must not take it for a running Horovod."""

_FROM: Dict[str, str] = {
    **dict.fromkeys(["Average", "Sum", "Adasum", "Min", "Max", "Product", "HorovodInternalError"], "._names"),
    **dict.fromkeys(["ProcessSet", "global_process_set", "add_process_set", "remove_process_set", "poll", "synchronize",
                     "allreduce_async", "allreduce_async_", "allreduce_", "grouped_allreduce_async",
                     "grouped_allreduce_async_", "grouped_allreduce_", "allgather_async", "grouped_allgather_async",
                     "broadcast_async", "broadcast_async_", "broadcast_", "alltoall_async", "reducescatter_async",
                     "grouped_reducescatter_async", "barrier"], "._ops"),
    **dict.fromkeys(["allreduce", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "alltoall",
                     "reducescatter", "grouped_reducescatter"], "._collectives"),
    **dict.fromkeys(["init", "shutdown", "is_initialized", "size", "rank", "local_size", "local_rank", "cross_size",
                     "cross_rank", "is_homogeneous", "gloo_built", "gloo_enabled", "nccl_built", "mpi_built",
                     "mpi_enabled", "mpi_threads_supported", "cuda_built", "rocm_built", "ccl_built", "ddl_built"],
                    "._topology"),
    **dict.fromkeys(["broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object"],
                    "._functions"),
    **dict.fromkeys(["DistributedOptimizer"], "._optimizer"),
    **dict.fromkeys(["Compression"], ".compression"),
    **dict.fromkeys(["join", "SyncBatchNorm", "start_timeline", "stop_timeline", "sparse_allreduce_async"],
                    "._extras"),
}
"""Where each name of ``horovod.torch`` lives in this package."""

__all__ = sorted(_FROM)

_chosen: Any = None  # the real horovod.torch, False for ours, None: not decided yet


def real_horovod() -> Any:
    """Real ``horovod.torch`` when the facade's detection runs the ``horovod`` backend in this process
    (horovodrun with Horovod installed, or ``UNIFIED_DIST_BACKEND=horovod``), else ``None``. Decided once."""
    global _chosen
    if _chosen is None:
        from ..detection import detect
        from ..detection.live import probe

        found = detect(os.environ, None, probe())
        _chosen = False
        if found.backend == "horovod":
            module = importlib.import_module("horovod.torch")
            _chosen = False if module is sys.modules[__name__] else module
    return _chosen or None


def _real_init(*args: Any, **kwargs: Any) -> None:
    """Real Horovod's ``init``, then the facade's session adopts it."""
    from .. import facade

    real_horovod().init(*args, **kwargs)
    facade.init()


def _real_shutdown() -> None:
    """The facade's session ends, then real Horovod's ``shutdown``."""
    from .. import facade

    facade.shutdown()
    real_horovod().shutdown()


def __getattr__(name: str) -> Any:
    real = real_horovod() if name in _FROM or name == "elastic" else None
    if real is not None:
        value = {"init": _real_init, "shutdown": _real_shutdown}.get(name) or getattr(real, name)
    elif name == "elastic":
        value = importlib.import_module(".elastic", __name__)
    elif name in _FROM:
        value = getattr(importlib.import_module(_FROM[name], __name__), name)
    else:
        raise AttributeError(f"module 'unified_dist.horovod' has no attribute {name!r} (horovod.torch 0.28.1 "
                             "has none either, or docs/horovod-migration.md lists it as not provided)")
    globals()[name] = value
    return value


def __dir__() -> Any:
    return sorted(set(globals()) | set(__all__))
