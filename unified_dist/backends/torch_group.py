"""The base of the backends that run on torch's default process group (torch, Accelerate).

What they share, written once: who owns the group (joined here, so destroyed at shutdown, or joined
before unified_dist came, so left running), the rendezvous variables exported for srun and mpirun,
the DDP wrappers (their reducers freed before the group goes) and their compression hooks, the
FSDP2/HSDP/TP models and the device mesh that is the backend's layout, the collectives over the
default group, and :meth:`missing_peers` over its key-value store. A subclass says how to join (torch
joins itself; Accelerate lets its ``Accelerator`` reuse the group) and how a model gets its DDP wrapper.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist

from ..detection import Detection
from ..parallel.mesh import Layout
from .base import Backend, Config
from .compression import register_ddp_hook
from .ddp_lifetime import DdpTracker
from .fsdp import FsdpModels
from .process_group import (
    TORCH_OPS,
    destroy_at_exit,
    export_rendezvous,
    gather_stacked,
    join_default_group,
)


class TorchGroupBackend(Backend):
    """A :class:`~unified_dist.backends.base.Backend` over torch's default process group.

    Contract for subclasses: call :meth:`_join_group` before anything communicates and
    :meth:`_split_models` once the world size is known; implement :meth:`_wrap_ddp`.
    """

    def __init__(self, detection: Detection, config: Config) -> None:
        super().__init__(detection, config)
        self._ddp = DdpTracker()
        self._owns_group = not dist.is_initialized()  # a group the process joined itself stays at shutdown
        self._exported: Dict[str, str] = {}
        self._arrival_counts: Dict[str, int] = {}

    # ----------------------------------------------------------------- the group
    def _join_group(self, detection: Detection, always: bool, export: bool = True) -> bool:
        """Join the default group when this backend owns it: export srun's/mpirun's rendezvous as
        torch's ``env://`` variables (``export``), then join (``always=False``: only where a torchrun
        restart needs a per-attempt store; the library joins otherwise). Whether it joined here."""
        if not self._owns_group:
            return False
        if export:
            self._exported = export_rendezvous(detection)
        return join_default_group(self.config.timeout, always=always)

    def leave_at_exit(self) -> None:
        self._ddp.release()
        destroy_at_exit(self._owns_group)

    # ----------------------------------------------------------------- models
    def _split_models(self, world_size: int) -> None:
        """The FSDP2/HSDP/TP models of this job (the device mesh is built here: a collective)."""
        self._fsdp = FsdpModels(self.config.sharding, self.config.mixed_precision, world_size, self.device.type)

    @property
    def layout(self) -> Layout:
        return self._fsdp.layout

    @property
    def device_mesh(self) -> Any:
        return self._fsdp.mesh

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` in its library's DDP wrapper (on the backend's device)."""
        raise NotImplementedError

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """A model without trainable parameters goes to the device as it is (DDP refuses it, and there
        is nothing to synchronise); a split model to FSDP2/TP; any other to DDP, with its hook."""
        if not any(p.requires_grad for p in model.parameters()):
            return model.to(self.device)
        if self._fsdp.enabled:
            return self._fsdp.prepare(model.to(self.device), self.rank, self.device)
        return self._ddp.track(self.apply_compression(self._wrap_ddp(model)))

    def apply_compression(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` (a DDP wrapper) with the communication hook of ``config.gradient_compression``
        (torch's fp16/bf16 compress hooks; Accelerate's own ``comm_hook`` kwarg would hand DDP torch's
        bf16 hook, which DDP refuses without NCCL)."""
        return register_ddp_hook(model, self.config.gradient_compression)

    def compile_regions(self, model: torch.nn.Module) -> Optional[List[torch.nn.Module]]:
        return self._fsdp.regions(model)

    # ----------------------------------------------------------------- collectives
    def all_reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.world_size > 1:
            dist.all_reduce(tensor, op=TORCH_OPS[op])
        return tensor

    def all_gather_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.unsqueeze(0) if self.world_size == 1 else gather_stacked(tensor, self.world_size)

    def missing_peers(self, name: str, seconds: float) -> list:
        """Over the default group's key-value store (torchrun's, or the one ``init_process_group``
        made): one key per rank and point, polled by rank 0 only."""
        from torch.distributed.distributed_c10d import _get_default_store

        rank, world_size = self.rank, self.world_size
        if world_size == 1:
            return []
        n = self._arrival_counts[name] = self._arrival_counts.get(name, 0) + 1
        store = _get_default_store()
        key = f"unified_dist/arrived/{name}/{n}/"
        store.set(key + str(rank), b"1")
        if rank != 0:
            return []
        keys = {r: key + str(r) for r in range(1, world_size)}
        deadline = time.monotonic() + seconds
        while True:
            missing = [r for r, k in keys.items() if not store.check([k])]
            if not missing or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if missing:  # the others never counted this call: forget it, so the next one lines up again
            self._arrival_counts[name] -= 1
            keys = {}
        for k in (key + "0", *keys.values()):
            store.delete_key(k)
        return missing
