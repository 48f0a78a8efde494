"""``torch.compile`` through ``ud.prepare`` (``init(compile=...)``, ``UNIFIED_DIST_COMPILE``,
``accelerate launch --dynamo_backend``).

Contract: a prepared model is compiled **in place** (its ``forward`` replaced by the compiled
``forward``, see :func:`compile_in_place`), so it keeps its class,
its wrapper (DDP's ``no_sync``, FSDP2's methods), and its state-dict keys (no ``_orig_mod.``
prefix): checkpoints of compiled and uncompiled models load into each other. What is compiled:

- DDP (torch, Accelerate): the ``forward`` of the module DDP wraps (see :func:`compile_targets` for why
  not DDP's own); it runs inside DDP's forward, so dynamo's DDP optimizer still splits its graph at
  the gradient buckets;
- FSDP2 / HSDP / tensor parallelism: each block :func:`unified_dist.parallel.sharding.blocks_to_shard` chose,
  one by one (regional compilation, as torchtitan does); the root's own layers stay eager;
- Horovod and one process: the model itself (Horovod's hooks sit on the parameters, outside the graph).

A model the user compiled before ``prepare`` is left as it is (``unwrap`` still returns the
original module). Importing this module imports nothing but torch.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..errors import UnifiedDistError


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
    """Whether ``model``, or a module it wraps (DDP's ``.module``, torch.compile's ``._orig_mod``), is
    already compiled: by ``torch.compile(model)``, ``model.compile()`` or :func:`compile_in_place`."""
    seen = model
    while isinstance(seen, torch.nn.Module):
        if (isinstance(seen, torch._dynamo.eval_frame.OptimizedModule)
                or getattr(seen, "_compiled_call_impl", None) is not None
                or hasattr(vars(seen).get("forward"), "_torchdynamo_orig_callable")):
            return True
        seen = getattr(seen, "_orig_mod", None) or getattr(seen, "module", None)
    return False


def compile_targets(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The module whose ``forward`` compiling ``model`` whole compiles: ``model`` itself, or the module
    a ``DistributedDataParallel`` wraps.

    Why not DDP's own ``forward`` (what ``torch.compile(ddp_model)`` compiles): dynamo skips
    ``DistributedDataParallel._inside_ddp_forward``, and the model's ``forward`` then starts a frame
    of its own, which dynamo skips too when it is torch's (``nn.Sequential``, ``nn.TransformerEncoder``):
    such a model got no graph at all, silently. A compiled ``forward`` of the inner module is traced
    whoever wrote it, with no graph break in DDP's bookkeeping.
    """
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return [model]


def compile_in_place(model: torch.nn.Module, backend: str, mode: str,
                     regions: Optional[Sequence[torch.nn.Module]] = None) -> torch.nn.Module:
    """Compile the ``forward`` of each of ``regions`` when given (and not empty), else of
    :func:`compile_targets` of ``model``; in place. Returns ``model``. A model that is already compiled
    (:func:`is_compiled`) is left alone.

    Why ``forward`` and not ``nn.Module.compile()``: in torch 2.13 dynamo skips the frames of torch's
    own modules, so ``module.compile()`` compiles nothing when ``forward`` is torch's (``nn.Sequential``,
    any ``torch.nn`` container); a compiled ``forward`` is compiled whoever wrote it, the module's
    hooks (FSDP2's) still run around it, and the state dict is untouched.
    """
    options = {"backend": backend, **({"mode": mode} if mode != "default" else {})}
    targets = list(regions) if regions else compile_targets(model)
    if any(is_compiled(t) for t in [model, *targets]):
        return model
    for target in targets:
        target.forward = torch.compile(target.forward, **options)
    return model
