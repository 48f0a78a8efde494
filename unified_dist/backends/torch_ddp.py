"""torch.distributed + DistributedDataParallel, as started by ``torchrun``."""
from __future__ import annotations

from typing import Any, ContextManager, Dict, List, Optional

import torch
import torch.distributed as dist

from ..detection import Detection
from .base import DDP_BUFFER_KWARGS as BUFFER_KWARGS, Backend, Config
from .buckets import ddp_kwargs
from .compression import register_ddp_hook
from .ddp_lifetime import DdpTracker
from .fsdp import FsdpModels, OnMesh
from .process_group import (
    TORCH_OPS,
    StoreArrivals,
    destroy_at_exit,
    export_rendezvous,
    gather_stacked,
    join_default_group,
    local_rank_from_hosts,
    withdraw_rendezvous,
)


class TorchBackend(StoreArrivals, OnMesh, Backend):
    """Joins the default process group (nccl on GPU, gloo on CPU) from the launcher's variables
    (torchrun's, or those detection derived for srun and mpirun), or adopts the group the
    process already joined itself, which it then never destroys."""

    name = "torch"

    def __init__(self, detection: Detection, config: Config) -> None:
        super().__init__(detection, config)
        self._ddp = DdpTracker()
        self._owns_group = not dist.is_initialized()
        self._exported: Dict[str, str] = {}
        if self._owns_group:
            self._exported = export_rendezvous(detection)
            join_default_group(config.timeout, always=True)
        self._local_rank = detection.local_rank if detection.local_rank is not None else local_rank_from_hosts()
        self._fsdp = FsdpModels(config.sharding, config.mixed_precision, dist.get_world_size(), self.device.type)

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

    def leave_at_exit(self) -> None:
        self._ddp.release()
        destroy_at_exit(self._owns_group)

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        if not any(p.requires_grad for p in model.parameters()):
            return model  # nothing to synchronise (e.g. an evaluation-only model)
        if self._fsdp.enabled:
            return self._fsdp.prepare(model)
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=device_ids, **BUFFER_KWARGS, **ddp_kwargs(self.config.bucket_mb, self.config.bucket_view))
        return self._ddp.track(self.apply_compression(ddp))

    def apply_compression(self, model: torch.nn.Module) -> torch.nn.Module:
        """A DDP communication hook (torch's fp16/bf16 compress hooks)."""
        return register_ddp_hook(model, self.config.gradient_compression)

    def compile_regions(self, model: torch.nn.Module) -> Optional[List[torch.nn.Module]]:
        return self._fsdp.regions(model)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        return self._fsdp.adopt(optimizer)

    def no_sync(self, model: torch.nn.Module) -> ContextManager:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return model.no_sync()
        return self._fsdp.no_sync(model) or super().no_sync(model)

    def all_reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        dist.all_reduce(tensor, op=TORCH_OPS[op])
        return tensor

    def all_gather_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        return gather_stacked(tensor, self.world_size)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        dist.broadcast(tensor, src=src)
        return tensor

    def broadcast_object(self, obj: Any, src: int) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def barrier(self) -> None:
        dist.barrier()
