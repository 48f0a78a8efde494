"""What differs between the torch releases unified_dist declares (setup.cfg, docs/versions.md): one
switch per difference, here and nowhere else.

Each switch probes what the installed torch can do (a name, a parameter, a registered kernel) rather
than comparing version numbers, says which releases take which side, and is run on its side by every
cell of the version matrix (``make versions``, ``tools/versions/versions.py``): the pinned cell takes the new
side of each, the oldest declared cell the old side of :func:`enable_fake_collectives`.

This module imports torch only; every layer may use it, and it uses none of them.
"""

from __future__ import annotations

import inspect
from typing import Dict, Optional

import torch
import torch.distributed as dist

all_gather_into_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``torch.distributed``'s gather of every rank's tensor into one preallocated buffer
``(output, input, group=None)``: ``all_gather_single`` where torch has it (2.13 renamed
``all_gather_into_tensor`` and deprecates the old name, with a FutureWarning per call),
``all_gather_into_tensor`` before."""


def _ddp_without_buffer_sync() -> Dict[str, bool]:
    takes = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in takes else {"broadcast_buffers": False}


DDP_WITHOUT_BUFFER_SYNC: Dict[str, bool] = _ddp_without_buffer_sync()
"""The ``DistributedDataParallel`` keyword that turns off its broadcast of buffers before each
synchronising forward: ``forward_sync_buffers=False`` where torch has it (2.13 deprecates
``broadcast_buffers``, with a FutureWarning for each DDP built with it), ``broadcast_buffers=False``
before. Also the attribute set on a DDP someone else built (Accelerate)."""


def _collectives_run_on_fake_tensors() -> bool:
    return bool(torch._C._dispatch_has_kernel_for_dispatch_key("c10d::allreduce_", "Meta"))


def enable_fake_collectives() -> Optional[str]:
    """Make torch's in-place collectives (``dist.all_reduce``, ``all_gather_into_tensor``,
    ``scatter``, ...) run under ``FakeTensorMode``, as ``unified-dist plan`` needs.

    Their ``Meta`` kernels ship with torch. From torch 2.11 they are registered when torch is
    imported (pytorch#162119; the 2.11 and 2.12 cells of the version matrix); in 2.10 only when
    ``torch.distributed._tools.fake_collectives`` is imported, and without them a collective on a fake
    tensor raises ``UnsupportedOperatorException: c10d.allreduce_.default`` (the 2.10 cell before this
    switch). Returns the module imported to register them, or ``None`` where torch
    had them already. Raises ``RuntimeError`` in one line if they are missing after that.
    """
    if _collectives_run_on_fake_tensors():
        return None
    module = "torch.distributed._tools.fake_collectives"
    import importlib

    importlib.import_module(module)
    if not _collectives_run_on_fake_tensors():
        raise RuntimeError(f"torch {torch.__version__} has no fake kernels for its collectives, even after "
                           f"importing {module}: unified-dist plan needs them (see docs/versions.md)")
    return module


def sides() -> Dict[str, str]:
    """Which side of each switch the installed torch takes, by switch name: what the version matrix
    records per cell (``tools/versions/versions.py``), so docs/versions.md shows each side run by some cell."""
    return {
        "all_gather_into_tensor": all_gather_into_tensor.__name__,
        "DDP_WITHOUT_BUFFER_SYNC": next(iter(DDP_WITHOUT_BUFFER_SYNC)),
        "enable_fake_collectives": "registered at import" if _collectives_run_on_fake_tensors()
        else "torch.distributed._tools.fake_collectives",
    }
