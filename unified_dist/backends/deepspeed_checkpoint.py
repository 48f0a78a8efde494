"""ZeRO's state in the portable format that every backend reads and writes (``ud.save``/``ud.load``).

Under ZeRO stages 1-3 DeepSpeed keeps the float32 master weights and the optimizer's state in flat partitions,
one slice per rank (stage 3 also partitions the module's own parameters). The portable format is what the torch
backend writes for one process, DDP or FSDP2: the model's full state dict by parameter name, and the optimizer's
``state_dict()`` in torch's layout (``{"state": {index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``,
indices numbering the parameters of the user's groups in order, every tensor full and shaped like its parameter).
Moving between the two goes through DeepSpeed's own per-parameter API, never through its partition arithmetic:

- weights: ``safe_get_full_fp32_param``/``safe_set_full_fp32_param`` (the master copy), and the module's own
  parameters through ``module.state_dict()``/``load_state_dict`` (under stage 3 inside
  ``deepspeed.zero.GatheredParameters``, which gathers them and, with ``modifier_rank=0``, partitions rank 0's
  values again on exit);
- optimizer state: ``safe_get_full_optimizer_state``/``safe_set_full_optimizer_state`` per parameter and key
  (``exp_avg``, ``momentum_buffer``, ...); a scalar entry (AdamW's ``step``) is one value per flat partition, the
  same for every parameter of its group.

Every function here that reads or writes a parameter's full value is a collective (DeepSpeed gathers it): every
rank calls it, in the same order. DeepSpeed creates its optimizer's state at the first step; a checkpoint loaded
into an engine that has not stepped yet first lays the entries it names over each flat partition (zeros, then
overwritten per parameter) and lets DeepSpeed link its per-parameter views to them.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from ..errors import CheckpointError


def _per_element(value: Any) -> bool:
    """An optimizer state entry with one value per parameter element (a moment), not a scalar (a step count)."""
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _gathered(engine: Any, params: List[torch.nn.Parameter], modifier_rank: Any = None) -> Any:
    """Stage 3: DeepSpeed's context that holds ``params`` whole (a collective on entry and exit); else nothing."""
    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=modifier_rank)


