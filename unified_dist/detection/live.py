"""What distributed stack this process already runs, before unified_dist joins anything.

Users import the facade into code that may already have called ``hvd.init()``, created an
Accelerate ``PartialState``/``Accelerator``, or ``dist.init_process_group(...)`` with any init
method (``env://``, ``tcp://``, ``file://``, a store). Such a process may carry no launcher
variables at all (an ``mp.spawn`` worker), so only the running stack can say how many processes
there are. :func:`probe` asks each stack the code could have started; it only looks at modules
that are already imported, so it never imports Accelerate or Horovod itself.
"""
from __future__ import annotations

import os
import sys
from typing import Optional

from . import Live


def probe() -> Optional[Live]:
    """The stack already initialised in this process, most specific first, or ``None``."""
    return _horovod() or _accelerate() or _torch()


def _horovod() -> Optional[Live]:
    hvd = sys.modules.get("horovod.torch")
    # unified_dist.horovod may answer for horovod.torch (its shim): it is not a running Horovod
    if hvd is None or getattr(hvd, "__unified_dist_shim__", False) or not hvd.is_initialized():
        return None
    return Live("horovod", hvd.size(), hvd.rank(), hvd.local_rank())


def _accelerate() -> Optional[Live]:
    state_module = sys.modules.get("accelerate.state")
    if state_module is None or not state_module.PartialState._shared_state:
        return None
    state = state_module.PartialState()
    return Live("accelerate", state.num_processes, state.process_index, state.local_process_index)


def _torch() -> Optional[Live]:
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    local = os.environ.get("LOCAL_RANK")
    return Live("torch", dist.get_world_size(), dist.get_rank(), int(local) if local and local.isdigit() else None)
