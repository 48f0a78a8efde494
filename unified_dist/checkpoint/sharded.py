"""Checkpoints too large to gather: each rank writes its own shards with
``torch.distributed.checkpoint`` (DCP), and a later job with any world size reads them back
(DCP reshards on load). Model and optimizer state go through DCP's ``get_state_dict`` /
``set_state_dict`` (keys by parameter name, so they survive re-sharding); other values in the
object (step counters, RNG state, config) are written by the main process beside them.

Under Horovod (no torch process group) every rank holds the whole state: rank 0 writes it and
every rank reads it.

A save is :func:`stage` (every rank: the state, with ``copy`` every tensor copied off the live ones,
and the agreed partial directory) then :func:`write` (every rank: DCP's collectives on the group it
is given): :func:`save` runs both at once; an ``async_save=True`` save (:mod:`unified_dist.saving`)
runs :func:`write` in a background thread, on a gloo group of its own.

Atomic like ``ud.save``: the shards go to a fresh ``<dir>.partial-<id>`` directory; only when
every rank has finished does the main process swap it in (the previous checkpoint is renamed to
``<dir>.previous`` first and removed last). A job killed at any point leaves either the old or
the new checkpoint whole, and :func:`load` falls back to ``<dir>.previous`` when ``<dir>`` is
missing because the kill fell between the two renames.
"""
from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

import torch

from .. import nested
from ..errors import CheckpointError
from .files import read_safe, write_atomic

EXTRA = "extra.pt"


@dataclass
class Parts:
    """``obj`` split into the one model, its optimizers (keys in ``obj`` -> torch optimizer) and plain values."""

    model_key: str
    model: torch.nn.Module
    optimizers: Dict[str, torch.optim.Optimizer]
    extra: Dict[str, Any]


def split(obj: Any, unwrap: Callable[[torch.nn.Module], torch.nn.Module],
          inner_optimizer: Callable[[Any], Optional[torch.optim.Optimizer]]) -> Parts:
    """Split a ``{name: model | optimizer | value}`` dict; exactly one model (the optimizers' owner)."""
    if not isinstance(obj, dict):
        raise CheckpointError(f"save_sharded/load_sharded take a dict like {{'model': model, 'optimizer': optimizer, "
                              f"'step': step}}, got {type(obj).__name__}")
    models = {k: v for k, v in obj.items() if isinstance(v, torch.nn.Module)}
    if len(models) != 1:
        raise CheckpointError(f"save_sharded/load_sharded need exactly one model in the dict, found {len(models)} "
                              f"({', '.join(models) or 'none'}); save other models in another call")
    optimizers = {k: o for k, v in obj.items() if (o := inner_optimizer(v)) is not None}
    extra = {k: v for k, v in obj.items() if k not in models and k not in optimizers}
    (key, model), = models.items()
    return Parts(key, unwrap(model), optimizers, extra)


def _dcp_state(parts: Parts) -> Dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {parts.model_key: get_model_state_dict(parts.model)}
    for key, optimizer in parts.optimizers.items():
        state[key] = get_optimizer_state_dict(parts.model, optimizer)
    return state


@dataclass
class Staged:
    """What one save writes: the DCP state, the plain values, where (the partial directory, then ``directory``)."""

    state: Dict[str, Any]
    extra: Dict[str, Any]
    partial: str
    directory: str


def stage(parts: Parts, directory: str, agree: Callable[[Any], Any], copy: bool = False) -> Staged:
    """Every rank calls it: the state to write and the agreed partial directory. With ``copy`` every
    tensor is a copy (a DTensor's local shard included), so later updates of the live ones do not reach it."""
    directory = os.path.abspath(directory)
    partial = agree(f"{directory}.partial-{uuid.uuid4().hex[:12]}")
    state, extra = _dcp_state(parts), parts.extra
    if copy:
        state = nested.map_tensors(lambda t: t.detach().clone(), state)
        extra = nested.map_tensors(lambda t: t.detach().to("cpu", copy=True), extra)
    return Staged(state, extra, partial, directory)


def write(staged: Staged, rank: int, barrier: Callable[[], None], process_group: Any = None) -> None:
    """Every rank calls it (DCP's collectives on ``process_group``, ``None``: the default group);
    ``barrier`` waits for every rank's shards before the main process swaps the checkpoint in."""
    import torch.distributed.checkpoint as dcp

    # With a torch process group every rank writes its shards (DCP writes a replicated tensor once);
    # without one (Horovod, one process) the state is whole on every rank and rank 0 writes it.
    if torch.distributed.is_initialized() or rank == 0:
        dcp.save(staged.state, checkpoint_id=staged.partial, process_group=process_group)
    if rank == 0:
        write_atomic(staged.extra, os.path.join(staged.partial, EXTRA))
    barrier()
    if rank == 0:
        _swap_in(staged.partial, staged.directory)


def save(parts: Parts, directory: str, rank: int, agree: Callable[[Any], Any], barrier: Callable[[], None]) -> None:
    """Every rank calls it; see the module docstring. ``agree(x)`` returns rank 0's ``x`` on every rank."""
    write(stage(parts, directory, agree), rank, barrier)
    barrier()


def _swap_in(partial: str, directory: str) -> None:
    parent, name = os.path.split(directory)
    for stale in os.listdir(parent):  # partial directories of earlier saves that were killed
        if stale.startswith(f"{name}.partial-") and os.path.join(parent, stale) != partial:
            shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    previous = f"{directory}.previous"
    if os.path.exists(previous):
        shutil.rmtree(previous)
    if os.path.exists(directory):
        os.replace(directory, previous)
    os.replace(partial, directory)
    dir_fd = os.open(os.path.dirname(directory), os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    shutil.rmtree(previous, ignore_errors=True)


def resolve(directory: str) -> str:
    """The complete checkpoint directory to read: ``directory``, or ``<directory>.previous`` when a
    save was killed between its two renames; one-line :class:`CheckpointError` otherwise."""
    for candidate in (directory, f"{directory}.previous"):
        if os.path.isfile(os.path.join(candidate, ".metadata")) and os.path.isfile(os.path.join(candidate, EXTRA)):
            return candidate
    raise CheckpointError(f"no complete sharded checkpoint at {directory} (no .metadata and {EXTRA}); "
                          "check the path, or start without resuming")


def load(parts: Parts, directory: str) -> Dict[str, Any]:
    """Every rank calls it: model and optimizer state go into ``parts`` (resharded to this job's
    world size); returns the plain values saved beside them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    source = resolve(os.path.abspath(directory))
    state = _dcp_state(parts)
    try:
        dcp.load(state, checkpoint_id=source)
    except (Exception, CheckpointException) as exc:  # a BaseException holding each rank's traceback
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        cause = lines[-1] if lines else type(exc).__name__  # the innermost error, not "ranks: ..."
        raise CheckpointError(f"{source} does not match this model/optimizer ({cause[:200]}); "
                              "load it into the model it was saved from") from None
    set_model_state_dict(parts.model, state[parts.model_key])
    for key, optimizer in parts.optimizers.items():
        set_optimizer_state_dict(parts.model, optimizer, state[key])
    extra = read_safe(os.path.join(source, EXTRA))
    return extra if isinstance(extra, dict) else {}
