"""torch.distributed + DistributedDataParallel, as started by ``torchrun``."""
from __future__ import annotations

from typing import Any, ContextManager, Optional

import torch
import torch.distributed as dist

from ..detection import Detection
from .base import DDP_BUFFER_KWARGS as BUFFER_KWARGS, Config
from .buckets import ddp_kwargs
from .process_group import local_rank_from_hosts, withdraw_rendezvous
from .torch_group import TorchGroupBackend


class TorchBackend(TorchGroupBackend):
    """Joins the default process group (nccl on GPU, gloo on CPU) from the launcher's variables
    (torchrun's, or those detection derived for srun and mpirun), or adopts the group the
    process already joined itself, which it then never destroys."""

    name = "torch"

    def __init__(self, detection: Detection, config: Config) -> None:
        super().__init__(detection, config)
        self._join_group(detection, always=True)
        self._local_rank = detection.local_rank if detection.local_rank is not None else local_rank_from_hosts()
        self._split_models(dist.get_world_size())

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.barrier()  # nobody is still reducing when the reducers go
            self._ddp.release()
            if self._owns_group:
                dist.destroy_process_group()
        withdraw_rendezvous(self._exported)

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(
            model.to(self.device), device_ids=device_ids, **BUFFER_KWARGS,
            **ddp_kwargs(self.config.bucket_mb, self.config.bucket_view))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        return self._fsdp.adopt(optimizer)

    def no_sync(self, model: torch.nn.Module) -> ContextManager:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return self._fsdp.no_sync(model) or super().no_sync(model)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()
