"""FSDP2 for the backends that run on torch.distributed (torch, Accelerate): what ``prepare``
does to models and optimizers when ``sharding="fsdp"`` (see :mod:`unified_dist.sharding`)."""
from __future__ import annotations

import weakref
from typing import Any, ContextManager, Dict, Optional, Tuple

import torch

from ..sharding import Sharding, is_sharded, no_gradient_sync, point_optimizer_at, shard_model


class FsdpModels:
    """Shards the models a backend prepares and points optimizers built before ``prepare`` at the
    new parameters. Holds only weak references to the replaced parameters, so their full-size
    memory goes as soon as the last optimizer stops referring to them."""

    def __init__(self, sharding: Sharding, mixed_precision: str) -> None:
        self.sharding = sharding
        self.mixed_precision = mixed_precision
        self._new_of: Dict[int, Tuple["weakref.ref[torch.nn.Parameter]", torch.nn.Parameter]] = {}

    @property
    def enabled(self) -> bool:
        return self.sharding.enabled

    def prepare(self, model: torch.nn.Module) -> torch.nn.Module:
        """``fully_shard`` ``model`` (already on its device); remember which parameter became which."""
        before = list(model.parameters())
        shard_model(model, self.sharding, self.mixed_precision)
        for old, new in zip(before, model.parameters()):
            self._new_of[id(old)] = (weakref.ref(old), new)
        return model

    def adopt(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` stepping the sharded parameters (a no-op for an optimizer built after ``prepare``)."""
        return point_optimizer_at(optimizer, self._replacement) if self.enabled else optimizer

    def _replacement(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        entry = self._new_of.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else param

    @staticmethod
    def no_sync(model: Any) -> Optional[ContextManager]:
        """The no-communication context for a sharded ``model``; ``None`` for any other model."""
        return no_gradient_sync(model) if is_sharded(model) else None
