"""One plain process: world size 1, every collective returns (a copy of) its input."""
from __future__ import annotations

import copy
from typing import Any

import torch

from .base import Backend, Config


class SingleProcessBackend(Backend):
    """No process group at all; callers never need to branch on world size. A layout that needs
    more than one rank (``dp_replicate=2``, ``tp=2``) is refused at construction."""

    name = "single"

    def __init__(self, detection: Any, config: Config) -> None:
        super().__init__(detection, config)
        sharding = config.sharding
        if sharding.splits_model:
            sharding.layout(1, machines=lambda: 1)

    @property
    def rank(self) -> int:
        return 0

    @property
    def local_rank(self) -> int:
        return 0

    @property
    def world_size(self) -> int:
        return 1

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return model.to(self.device)

    def all_reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        return tensor

    def all_gather_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return tensor

    def broadcast_object(self, obj: Any, src: int) -> Any:
        return copy.deepcopy(obj)

    def barrier(self) -> None:
        return None
