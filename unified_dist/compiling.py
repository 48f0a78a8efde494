"""``torch.compile`` through ``ud.prepare`` (``init(compile=...)``, ``UNIFIED_DIST_COMPILE``,
``accelerate launch --dynamo_backend``).

Contract: a prepared model is compiled **in place** (``nn.Module.compile``), so it keeps its class,
its wrapper (DDP's ``no_sync``, FSDP2's methods), and its state-dict keys (no ``_orig_mod.``
prefix): checkpoints of compiled and uncompiled models load into each other. What is compiled:

- DDP (torch, Accelerate): the DDP wrapper, so dynamo's DDP optimizer splits the graph at the
  gradient buckets and the all-reduce still overlaps the backward (``torch._dynamo.config.optimize_ddp``);
- FSDP2 / HSDP / tensor parallelism: each block :func:`unified_dist.sharding.blocks_to_shard` chose,
  one by one (regional compilation, as torchtitan does); the root's own layers stay eager;
- Horovod and one process: the model itself (Horovod's hooks sit on the parameters, outside the graph).

A model the user compiled before ``prepare`` is left as it is (``unwrap`` still returns the
original module). Importing this module imports nothing but torch.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from .errors import UnifiedDistError


def check_backend(name: Optional[str], mode: str) -> None:
    """Raise the one-line :class:`UnifiedDistError` when ``name`` is not an installed dynamo backend,
    or a ``mode`` other than ``default`` is asked of a backend other than inductor."""
    if name is None:
        return
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise UnifiedDistError(f"compile={name!r} is not a torch.compile backend here; use one of "
                               f"{', '.join(sorted(known))} (or compile=True for inductor)")
    if mode != "default" and name != "inductor":
        raise UnifiedDistError(f"compile_mode={mode!r} is inductor's; compile={name!r} takes only "
                               "compile_mode='default'")


def is_compiled(model: torch.nn.Module) -> bool:
    """Whether ``model`` is already compiled (``torch.compile(model)`` or ``model.compile()``)."""
    return isinstance(model, torch._dynamo.eval_frame.OptimizedModule) or getattr(
        model, "_compiled_call_impl", None) is not None


def compile_in_place(model: torch.nn.Module, backend: str, mode: str,
                     regions: Optional[Sequence[torch.nn.Module]] = None) -> torch.nn.Module:
    """Compile ``regions`` one by one when given (and not empty), else ``model`` whole; in place.
    Returns ``model``. Anything already compiled is left alone."""
    options = {"backend": backend, **({"mode": mode} if mode != "default" else {})}
    targets = list(regions) if regions else [model]
    if any(is_compiled(t) for t in [model, *targets]):
        return model
    for target in targets:
        target.compile(**options)
    return model