def _set_full(p: torch.nn.Parameter, value: torch.Tensor, key: Optional[str] = None) -> None:
    """Set ``p``'s float32 master weight (``key`` ``None``) or optimizer state ``key`` to its full ``value``, the same
    on every rank. Stages 1-2: DeepSpeed's ``safe_set_full_fp32_param``/``safe_set_full_optimizer_state``. Stage 3:
    their ``safe_set_local_...`` twins with this rank's slice of the value, since DeepSpeed 0.19.8's full setter
    fails on a parameter whose size the ranks do not divide (it checks the unpadded size, then cuts the value by the
    padded one: ``start (2) + length (2) exceeds dimension size (3)``, seen here); the slice is the one DeepSpeed's
    own full getter reassembles: the flat value padded with zeros, ``p.ds_tensor.numel()`` elements per rank, in the
    rank order of ``p.ds_process_group``."""
    from deepspeed.utils import (
        safe_set_full_fp32_param,
        safe_set_full_optimizer_state,
        safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    value = value.detach().to(torch.float32)
    if hasattr(p, "ds_id"):
        import torch.distributed as dist

        size = p.ds_tensor.numel()
        padded = torch.nn.functional.pad(value.flatten(), (0, size * dist.get_world_size(p.ds_process_group)
                                                            - value.numel()))
        value = padded.narrow(0, size * dist.get_rank(p.ds_process_group), size)
        if key is None:
            safe_set_local_fp32_param(p, value)
        else:
            safe_set_local_optimizer_state(p, value, key)
    elif key is None:
        safe_set_full_fp32_param(p, value)
    else:
        safe_set_full_optimizer_state(p, value, key)


def model_state(engine: Any) -> Dict[str, torch.Tensor]:
    """The engine's module's full state dict on the CPU, each trainable parameter its float32 master weight (what
    the next step updates); buffers and frozen parameters as the module holds them. A collective."""
    from deepspeed.utils import safe_get_full_fp32_param

    module = engine.module
    params = list(module.parameters())
    with _gathered(engine, params):
        held = module.state_dict(keep_vars=True)
        state = {key: value.detach().cpu().clone() for key, value in held.items()}
    masters = {id(p): safe_get_full_fp32_param(p) for p in params if p.requires_grad}  # in the same order everywhere
    for key, value in held.items():
        master = masters.get(id(value))
        if master is not None:
            state[key] = master.detach().cpu().reshape(state[key].shape if state[key].numel() else master.shape)
    return state


def load_model_state(engine: Any, state: Dict[str, torch.Tensor], strict: bool) -> None:
    """Load a full state dict into the engine's module and its float32 master weights; every rank passes the same
    ``state`` (each read the checkpoint). A collective."""
    module = engine.module
    params = list(module.parameters())
    with _gathered(engine, params, modifier_rank=0):  # stage 3: rank 0's loaded values, partitioned again on exit
        module.load_state_dict(state, strict=strict)
    for name, p in module.named_parameters():
        if p.requires_grad and name in state:
            _set_full(p, state[name])


def _flat_partitions(engine: Any) -> List[Tuple[int, torch.Tensor]]:
    """Each of this rank's float32 flat partitions with the index of the user's param group it belongs to (the
    tensors the user's optimizer keeps state for)."""
    zero = engine.optimizer
    if hasattr(zero, "fp32_partitioned_groups_flat"):  # stage 3: sub-groups of the user's groups
        return [(zero.sub_group_to_group_id[i], flat) for i, flat in enumerate(zero.fp32_partitioned_groups_flat)]
    return [(i, flat) for i, group in enumerate(zero.optimizer.param_groups) for flat in group["params"]]


def _link_state_views(engine: Any) -> None:
    """Stages 1-2: point each parameter's view of the optimizer state (what DeepSpeed's ``safe_*_optimizer_state``
    read and write) at the entries the optimizer holds now. DeepSpeed 0.19.8 links them once, right after its
    first group's first step, when the later groups have no state yet: with several param groups (the example's
    decay and no-decay groups) those kept no view, and reading one failed ("exp_avg not found in optimizer state
    fragment"). Linked again before each use, every group has its own. Stage 3 has no such views (nothing done)."""
    zero = engine.optimizer
    if hasattr(zero, "_hp_optimizer_states_linked") and hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._hp_optimizer_states_linked = False
        zero._lazy_init_hp_params_optimizer_state()


def optimizer_state(engine: Any, optimizer: torch.optim.Optimizer, groups: List[List[torch.nn.Parameter]]) -> dict:
    """The user's ``optimizer`` (stepped by ``engine`` over its flat partitions) as torch's ``state_dict()`` of it
    over ``groups``, the parameters it was built with. A collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    _link_state_views(engine)
    keys: Dict[int, List[str]] = {}
    scalars: Dict[int, Dict[str, Any]] = {}
    for index, flat in _flat_partitions(engine):
        for key, value in optimizer.state.get(flat, {}).items():
            if _per_element(value):
                keys.setdefault(index, [])
                if key not in keys[index]:
                    keys[index].append(key)
            else:
                scalars.setdefault(index, {})[key] = value.clone() if isinstance(value, torch.Tensor) else value
    state: Dict[int, dict] = {}
    param_groups = []
    number = 0
    for index, (group, params) in enumerate(zip(optimizer.param_groups, groups)):
        ids = list(range(number, number + len(params)))
        number += len(params)
        param_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        if index not in keys:
            continue  # no step yet: torch's state dict has no entry either
        for i, p in zip(ids, params):
            if not p.requires_grad:
                continue
            entry = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.get(index, {}).items()}
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape  # stage 3 keeps the full shape aside
            for key in keys[index]:  # a collective per parameter and key
                entry[key] = safe_get_full_optimizer_state(p, key).detach().cpu().reshape(shape)
            state[i] = entry
    return {"state": state, "param_groups": param_groups}


def load_optimizer_state(engine: Any, optimizer: torch.optim.Optimizer, groups: List[List[torch.nn.Parameter]],
                         saved: dict) -> None:
    """Load torch's ``state_dict()`` layout of an optimizer over ``groups`` (from any backend) into the engine's
    flat partitions, and the saved groups' hyperparameters into ``optimizer``'s groups. A collective."""
    saved_groups = saved.get("param_groups", [])
    if [len(g["params"]) for g in saved_groups] != [len(params) for params in groups]:
        raise CheckpointError(
            f"the checkpoint's optimizer has groups of {[len(g['params']) for g in saved_groups]} parameters, this one "
            f"{[len(params) for params in groups]}: build the optimizer over the same parameter groups as the run "
            "that saved it")
    saved_state = saved.get("state", {})
    if not saved_state:
        if any(optimizer.state.get(flat) for _, flat in _flat_partitions(engine)):
            raise CheckpointError("the checkpoint's optimizer has not stepped but this one has: load it into a "
                                  "freshly prepared optimizer")
        return
    for group, saved_group in zip(optimizer.param_groups, saved_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    by_group: Dict[int, List[Tuple[torch.nn.Parameter, dict]]] = {}
    for index, (saved_group, params) in enumerate(zip(saved_groups, groups)):
        by_group[index] = [(p, saved_state[i]) for i, p in zip(saved_group["params"], params)
                           if i in saved_state and p.requires_grad]
    for index, flat in _flat_partitions(engine):
        if not by_group.get(index):
            continue
        held = optimizer.state[flat]
        for key, value in by_group[index][0][1].items():  # a group's entries: its first parameter's keys
            if _per_element(value):
                held.setdefault(key, torch.zeros_like(flat))
            elif isinstance(held.get(key), torch.Tensor) and isinstance(value, torch.Tensor):
                held[key].copy_(value)
            else:
                held[key] = value.clone() if isinstance(value, torch.Tensor) else value
    _link_state_views(engine)  # stages 1-2: each parameter's view of the entries made above, in every group
    for index in sorted(by_group):
        for p, entry in by_group[index]:
            for key, value in entry.items():
                if _per_element(value):
                    _set_full(p, value, key)
