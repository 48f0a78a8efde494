"""Module buffers (BatchNorm's running statistics, counters, any ``register_buffer``) with one
meaning on every backend.

**A prepared model's buffers are rank 0's.** Every rank starts from rank 0's buffers (at
``prepare``); rank 0's evolve as those of one process fed rank 0's micro-batches; and after every
optimizer step every rank holds rank 0's again. So evaluation after a step gives the same outputs
on every rank and under every launcher, and a checkpoint holds what every rank evaluates with.

Why not each stack's own rule: DDP (torch, Accelerate) broadcasts rank 0's buffers *before* the
forward of a synchronising micro-step (``broadcast_buffers=True``), so after that forward every
rank holds its own statistics again, and evaluation right after training differs between ranks;
Horovod and FSDP2 never broadcast buffers at all. The facade turns DDP's broadcast off
(:data:`unified_dist.backends.base.DDP_BUFFER_KWARGS`) and broadcasts once after each optimizer step instead, on
every backend: the
same number of collectives as DDP's rule, one per buffer dtype. Between two steps (the micro-steps
of an accumulation window) each rank's buffers follow its own micro-batches, as under DDP.

With replica groups (docs/fault-tolerance.md), the buffers are also averaged over the groups that take part in
the step, inside the step and before its commit decision (:meth:`ModelBuffers.before_commit`,
:meth:`~unified_dist.backends.base.Backend.average_buffers_across_groups`), so each group's rank 0 hands out the
average of the groups' rank 0 buffers.
``init(sync_batchnorm=True)`` changes what the statistics *are* (computed over the global batch,
see :mod:`unified_dist.parallel.sync_batchnorm`); the rule here still keeps every rank's copy equal.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

import torch

from ..backends.base import Backend
from ..collectives import ops as collectives


def _unique_buffers(models: Iterable[torch.nn.Module]) -> List[torch.Tensor]:
    seen: Dict[int, torch.Tensor] = {}
    for model in models:
        for buffer in model.buffers():
            seen.setdefault(id(buffer), buffer)
    return list(seen.values())


def broadcast_from_main(backend: Backend, models: Iterable[torch.nn.Module]) -> None:
    """Copy rank 0's buffers of ``models`` into every rank's, in place: one broadcast per
    (device, dtype) group, in the same order on every rank. Nothing happens with one process."""
    if backend.world_size == 1:
        return
    groups: Dict[Tuple[torch.device, torch.dtype], List[torch.Tensor]] = {}
    for buffer in _unique_buffers(models):
        groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
    with torch.no_grad():
        for tensors in groups.values():  # in the models' buffer order, the same on every rank
            flat = torch.cat([t.reshape(-1) for t in tensors])
            flat = collectives.broadcast(backend, flat, 0, what="buffers (after optimizer.step)")
            offset = 0
            for t in tensors:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


class ModelBuffers:
    """The prepared models that have buffers, and which of them each optimizer steps."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._models: List[torch.nn.Module] = []
        self._stepped_by: Dict[int, List[torch.nn.Module]] = {}  # id(optimizer) -> its models

    def add(self, model: torch.nn.Module) -> None:
        """Register a just-prepared model and give every rank rank 0's buffers now."""
        alone = self.backend.world_size == 1 and self.backend.replicas is None
        if alone or not any(True for _ in model.buffers()):
            return
        self._models.append(model)
        self._stepped_by.clear()
        if self.backend.communicates_at_prepare:  # else the elastic state sync hands out rank 0's
            broadcast_from_main(self.backend, [model])

    def _models_of(self, optimizer: torch.optim.Optimizer) -> List[torch.nn.Module]:
        """The models ``optimizer`` steps (those whose parameters it holds; the same choice on every rank)."""
        models = self._stepped_by.get(id(optimizer))
        if models is None:
            held = {id(p) for group in optimizer.param_groups for p in group["params"]}
            models = [m for m in self._models if any(id(p) in held for p in m.parameters())]
            self._stepped_by[id(optimizer)] = models
        return models

    def before_commit(self, optimizer: torch.optim.Optimizer) -> None:
        """With replica groups, inside ``optimizer``'s step and before its commit decision: each rank's buffers
        of the models it steps averaged over the groups taking part in the step (rank ``r`` with rank ``r`` of
        the others), so that :meth:`after_step` hands out rank 0's average. Inside the step, so that nothing
        after a step's commit opens the next step's quorum (a job's last step then is its last)."""
        if self._models and self.backend.replicas is not None:
            models = self._models_of(optimizer)
            if models:
                self.backend.average_buffers_across_groups(_unique_buffers(models))

    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """After ``optimizer`` stepped: every rank takes rank 0's buffers of the models it steps."""
        if self._models:
            models = self._models_of(optimizer)
            if models:
                broadcast_from_main(self.backend, models)
