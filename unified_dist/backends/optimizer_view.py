"""An optimizer that stands for another: the wrappers ``ud.prepare`` returns (training/accumulation.py's
``PreparedOptimizer``, deepspeed_backend.py's ``EngineOptimizer``) are ``torch.optim.Optimizer`` instances, so LR
schedulers accept them, while ``param_groups``, ``state`` and ``defaults`` stay the wrapped optimizer's own: a
scheduler's learning rate is the one the wrapped optimizer steps with."""
from __future__ import annotations

from typing import Any, List

import torch


class OptimizerView(torch.optim.Optimizer):
    """``optimizer``'s ``param_groups``, ``state`` and ``defaults``, read and written through (``__init__`` of
    ``torch.optim.Optimizer`` is not called: the view holds no state of its own)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    @property
    def param_groups(self) -> List[dict]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[dict]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Any:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict) -> None:
        self.optimizer.defaults = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.optimizer!r})"
