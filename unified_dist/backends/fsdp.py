"""FSDP2, HSDP and tensor parallelism for the backends that run on torch.distributed (torch,
Accelerate): the job's device mesh, and what ``prepare`` does to models and optimizers when
``sharding="fsdp"`` or ``tp > 1`` (see :mod:`unified_dist.parallel.sharding`, :mod:`unified_dist.parallel.mesh`)."""
from __future__ import annotations

import weakref
from typing import Any, ContextManager, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError, LaunchError
from ..parallel import pipeline
from ..parallel.mesh import PP_DIM, Layout, machines
from ..parallel.sharding import Sharding, blocks_to_shard, is_sharded, no_gradient_sync, point_optimizer_at, shard_model
from ..parallel.tensor_parallel import resolve_plan
from .precision import Precision
from .process_group import host_names


class FsdpModels:
    """The job's layout and device mesh; splits the models a backend prepares and points optimizers
    built before ``prepare`` at the new parameters. Holds only weak references to the replaced
    parameters, so their full-size memory goes as soon as the last optimizer stops referring to them.

    Constructing it with ``world_size`` builds the mesh when the sharding needs one: a collective
    (every rank constructs it at ``init``); a layout that does not fit the world raises there."""

    def __init__(self, sharding: Sharding, mixed_precision: str, world_size: int = 1,
                 device_type: str = "cpu") -> None:
        self.sharding = sharding
        self.mixed_precision = mixed_precision
        self._new_of: Dict[int, Tuple["weakref.ref[torch.nn.Parameter]", torch.nn.Parameter]] = {}
        self._blocks: "weakref.WeakKeyDictionary[torch.nn.Module, List[torch.nn.Module]]" = weakref.WeakKeyDictionary()
        self._dropped: Dict[int, "weakref.ref[torch.nn.Parameter]"] = {}  # other pipeline stages' parameters
        self._stages: "weakref.WeakSet[pipeline.PipelinedModel]" = weakref.WeakSet()  # the pipelined models
        self.layout = Layout(1, world_size, 1)
        self.mesh: Optional[Any] = None
        if sharding.splits_model:
            self.layout = sharding.layout(world_size, lambda: machines(host_names()))
            if not sharding.enabled and self.layout.data_parallel > 1:
                what = " x ".join(f"{name}={size}" for name, size in (("pp", sharding.pp), ("tp", sharding.tp))
                                  if size > 1)
                raise LaunchError(
                    f"{what} on {world_size} ranks leaves {self.layout.data_parallel} data-parallel ranks, "
                    "whose gradients only sharding='fsdp' averages (FSDP x TP, FSDP x PP); add sharding='fsdp' or "
                    f"make {what} the world size")
            self.mesh = self.layout.build_mesh(device_type)

    @property
    def enabled(self) -> bool:
        """Whether ``prepare`` splits models (FSDP2, HSDP or tensor parallelism)."""
        return self.sharding.splits_model

    def prepare(self, model: torch.nn.Module, rank: int = 0, device: Optional[torch.device] = None) -> torch.nn.Module:
        """Split ``model`` (already on ``device``; ``rank`` this process's global rank): with ``pp``
        keep only this rank's pipeline stage of it, in place, and return it inside a
        :class:`~unified_dist.parallel.pipeline.PipelinedModel`; remember which parameter became which."""
        sharding, stage = self.sharding, self.layout.pp_rank(rank)
        whole_keys = list(model.state_dict()) if sharding.pp > 1 else []
        stage_tp_plan = None
        if sharding.pp > 1:
            if sharding.tp > 1:  # the plan is the whole model's, checked whole on every stage (one verdict)
                whole_plan = resolve_plan(model, sharding.tp_plan, tp=sharding.tp)
            plan = pipeline.stage_units(model, sharding.pp, sharding.pp_split)
            for param in pipeline.keep_stage(model, stage, plan):
                self._dropped[id(param)] = weakref.ref(param)
            if sharding.tp > 1:  # each stage splits the planned layers it holds
                held = dict(model.named_modules())
                stage_tp_plan = {name: style for name, style in whole_plan.items()
                                 if name in held and not isinstance(held[name], pipeline.OtherStage)}
        before = list(model.parameters())
        self._blocks[model] = blocks_to_shard(model, sharding.modules)  # before FSDP2 renames their classes
        mesh = self.mesh
        shard_model(model, sharding, Precision(self.mixed_precision),
                    dp_mesh=self.layout.data_parallel_mesh(mesh), tp_mesh=mesh["tp"], tp_plan=stage_tp_plan)
        for old, new in zip(before, model.parameters()):
            self._new_of[id(old)] = (weakref.ref(old), new)
        if sharding.pp > 1:
            pipelined = pipeline.PipelinedModel(model, stage, sharding.pp, sharding.pp_schedule, sharding.microbatches,
                                                device or torch.device("cpu"), mesh[PP_DIM].get_group(), whole_keys,
                                                stage_group=self._stage_group(stage))
            self._stages.add(pipelined)
            return pipelined
        return model

    def stage_of(self, optimizer: torch.optim.Optimizer) -> torch.nn.Module:
        """The pipelined model's stage (the user's module, other stages' units replaced) whose parameters
        ``optimizer`` steps; a one-line ``CheckpointError`` when no prepared model holds them."""
        params = {id(p) for group in optimizer.param_groups for p in group["params"]}
        stages = [m.module for m in self._stages if params & {id(p) for p in m.module.parameters()}]
        if len(stages) == 1 or (not stages and len(self._stages) == 1):
            return (stages or [m.module for m in self._stages])[0]
        raise CheckpointError(f"an optimizer under pp steps the parameters of {len(stages)} prepared pipelined "
                              "models; give ud.save/ud.load one optimizer per model, built from its parameters")

    def _stage_group(self, stage: int) -> Any:
        """The process group of pipeline stage ``stage``'s ranks (``None`` where the stage has one rank); every
        rank creates every stage's, as ``torch.distributed.new_group`` needs."""
        import torch.distributed as dist

        layout = self.layout
        if layout.world // layout.pp == 1:
            return None
        groups = [dist.new_group([r for r in range(layout.world) if layout.pp_rank(r) == s]) for s in range(layout.pp)]
        return groups[stage]

    def regions(self, model: torch.nn.Module) -> Optional[List[torch.nn.Module]]:
        """The blocks of a model :meth:`prepare` split, to compile one by one (``None``: not split here)."""
        return self._blocks.get(model) if self.enabled else None

    def adopt(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """``optimizer`` stepping the sharded parameters (a no-op for an optimizer built after ``prepare``),
        without the parameters of the other pipeline stages."""
        if not self.enabled:
            return optimizer
        if self._dropped:
            for group in optimizer.param_groups:
                group["params"] = [p for p in group["params"] if not self._is_dropped(p)]
        return point_optimizer_at(optimizer, self._replacement)

    def _is_dropped(self, param: torch.nn.Parameter) -> bool:
        ref = self._dropped.get(id(param))
        return ref is not None and ref() is param

    def _replacement(self, param: torch.nn.Parameter) -> torch.nn.Parameter:
        entry = self._new_of.get(id(param))
        return entry[1] if entry is not None and entry[0]() is param else param

    @staticmethod
    def no_sync(model: Any) -> Optional[ContextManager]:
        """The no-communication context for a sharded ``model``; ``None`` for any other model."""
        return no_gradient_sync(model) if is_sharded(model) else None
