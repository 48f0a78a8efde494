"""The public checkpoint functions: portable files (``save``/``load``/``save_checkpoint``), a
sharded model's full weights (``get_state_dict``), and per-rank shards (``save_sharded``/``load_sharded``).
They reach the session's backend through :func:`unified_dist.facade.current_backend` and only delegate
to :mod:`unified_dist.checkpoint` and :mod:`unified_dist.sharded_checkpoint`.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from . import checkpoint, collectives, sharded_checkpoint
from .errors import UnifiedDistError, summary
from .facade import barrier, current_backend, rank
from .sharding import full_tensor

def save(obj: Any, path: str) -> None:
    """Every rank calls it; the main process writes ``obj`` atomically, then all ranks return.

    Prepared models are stored unwrapped (no ``module.`` prefix); optimizers, schedulers and
    loaders as their state dicts; tensors on the CPU. A failed write raises on every rank and
    leaves any previous file at ``path`` intact. The outcome travels as a collective (``save``):
    check mode compares it across ranks and a lost peer raises :class:`PeerLost`.
    """
    backend = current_backend()
    error = None
    state = None
    if backend.config.sharding.enabled:  # gathering a shard is a collective: every rank walks the state
        state = checkpoint.to_state(obj, backend.unwrap, _full_on_main(backend.rank))
    if backend.rank == 0:
        try:
            checkpoint.write_atomic(state if state is not None else checkpoint.to_state(obj, backend.unwrap), path)
        except Exception as exc:  # reported on every rank below, so no rank hangs
            error = summary(exc)
    if backend.world_size > 1:
        error = collectives.broadcast(backend, error, 0, what="save")
    if error is not None:
        raise UnifiedDistError(f"saving {path} failed on the main process: {error}")


def _full_on_main(rank: int) -> Any:
    """Each tensor's full value on the CPU of rank 0; the other ranks take part and keep nothing."""
    def full(t: torch.Tensor) -> Optional[torch.Tensor]:
        value = full_tensor(t.detach())
        return value.cpu() if rank == 0 else None
    return full


def get_state_dict(model: torch.nn.Module) -> Optional[dict]:
    """The model's full, unsharded state dict (unwrapped keys, CPU tensors) on the main process,
    ``None`` on the others. Every rank must call it (gathering shards is a collective), e.g.
    ``state = ud.get_state_dict(model)`` then ``if ud.is_main(): hf_model.save_pretrained(dir, state_dict=state)``.
    """
    backend = current_backend()
    if not backend.config.sharding.enabled:  # nothing to gather: only the main process walks
        return checkpoint.to_state(model, backend.unwrap) if backend.rank == 0 else None
    state = checkpoint.to_state(model, backend.unwrap, _full_on_main(backend.rank))  # a collective
    return state if backend.rank == 0 else None


def save_sharded(obj: dict, directory: str) -> None:
    """Every rank writes its own shards of ``obj``'s model and optimizers to ``directory`` with
    ``torch.distributed.checkpoint``; other values in ``obj`` are written beside them.

    ``obj`` is a dict with exactly one model, e.g. ``{"model": model, "optimizer": optimizer,
    "step": step}``. Atomic: a killed save leaves the previous checkpoint loadable. For models too
    large to gather on one rank; :func:`save` writes one portable file instead.
    """
    backend = current_backend()
    parts = sharded_checkpoint.split(obj, backend.unwrap, _torch_optimizer)
    sharded_checkpoint.save(parts, directory, backend.rank,
                            lambda value: collectives.broadcast(backend, value, 0, what="save_sharded"),
                            lambda: collectives.barrier(backend))


def load_sharded(obj: dict, directory: str) -> dict:
    """Load what :func:`save_sharded` wrote into ``obj``'s model and optimizers, under any world
    size and sharding (state is resharded on load); returns the other values that were saved."""
    backend = current_backend()
    return sharded_checkpoint.load(sharded_checkpoint.split(obj, backend.unwrap, _torch_optimizer), directory)


def _torch_optimizer(obj: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside a prepared (or plain) optimizer; ``None`` for anything else."""
    while isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
        obj = obj.optimizer
    return obj if isinstance(obj, torch.optim.Optimizer) else None


def save_checkpoint(obj: Any, directory: str, step: int, keep_last: Optional[int] = 3) -> str:
    """:func:`save` to ``directory/checkpoint-<step>.pt``, then keep only the ``keep_last`` newest.

    Older checkpoints are deleted only after the new one is completely written, so the last
    good checkpoint always survives a crash. Returns the new checkpoint's path.
    """
    if keep_last is not None:
        checkpoint.check_keep_last(keep_last)  # on every rank, before anyone waits for the write
    path = checkpoint.checkpoint_path(directory, step)
    save(obj, path)
    if keep_last is not None and rank() == 0:
        checkpoint.rotate(directory, keep_last, path)
    barrier()
    return path


def latest_checkpoint(directory: str) -> Optional[str]:
    """Path of the newest complete checkpoint written by :func:`save_checkpoint`, or ``None``."""
    return checkpoint.latest(directory)


def load(path: str, map_location: Optional[Any] = None) -> Any:
    """Read a checkpoint written by :func:`save` (under any backend) with ``weights_only=True``.

    Every rank reads ``path`` itself, so it must be visible to every rank.
    """
    return checkpoint.read_safe(path, map_location)
