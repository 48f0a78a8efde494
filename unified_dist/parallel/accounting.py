"""What one rank holds and sends: bytes of parameters, gradients and optimizer state as the rank
stores them, bytes a forward saves for backward, and the bytes of each collective it calls.

Used by the memory benchmark (bench/memory_layouts/memory_layouts_worker.py, on real ranks) and by
``unified-dist plan`` (:mod:`unified_dist.checks.plan_worker`, on one simulated rank whose tensors are
torch's fake tensors: shapes, dtypes and storages without data). Every count here reads only
shapes, dtypes and storage identities, so it gives the same number on a real tensor and on its fake
twin. A storage is identified by its C++ object (``untyped_storage()._cdata``), not its data pointer:
fake and meta storages have no data pointer.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..errors import SettingError


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``t``: a DTensor's local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def storage_key(t: torch.Tensor) -> tuple:
    """An identity of ``t``'s storage, the same for every view of it while it lives."""
    storage = t.untyped_storage()
    return (t.device.type, storage._cdata, storage.nbytes())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` as this rank holds them: each local tensor's ``numel * element_size``;
    the same tensor twice (a tied weight's gradient) once. Views into one flat buffer (DDP's
    gradient buckets, FSDP2's reduce-scatter output) are different tensors and each counts."""
    seen, total = set(), 0
    for t in tensors:
        local = local_tensor(t)
        key = (storage_key(local), local.storage_offset(), local.numel(), local.dtype)
        if local.numel() and key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def rank_bytes(models: Sequence[torch.nn.Module], optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, int]:
    """This rank's bytes of the parameters and gradients of ``models`` (one module or several) and of
    ``optimizer``'s state (every tensor in ``optimizer.state``: AdamW's exp_avg, exp_avg_sq and step)."""
    models = [models] if isinstance(models, torch.nn.Module) else list(models)
    params = [p for m in models for p in m.parameters()]
    grads = [p.grad for p in params if p.grad is not None]
    state = [] if optimizer is None else [v for entry in optimizer.state.values() for v in entry.values()
                                          if isinstance(v, torch.Tensor)]
    out = {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(state)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def zero_rank_bytes(module_params: Sequence[Tuple[int, int]], groups: Sequence[Sequence[Tuple[int, int, list]]],
                    stage: int, world: int) -> Dict[str, int]:
    """The bytes one rank of ``world`` holds under DeepSpeed 0.19.8's ZeRO ``stage`` (0-3), float32 training, no
    offload, from the unsharded model: ``module_params`` is ``(numel, element_size)`` of each module parameter,
    ``groups`` the optimizer's parameter groups, each a list of ``(numel, element_size, state)`` per trainable
    parameter, ``state`` the ``(numel, element_size, shaped_like_the_parameter)`` of each tensor an unsharded
    optimizer keeps for it (AdamW: exp_avg and exp_avg_sq, shaped like it; step, a scalar). Pure. What DeepSpeed
    does, and so what is counted:

    - stage 0: the user's optimizer steps the module's parameters: everything whole, as under DDP;
    - stages 1-2: each group's trainable parameters are flattened and padded to a multiple of ``2 x world``
      elements (``nccl_start_alignment_factor``); each rank owns ``padded / world`` of them, and keeps a float32
      copy of its part (``master``), the float32 gradient of its part that the update reads (``grads``) and the
      optimizer's state over it: a state tensor shaped like its parameter becomes one of the part's size, any
      other (AdamW's ``step``) one per group. The module's parameters stay whole (``params``);
    - stage 3: each parameter is partitioned on its own, ``ceil(numel / world)`` elements per rank (padded), the
      module's parameters included; a group's parts form one flat tensor that the optimizer steps in place (no
      copy: ``master`` 0), with its gradient and state as above.

    Not counted: stage 1's whole gradients between backward and their reduction at the accumulation boundary,
    the reduce and all-gather buckets, the padding of stages 1-2's flat parameter buffer (the parameters are
    counted as the module sees them), stage 3's gathered parameters during forward and backward, and one ``step``
    per sub-group where a group's part exceeds DeepSpeed's ``sub_group_size`` (1e9 elements)."""
    if stage not in (0, 1, 2, 3) or world < 1:
        raise SettingError(f"ZeRO stage must be 0-3 and the world at least 1 rank, got stage {stage}, world {world}")
    if stage == 0:
        params = sum(n * size for n, size in module_params)
        trainable = [p for group in groups for p in group]
        out = {"params": params, "master": 0, "grads": sum(n * size for n, size, _ in trainable),
               "optimizer": sum(n * size for _, _, state in trainable for n, size, _ in state)}
    else:
        def part(numel: int) -> int:  # stage 3: one parameter's elements on this rank
            return -(-numel // world)

        out = {"params": sum((part(n) if stage == 3 else n) * size for n, size in module_params),
               "master": 0, "grads": 0, "optimizer": 0}
        for group in groups:
            if not group:
                continue
            if stage == 3:
                flat = sum(part(n) for n, _, _ in group)
            else:
                align = 2 * world
                flat = -(-sum(n for n, _, _ in group) // align) * align // world
                out["master"] += 4 * flat
            out["grads"] += 4 * flat
            state = next((state for _, _, state in group if state), [])  # the flat part's: as any one parameter's
            out["optimizer"] += sum(flat * size if like else n * size for n, size, like in state)
    out["total"] = out["params"] + out["master"] + out["grads"] + out["optimizer"]
    return out

def _plain_tensors(t: torch.Tensor) -> list:
    """The plain tensors holding ``t``'s data on this rank: a DTensor's local shard, the inner
    tensors of any other wrapper subclass (e.g. the ``AsyncCollectiveTensor`` a tensor-parallel
    row-wise layer returns, which has no storage of its own), else ``t``. No autograd node is
    recorded (it runs inside a pack hook). A fake tensor is a plain tensor here."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(t, DTensor):
            return _plain_tensors(t.to_local())
    plain = (torch.Tensor, torch.nn.Parameter)
    if type(t) not in plain and not isinstance(t, FakeTensor) and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [p for name in names for p in _plain_tensors(getattr(t, name))]
    return [t]


class SavedBytes:
    """Bytes that a forward keeps for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``:
    the storage each saved tensor keeps alive (its local shard's, for a DTensor), each storage once
    (``x`` and ``x.t()`` saved by two operations are one); parameters (their storage, sharded or
    gathered) excluded, they are counted as parameters;
    plus the inputs of each block in ``watched_blocks``: a checkpointed block holds them (in its recompute
    closure, which no saved-tensor hook sees) to run its forward again in backward, and a
    checkpointed block's own saved tensors go to the checkpoint's hooks, not these. Pass only checkpointed
    blocks: a plain block holds its input only where its first operation saves it (a Linear does, a tanh
    saves its output instead), which the hooks see. ``twins(p)`` gives tensors that stand for parameter
    ``p`` in the forward (under a fake mode, the fake copy of a real parameter); they are parameters too."""

    def __init__(self, model: torch.nn.Module, watched_blocks=(), twins=None):
        self.model = model
        self.blocks = list(watched_blocks)
        self.twins = twins or (lambda p: [])  # other tensors that stand for parameter p (a fake copy of it)
        self.seen: set = set()
        self.sizes: dict = {}  # each counted storage's bytes, by storage_key
        self.bytes = 0
        self.count = 0
        self._handles: list = []
        self._hooks: Any = None

    def _param_keys(self):
        return {storage_key(t) for p in self.model.parameters() for alias in (p, *self.twins(p))
                for t in _plain_tensors(alias)}

    def _add(self, t: torch.Tensor, params=None) -> None:
        if not isinstance(t, torch.Tensor):
            return
        for local in _plain_tensors(t):
            if local.untyped_storage().nbytes() == 0:
                continue
            key = storage_key(local)
            if key in self.seen or key in (params if params is not None else self._param_keys()):
                continue
            self.seen.add(key)
            self.sizes[key] = local.untyped_storage().nbytes()
            self.bytes += self.sizes[key]
            self.count += 1

    def _pack(self, t):
        self._add(t)
        return t

    def _block_inputs(self, module, args, kwargs):
        params = self._param_keys()
        for value in [*args, *kwargs.values()]:
            for t in (value if isinstance(value, (tuple, list)) else (value,)):
                self._add(t, params)

    def __enter__(self):
        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._block_inputs, with_kwargs=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False


# ------------------------------------------------------------------------------------------ collectives
KINDS = {  # op name -> (kind, index of the argument whose bytes count, index of a factor argument or None)
    # c10d's in-place ops (torch.distributed's functions, FSDP2): outputs come first
    "_allgather_base_": ("all_gather", 0, None), "allgather_": ("all_gather", 0, None),
    "allgather_into_tensor_coalesced_": ("all_gather", 0, None),
    "_reduce_scatter_base_": ("reduce_scatter", 1, None), "reduce_scatter_": ("reduce_scatter", 1, None),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, None),
    "allreduce_": ("all_reduce", 0, None), "allreduce_coalesced_": ("all_reduce", 0, None),
    "broadcast_": ("broadcast", 0, None), "scatter_": ("scatter", 0, None), "alltoall_base_": ("all_to_all", 1, None),
    # the functional ops (DTensor, tensor parallelism): the input first, a gather's group size after it
    "all_gather_into_tensor": ("all_gather", 0, 1), "all_gather_into_tensor_coalesced": ("all_gather", 0, 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0, None),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, None),
    "all_reduce": ("all_reduce", 0, None), "all_reduce_coalesced": ("all_reduce", 0, None),
    "broadcast": ("broadcast", 0, None), "all_to_all_single": ("all_to_all", 0, None),
}
"""Each collective op's kind and what its size is: an all-gather's full output, a reduce-scatter's
full input, an all-reduce's (or broadcast's) tensor."""


def _tensors(value: Any) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _group_name(args: Sequence[Any]) -> Optional[str]:
    """The process group's name among a collective op's arguments (its last string, or a boxed group)."""
    import torch.distributed as dist

    names = [arg for arg in args if isinstance(arg, str)]
    if names:  # a functional op: (tensor, [reduce op,] [group size,] group name)
        return names[-1]
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                return dist.ProcessGroup.unbox(arg).group_name
            except (RuntimeError, AttributeError):
                return None
    return None


def group_labels(mesh: Any = None) -> Dict[str, str]:
    """Process-group name -> the ``mesh`` dimension it serves, and the default group's -> ``"world"``; a
    group that serves several (a ``dp_shard`` that spans the world) is named by all: ``dp_shard=world``."""
    import torch.distributed as dist

    labels: Dict[str, str] = {}
    named = [(dim, mesh.get_group(dim)) for dim in mesh.mesh_dim_names] if mesh is not None else []
    for dim, group in [*named, ("world", dist.group.WORLD)]:
        labels[group.group_name] = f"{labels[group.group_name]}={dim}" if group.group_name in labels else dim
    return labels


class CollectiveCounter(TorchDispatchMode):
    """Counts the collectives this process calls while active, by kind and process group: calls and
    bytes (the size of the message as :data:`KINDS` says). ``groups`` names process groups
    (``group_name`` -> a label such as ``"dp_shard"``); others are labelled by their name.
    :meth:`reset` forgets what was counted."""

    def __init__(self, groups: Optional[Mapping[str, str]] = None):
        super().__init__()
        self.groups = dict(groups or {})
        self.counts: Dict[tuple, Dict[str, int]] = {}

    def reset(self) -> None:
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            self._count(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args, kwargs) -> None:
        found = KINDS.get(func._opname)
        if found is None:
            return
        kind, index, factor = found
        size = sum(t.numel() * t.element_size() for t in _tensors(args[index]))
        if factor is not None:
            size *= int(args[factor])
        group = _group_name([*args, *kwargs.values()])
        self.add(kind, self.groups.get(group, group or "?"), size)

    def add(self, kind: str, group: str, size: int, calls: Optional[int] = 1) -> None:
        """Count ``calls`` collectives of ``kind`` over ``group`` moving ``size`` bytes in all; ``calls=None``:
        bytes known without the calls (marked ``derived`` in :meth:`table`)."""
        entry = self.counts.setdefault((kind, group), {"calls": 0, "bytes": 0})
        if calls is None:
            entry["derived"] = True
        entry["calls"] = None if calls is None or entry["calls"] is None else entry["calls"] + calls
        entry["bytes"] += size

    def table(self) -> list:
        """``[{"kind", "group", "calls", "bytes"}]``, sorted by kind then group."""
        return [{"kind": kind, "group": group, **entry} for (kind, group), entry in sorted(self.counts.items())]


__all__ = ["CollectiveCounter", "KINDS", "SavedBytes", "group_labels", "local_tensor", "rank_bytes", "storage_key",
           "tensor_bytes", "zero_rank_bytes"]
