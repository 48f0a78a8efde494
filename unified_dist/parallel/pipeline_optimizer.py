"""An optimizer's state under pipeline parallelism, in the layout one process over the whole model writes.

torch keys an optimizer's ``state_dict()`` by position: group by group, each parameter numbered in the order
the groups list them. Under ``pp`` each stage's optimizer numbers only its own stage's parameters, so two
stages both have a parameter 0 and neither file fits the whole model. The parameters keep the whole model's
fully-qualified names (:mod:`unified_dist.parallel.pipeline`), which is what both directions go through:

- :func:`whole_state` turns each stage's state into ``{name: entry}`` (full tensors on the CPU: a collective
  among the stage's FSDP2/TP ranks), gathers the stages on the first one, and numbers the parameters as one
  process numbers an optimizer built over the whole model's groups: group ``g`` holds every stage's group
  ``g``, in the model's order (``model.parameters()``'s); hyperparameters are the first stage's.
- :func:`stage_state` reads such a dict (written here, or by one process whose optimizer lists its groups'
  parameters in the model's order, e.g. ``AdamW(model.parameters())``) and keeps, renumbered, what this
  stage's optimizer holds.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..errors import CheckpointError
from .sharding import full_tensor


def _names(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> List[List[str]]:
    """The fully-qualified name of each parameter of each of ``optimizer``'s groups, in the groups' order."""
    name_of = {id(p): name for name, p in module.named_parameters()}
    groups = [[name_of.get(id(p)) for p in group["params"]] for group in optimizer.param_groups]
    if any(name is None for names in groups for name in names):
        raise CheckpointError("an optimizer under pp holds a parameter that is not in the pipelined model's stage: "
                              "build it from the prepared model's parameters (or pass it to ud.prepare with the model)")
    return groups


def _order(module: torch.nn.Module) -> List[str]:
    return [name for name, _ in module.named_parameters()]


def _same_groups(counts: List[int]) -> None:
    """Refuse stages whose optimizers have different numbers of param groups: the same one line on every rank
    of the pipeline group (each has every stage's count), so none is left waiting in a later collective."""
    if len(set(counts)) != 1:
        raise CheckpointError(f"the pipeline stages' optimizers have different numbers of param groups ({counts}, "
                              "by stage): build every stage's optimizer with the same groups, an empty one included")


def whole_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Any, gather: bool) -> dict:
    """The whole model's optimizer state in torch's positional layout, on the first stage of the ranks that
    ``gather`` (every rank of the pipeline ``group`` calls it with the same ``gather``); elsewhere this
    stage's own part, by name. Keys beside ``state`` and ``param_groups`` (``steps_taken``) are this rank's."""
    import torch.distributed as dist

    names = _names(module, optimizer)
    counts: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(counts, len(names), group=group)  # on every rank, whether it gathers or not
    _same_groups(counts)
    flat = [name for group_names in names for name in group_names]
    state = optimizer.state_dict()
    own = {flat[index]: {key: full_tensor(value.detach()).cpu() if isinstance(value, torch.Tensor) else value
                         for key, value in entry.items()}
           for index, entry in sorted(state["state"].items())}  # the same order on the stage's ranks
    groups = [{**{k: v for k, v in saved.items() if k not in ("params", "param_names")}, "params": group_names}
              for saved, group_names in zip(state["param_groups"], names)]
    part = {"order": _order(module), "state": own, "groups": groups}
    if not gather:
        return part
    stages = dist.get_world_size(group)
    parts: Optional[List[dict]] = [{} for _ in range(stages)] if dist.get_rank(group) == 0 else None
    dist.gather_object(part, parts, group=group, group_dst=0)
    if parts is None:
        return part
    extra = {k: v for k, v in state.items() if k not in ("state", "param_groups")}
    return {**extra, **_numbered(parts, [bool("param_names" in g) for g in state["param_groups"]])}


def _numbered(parts: List[dict], named: List[bool]) -> dict:
    """Every stage's ``part`` as one positional state dict (stage order is the model's order)."""
    position = {name: i for i, name in enumerate(n for part in parts for n in part["order"])}
    param_groups, number = [], {}
    for g in range(len(parts[0]["groups"])):  # the same on every stage (whole_state checked)
        members = sorted((n for part in parts for n in part["groups"][g]["params"]), key=position.__getitem__)
        for name in members:
            number[name] = len(number)
        entry = {**parts[0]["groups"][g], "params": [number[name] for name in members]}
        if named[g]:
            entry["param_names"] = members
        param_groups.append(entry)
    state = {number[name]: entry for part in parts for name, entry in part["state"].items()}
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}


def stage_state(module: torch.nn.Module, optimizer: torch.optim.Optimizer, group: Any, whole: dict,
                source: str) -> dict:
    """This stage's part of ``whole`` (the whole model's positional optimizer state), numbered as ``optimizer``
    numbers its parameters; every rank of the pipeline ``group`` calls it (one small all-gather of names)."""
    import torch.distributed as dist

    names = _names(module, optimizer)
    everyone: List[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, (_order(module), names), group=group)
    _same_groups([len(theirs) for _, theirs in everyone])
    position = {name: i for i, name in enumerate(n for order, _ in everyone for n in order)}
    saved_groups = whole.get("param_groups", [])
    members = [sorted((n for _, theirs in everyone for n in theirs[g]), key=position.__getitem__)
               for g in range(len(names))]
    sizes = [len(saved["params"]) for saved in saved_groups]
    if sizes != [len(m) for m in members]:
        raise CheckpointError(
            f"{source}: its optimizer has param groups of {sizes} parameters, the pipelined model's optimizer "
            f"{[len(m) for m in members]} over all stages: build the optimizer with the same groups as the one saved")
    saved_id: Dict[str, Any] = {name: index for m, saved in zip(members, saved_groups)
                                for name, index in zip(m, saved["params"])}
    flat = [name for group_names in names for name in group_names]
    saved_state = whole.get("state", {})
    state = {i: saved_state[saved_id[name]] for i, name in enumerate(flat) if saved_id[name] in saved_state}
    param_groups, start = [], 0
    for saved, group_names, ours in zip(saved_groups, names, optimizer.param_groups):
        entry = {**{k: v for k, v in saved.items() if k not in ("params", "param_names")},
                 "params": list(range(start, start + len(group_names)))}
        if "param_names" in ours:
            entry["param_names"] = list(group_names)
        param_groups.append(entry)
        start += len(group_names)
    extra = {k: v for k, v in whole.items() if k not in ("state", "param_groups")}
    return {**extra, "state": state, "param_groups": param_groups}
