"""torch.distributed + DistributedDataParallel, as started by ``torchrun``."""
from __future__ import annotations

import os
from fractions import Fraction
from typing import Any, ContextManager, List, Optional

import torch
import torch.distributed as dist

from ..detection import Detection
from ..errors import UnifiedDistError
from ..parallel import pipeline_optimizer
from ..parallel.mesh import PP_DIM
from ..parallel.pipeline import PipelinedModel
from ..parallel.sharding import clip_grad_norm
from .base import DDP_BUFFER_KWARGS as BUFFER_KWARGS, Config
from .buckets import ddp_kwargs
from .process_group import local_rank_from_hosts, withdraw_rendezvous
from .replica_groups import ReplicaGroups, layout_from
from .torch_group import TorchGroupBackend


class TorchBackend(TorchGroupBackend):
    """Joins the default process group (nccl on GPU, gloo on CPU) from the launcher's variables
    (torchrun's, or those detection derived for srun and mpirun), or adopts the group the
    process already joined itself, which it then never destroys."""

    name = "torch"
    supports_pipeline = True

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "supports_pipeline" not in cls.__dict__:  # a stack built on this one (DeepSpeed's engine) says so itself
            cls.supports_pipeline = False

    def __init__(self, detection: Detection, config: Config) -> None:
        super().__init__(detection, config)
        self._join_group(detection, always=True)
        self._local_rank = detection.local_rank if detection.local_rank is not None else local_rank_from_hosts()
        self._split_models(dist.get_world_size())
        layout = layout_from(os.environ)
        if layout is not None:
            self.replicas = ReplicaGroups(layout, dist.get_rank(), dist.get_world_size(), config.timeout)

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def local_rank(self) -> int:
        return self._local_rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size()

    def checkpoint_problem(self, action: str) -> Optional[str]:
        """Under pipeline parallelism the per-rank formats (``save_sharded``/``load_sharded``) are refused: each
        rank holds one stage, which torch's distributed checkpoint has not been shown to place."""
        pp = self.config.sharding.pp
        if pp == 1 or action not in ("save_sharded", "load_sharded"):
            return None
        return (f"ud.{action} of a model under pp={pp} is not supported yet (each rank holds one pipeline stage); "
                "use ud.save and ud.load, which gather the stages into one file keyed by the model's names")

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """Under pipeline parallelism: the whole model's optimizer state (every stage's, gathered to the main
        process's pipeline group), numbered as one process over the whole model numbers it."""
        if self.config.sharding.pp == 1:
            return super().optimizer_state_dict(optimizer)
        gather = self.layout.data_parallel_rank(self.rank) == 0 and self.tp_rank == 0
        return pipeline_optimizer.whole_state(self._fsdp.stage_of(optimizer), optimizer,
                                              self.device_mesh[PP_DIM].get_group(), gather)

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict, source: str) -> None:
        """Under pipeline parallelism each stage's optimizer takes its stage's part of the whole model's ``state``."""
        if self.config.sharding.pp == 1:
            return super().load_optimizer_state_dict(optimizer, state, source)
        optimizer.load_state_dict(pipeline_optimizer.stage_state(
            self._fsdp.stage_of(optimizer), optimizer, self.device_mesh[PP_DIM].get_group(), state, source))
        return None

    def clip_gradients(self, parameters: List[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        """Under pipeline parallelism each stage holds its own parameters: the norm clipped to is the whole
        model's, its stages' norms combined over the pipeline (every stage's ranks call it, as a step does)."""
        if self.config.sharding.pp == 1:
            return super().clip_gradients(parameters, max_norm, norm_type)
        return clip_grad_norm(parameters, max_norm, norm_type, across=self.device_mesh[PP_DIM].get_group())

    def model_state_dict(self, model: torch.nn.Module) -> dict:
        """A pipelined model's whole state (every stage's, gathered to the main process's pipeline group)."""
        if isinstance(model, PipelinedModel):
            return model.whole_state_dict(gather=self.layout.data_parallel_rank(self.rank) == 0 and self.tp_rank == 0)
        return super().model_state_dict(model)

    def load_model_state_dict(self, model: torch.nn.Module, state: dict, strict: bool) -> None:
        """A pipelined model takes its stage's part of the whole model's ``state``."""
        if isinstance(model, PipelinedModel):
            model.load_whole_state_dict(state, strict=strict)
            return
        super().load_model_state_dict(model, state, strict)

    # ----------------------------------------------------------------- replica groups
    @property
    def data_parallel_rank(self) -> int:
        """With replica groups: the group's index times its data-parallel size plus the rank's place in it
        (each group keeps its own share of every prepared loader's samples)."""
        inner = super().data_parallel_rank
        return inner if self.replicas is None else self.replicas.layout.group * super().data_parallel_world_size + inner

    @property
    def data_parallel_world_size(self) -> int:
        """With replica groups: every group's data-parallel ranks, whether or not a group is up now."""
        inner = super().data_parallel_world_size
        return inner if self.replicas is None else inner * self.replicas.layout.groups

    @property
    def participating_world_size(self) -> int:
        inner = super().data_parallel_world_size
        return inner if self.replicas is None else inner * self.replicas.participants

    def backward(self, loss: torch.Tensor, scaler: Optional[Any] = None, weight: Fraction = Fraction(1)) -> None:
        if self.replicas is not None and not self.replicas.opened:
            raise UnifiedDistError(
                "with replica groups, a step's batches must come from a DataLoader given to ud.prepare: the step's "
                "quorum, and the copy a restarted group takes from a live one, happen before its batch is fetched "
                "(here the forward already ran on weights a copy would replace)")
        super().backward(loss, scaler, weight)

    def _average_over_groups(self, optimizer: torch.optim.Optimizer) -> None:
        self.replicas.average(p.grad for group in optimizer.param_groups for p in group["params"]
                              if p.grad is not None)

    def finalize_gradients(self, optimizer: torch.optim.Optimizer, scaler: Optional[Any]) -> None:
        if self.replicas is not None:
            self._average_over_groups(optimizer)
        super().finalize_gradients(optimizer, scaler)

    def step_context(self, optimizer: torch.optim.Optimizer, finalized: bool) -> ContextManager:
        if self.replicas is not None and not finalized:
            self._average_over_groups(optimizer)
        return super().step_context(optimizer, finalized)

    def average_buffers_across_groups(self, buffers: List[torch.Tensor]) -> None:
        if self.replicas is not None:
            floating = [b for b in buffers if b.is_floating_point()]
            if floating:
                self.replicas.average(floating)

    def commit_step(self, optimizer: torch.optim.Optimizer) -> bool:
        return True if self.replicas is None else self.replicas.commit()

    def shutdown(self) -> None:
        if self.replicas is not None:
            self.replicas.shutdown()
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
