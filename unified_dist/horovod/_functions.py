"""Horovod's state helpers: ``broadcast_parameters``, ``broadcast_optimizer_state``,
``broadcast_object``, ``allgather_object``, with Horovod's semantics (see each docstring)."""
from __future__ import annotations

import io
from typing import Any, Callable, Dict, List, Optional

import torch

from . import _ops
from ._collectives import allgather
from ._ops import ProcessSet, broadcast_, broadcast_async_, global_process_set, synchronize


def _pickler() -> Any:
    """cloudpickle where installed (Horovod's choice: lambdas and local classes travel), else pickle."""
    try:
        import cloudpickle
    except ImportError:
        import pickle as cloudpickle
    return cloudpickle


def broadcast_parameters(params: Any, root_rank: int) -> None:
    """Overwrite, in place, every tensor of ``params`` (a ``state_dict()``, ``named_parameters()`` list or
    list of tensors) with ``root_rank``'s; a dict is walked in sorted key order."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif isinstance(params, list):
        items = [p if isinstance(p, tuple) else (None, p) for p in params]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = [broadcast_async_(p, root_rank) for _, p in items]
    for handle in handles:
        synchronize(handle)


def _fill_empty_state(optimizer: torch.optim.Optimizer) -> None:
    """An optimizer with no state yet takes one step on zero gradients (so its state exists to be sent):
    Horovod's behaviour, which applies e.g. weight decay once, kept so results equal Horovod's."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p.data)
    step = getattr(optimizer, "_local_step", None) or optimizer.step
    step()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None) -> None:
    """Make ``optimizer``'s state and hyper-parameters ``root_rank``'s on every rank, in place.

    As Horovod: an optimizer with no state first steps once on zero gradients (see
    :func:`_fill_empty_state`); tensors of the state are broadcast in place, every other value (and
    each param group's options) in one pickled object. ``torch.optim.LBFGS`` is refused."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if not optimizer.state_dict()["state"]:
        _fill_empty_state(optimizer)
    state_dict = optimizer.state_dict()
    if not state_dict["state"]:
        return
    tensors: List[Any] = []
    scalars: Dict[str, Any] = {}
    setters: Dict[str, Callable[[Any], None]] = {}
    seen: Dict[str, int] = {}
    for index, group in enumerate(state_dict["param_groups"]):
        for key, value in group.items():
            if key != "params":
                scalars[f"{key}.{index}"] = value
                setters[f"{key}.{index}"] = _setter(optimizer.param_groups[index], key)
        for pid in group["params"]:
            for name, value in state_dict["state"].get(pid, {}).items():
                seen[name] = seen.get(name, 0) + 1
                label = f"{name}.{seen[name]}"
                if torch.is_tensor(value):
                    tensors.append((label, value))
                else:
                    scalars[label] = value
                    setters[label] = _setter(state_dict["state"][pid], name)
    broadcast_parameters(tensors, root_rank)
    for label, value in broadcast_object(scalars, root_rank).items():
        setters[label](value)


def _setter(target: Dict[str, Any], key: str) -> Callable[[Any], None]:
    def put(value: Any) -> None:
        target[key] = value
    return put


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """``root_rank``'s ``obj`` (pickled with cloudpickle) on every member of ``process_set``."""
    pickler = _pickler()
    if _ops._world.rank == root_rank:
        buffer = io.BytesIO()
        pickler.dump(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    broadcast_(length, root_rank, process_set=process_set)
    if _ops._world.rank != root_rank:
        payload = torch.zeros(int(length.item()), dtype=torch.uint8)
    broadcast_(payload, root_rank, process_set=process_set)
    if _ops._world.rank == root_rank:
        return obj
    return pickler.loads(payload.numpy().tobytes())


def allgather_object(obj: Any, name: Optional[str] = None) -> List[Any]:
    """Every rank's ``obj`` (pickled with cloudpickle), as a list in rank order."""
    pickler = _pickler()
    buffer = io.BytesIO()
    pickler.dump(obj, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    lengths = allgather(torch.tensor([payload.numel()], dtype=torch.int64)).tolist()
    data = allgather(payload).numpy().tobytes()
    out, start = [], 0
    for n in lengths:
        out.append(pickler.loads(data[start:start + n]))
        start += n
    return out
