"""Fully sharded data parallel behind ``prepare``: torch FSDP2 (``fully_shard``) on every
torch-style backend.

What ``sharding="fsdp"`` means (``ud.init(sharding=...)``, ``UNIFIED_DIST_SHARDING``,
``unified-dist launch --sharding``, or ``accelerate launch --use_fsdp --fsdp_version 2``):

- ``prepare(model)`` calls ``fully_shard`` on each repeated block (the classes named in a Hugging
  Face model's ``_no_split_modules``; otherwise the children of every ``nn.ModuleList``; or
  ``init(shard_modules=[...])``, classes or class names), then on the root. Parameters become
  DTensors sharded on dim 0 over all ranks; gradients are reduce-scattered and averaged.
- An optimizer built before ``prepare`` is pointed at the sharded parameters (FSDP2 replaces
  the parameter objects), so the usual ``model, optimizer = ud.prepare(model, optimizer)`` works.
- ``mixed_precision="bf16"`` (or fp16) becomes FSDP2's ``MixedPrecisionPolicy`` (parameters in
  the low precision for compute, gradients reduced in float32).
- ``model.load_state_dict`` and ``optimizer.load_state_dict`` accept the full, unsharded state
  that ``ud.save`` writes (each rank keeps its own shard of it), so checkpoints stay portable.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch

from ..errors import UnifiedDistError
from .mesh import Layout


@dataclass(frozen=True)
class Sharding:
    """How models are split: ``mode`` ``"no"`` or ``"fsdp"``; ``modules`` the block classes (or
    class names) to shard one by one, ``None`` for the default choice; ``reshard_after_forward``
    False keeps parameters gathered from forward to backward (ZeRO-2-like: more memory, one
    all-gather fewer per step); ``dp_replicate`` HSDP's replicas (an integer or ``"nodes"``);
    ``tp`` tensor-parallel ranks and ``tp_plan`` what they split (:mod:`unified_dist.parallel.tensor_parallel`);
    ``cpu_offload`` FSDP2's ``CPUOffloadPolicy``; ``activation_checkpointing`` recomputes each
    block's activations in backward; ``dp_shard`` the shard size a launcher declared (checked
    against the world, see :meth:`layout`); ``pp`` pipeline stages, ``pp_schedule``,
    ``pp_microbatches`` (``None``: one per stage) and ``pp_split`` (the units that begin stages
    1..pp-1, ``None``: the default split) how they run (:mod:`unified_dist.parallel.pipeline`)."""

    mode: str = "no"
    modules: Optional[Tuple[Any, ...]] = None
    reshard_after_forward: bool = True
    dp_replicate: Any = 1
    tp: int = 1
    tp_plan: Any = None
    cpu_offload: bool = False
    activation_checkpointing: bool = False
    dp_shard: Optional[int] = None
    pp: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: Optional[int] = None
    pp_split: Optional[Tuple[str, ...]] = None

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline step: ``pp_microbatches``, else one per stage."""
        return self.pp_microbatches if self.pp_microbatches is not None else self.pp

    @property
    def enabled(self) -> bool:
        """``fully_shard`` runs (FSDP2 or HSDP)."""
        return self.mode == "fsdp"

    @property
    def splits_model(self) -> bool:
        """``prepare`` splits models over a device mesh: FSDP2/HSDP, tensor or pipeline parallelism."""
        return self.enabled or self.tp > 1 or self.pp > 1

    def layout(self, world: int, machines: Optional[Callable[[], int]] = None) -> Layout:
        """The :class:`~unified_dist.parallel.mesh.Layout` these choices give ``world`` ranks (a
        one-line ``LaunchError`` when they do not fit it); ``machines()`` counts machines for
        ``dp_replicate="nodes"``."""
        return Layout.plan(world, self.dp_replicate, self.tp, self.dp_shard, machines, pp=self.pp)

    def problem(self) -> Optional[str]:
        """Why these choices cannot run together (one line with the fix), or ``None``."""
        if not self.enabled:
            for name, value, off in (("dp_replicate", self.dp_replicate, 1), ("cpu_offload", self.cpu_offload, False),
                                     ("activation_checkpointing", self.activation_checkpointing, False)):
                if value != off:
                    deepspeed = ("; under the deepspeed backend, offload_optimizer='cpu' (and offload_param='cpu' at "
                                 "ZeRO-3)") if name == "cpu_offload" else ""
                    return (f"{name}={value!r} applies to the blocks FSDP2 shards; add sharding='fsdp' "
                            f"(UNIFIED_DIST_SHARDING=fsdp, accelerate launch --use_fsdp --fsdp_version 2){deepspeed}")
        return None

    def field(self, name: str) -> Any:
        """The value of ``init`` keyword ``name`` (``sharding``, ``shard_modules`` or a field)."""
        return {"sharding": self.mode, "shard_modules": self.modules}.get(name, getattr(self, name, None))


KEYWORDS = ("sharding", "shard_modules", "reshard_after_forward", "dp_replicate", "tp", "tp_plan", "cpu_offload",
            "activation_checkpointing", "pp", "pp_schedule", "pp_microbatches", "pp_split")
"""The ``init`` keywords :class:`Sharding` holds together."""


def _matches(module: torch.nn.Module, wanted: Iterable[Any]) -> bool:
    return any(type(module).__name__ == w if isinstance(w, str) else isinstance(module, w) for w in wanted)


def blocks_to_shard(model: torch.nn.Module, modules: Optional[Sequence[Any]] = None) -> List[torch.nn.Module]:
    """The sub-modules to shard one by one, innermost first (FSDP2 shards children before parents).

    ``modules`` (classes or class names) if given, else the classes a Hugging Face model names in
    ``_no_split_modules``, else the children of every ``nn.ModuleList`` (but ``nn.Identity``: what a
    pipeline stage holds in place of another stage's layers). Raises when ``modules``
    matches nothing (a typo would otherwise shard the whole model as one block).
    """
    wanted = list(modules) if modules else list(getattr(model, "_no_split_modules", None) or [])
    if wanted:
        blocks = [m for m in model.modules() if m is not model and _matches(m, wanted)]
        if modules and not blocks:
            raise UnifiedDistError(f"shard_modules={list(modules)!r} matches no sub-module of "
                                   f"{type(model).__name__}; name classes that the model contains")
    else:
        blocks = [child for m in model.modules() if isinstance(m, torch.nn.ModuleList) for child in m
                  if not isinstance(child, torch.nn.Identity)]  # a pipeline stage's stand-ins: nothing to shard
    return list(reversed(blocks))


def _offload_policy(cpu_offload: bool) -> Any:
    """FSDP2's offload policy: ``CPUOffloadPolicy`` with pinned memory only where an accelerator
    exists (pinning needs one: without, torch fails "Cannot access accelerator device")."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload else OffloadPolicy()


def checkpoint_activations(blocks: Sequence[torch.nn.Module]) -> None:
    """Recompute each block's activations in backward instead of keeping them (torch's composable
    ``checkpoint``, non-reentrant: module names, hence state-dict keys, stay as they were)."""
    from torch.distributed._composable import checkpoint

    for block in blocks:
        checkpoint(block)


def shard_model(model: torch.nn.Module, sharding: Sharding, precision: Any = None,
                dp_mesh: Any = None, tp_mesh: Any = None, tp_plan: Optional[Dict[str, str]] = None) -> torch.nn.Module:
    """Split ``model`` (already on its device) as ``sharding`` says, in the order that composes:
    tensor parallelism on ``tp_mesh`` (when ``sharding.tp > 1``), activation checkpointing of the
    blocks, then ``fully_shard`` of the blocks and the root on ``dp_mesh`` (when
    ``sharding.enabled``; 2-D for HSDP), with ``precision.fsdp_policy()`` (a
    :class:`~unified_dist.backends.precision.Precision`, given by the backend; ``None``: float32).

    ``tp_plan``: the plan already resolved for this model (a pipeline stage's share of the whole model's, which
    may be empty: a stage with no planned layer); ``None``: ``sharding.tp_plan`` is resolved here.

    Returns the same module object (FSDP2 changes its class in place). Afterwards its
    ``load_state_dict`` also takes full, unsharded tensors.
    """
    if sharding.tp > 1 and tp_plan != {}:
        from .tensor_parallel import apply_tp_plan, resolve_plan

        apply_tp_plan(model, tp_plan if tp_plan is not None else resolve_plan(model, sharding.tp_plan), tp_mesh)
    blocks = blocks_to_shard(model, sharding.modules)
    if sharding.activation_checkpointing:
        checkpoint_activations(blocks)
    if sharding.enabled:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = precision.fsdp_policy() if precision is not None else MixedPrecisionPolicy()
        options = dict(mesh=dp_mesh, mp_policy=policy,
                       reshard_after_forward=sharding.reshard_after_forward,
                       offload_policy=_offload_policy(sharding.cpu_offload))
        for block in blocks:
            fully_shard(block, **options)
        fully_shard(model, **options)
    model.register_load_state_dict_pre_hook(_shard_incoming_model_state)
    return model


def is_sharded(model: Any) -> bool:
    """Whether ``model`` was sharded by FSDP2."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def _as_shard_of(value: Any, like: Any) -> Any:
    """``value`` (a full tensor) laid out as DTensor ``like``, from this rank's own copy (no
    communication); anything else unchanged."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor) or not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    if tuple(value.shape) != tuple(like.shape):
        return value  # let load_state_dict report the size mismatch in its own words
    local = value.detach().to(device=like.device, dtype=like.dtype)
    return distribute_tensor(local, like.device_mesh, like.placements, src_data_rank=None)


def _shard_incoming_model_state(module: torch.nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    current = module.state_dict()
    for key, like in current.items():
        if prefix + key in state_dict:
            state_dict[prefix + key] = _as_shard_of(state_dict[prefix + key], like)


def point_optimizer_at(optimizer: torch.optim.Optimizer,
                       new_of: Callable[[torch.nn.Parameter], torch.nn.Parameter]) -> torch.optim.Optimizer:
    """Replace each parameter in ``optimizer``'s groups by ``new_of(parameter)`` (FSDP2's DTensor
    parameter for one it replaced, else itself), and let ``load_state_dict`` take full state.

    A group that then mixes DTensor and plain parameters (tensor parallelism without FSDP: the
    unplanned modules stay plain) cannot take torch's ``foreach`` kernels, which CUDA picks by
    default and which refuse the mix at the first ``step``: such a group with ``foreach`` unset gets
    ``foreach=False`` (the same update, one tensor at a time); one with ``foreach=True`` is refused here.
    """
    for index, group in enumerate(optimizer.param_groups):
        group["params"] = [new_of(p) for p in group["params"]]
        _no_foreach_over_mixed(group, index)
    if not getattr(optimizer, "_unified_dist_shard_hook", False):
        optimizer.register_load_state_dict_pre_hook(_shard_incoming_optimizer_state)
        # a loaded state brings its groups' foreach back (None, from a layout without the mix): settle it again
        optimizer.register_load_state_dict_post_hook(_no_foreach_after_load)
        optimizer._unified_dist_shard_hook = True
    return optimizer


def _no_foreach_after_load(optimizer: torch.optim.Optimizer) -> None:
    for index, group in enumerate(optimizer.param_groups):
        _no_foreach_over_mixed(group, index)


def _no_foreach_over_mixed(group: dict, index: int) -> None:
    from torch.distributed.tensor import DTensor

    kinds = {isinstance(p, DTensor) for p in group["params"]}
    if len(kinds) < 2 or group.get("fused"):
        return
    if group.get("foreach"):
        raise UnifiedDistError(
            f"optimizer param group {index} has foreach=True, but tensor parallelism left it both DTensor and "
            "plain parameters, which torch's foreach kernels cannot take together; pass foreach=False or leave "
            "it unset")
    group["foreach"] = False


def _shard_incoming_optimizer_state(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved_ids = [i for group in state_dict.get("param_groups", []) for i in group["params"]]
    by_saved_id = dict(zip(saved_ids, params))
    state = {}
    for key, entry in state_dict.get("state", {}).items():
        param = by_saved_id.get(key)
        state[key] = ({name: _as_shard_of(v, param) for name, v in entry.items()}
                      if param is not None and isinstance(entry, dict) else entry)
    return {**state_dict, "state": state}


def clip_grad_norm(parameters: Sequence[torch.Tensor], max_norm: float, norm_type: float,
                   across: Any = None) -> torch.Tensor:
    """torch's ``clip_grad_norm_`` over gradients that may be DTensors on different meshes (FSDP
    × TP: tensor-parallel layers on the 2-D mesh, the rest on the data-parallel one), where torch's
    own would try to stack norms of different meshes. Returns the total norm, a plain tensor:
    each group of gradients on one mesh and placement gives its norm (a collective inside that
    group), combined as the ``norm_type``-norm of the group norms. ``across``: a process group whose
    ranks hold other parameters of the same model (pipeline stages): the norm is the whole model's,
    combined over it (a collective: every rank of it calls this)."""
    from torch.distributed.tensor import DTensor

    with_grad = [p for p in parameters if p.grad is not None]
    if across is None and not any(isinstance(p.grad, DTensor) for p in with_grad):
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type)
    groups: dict = {}
    for p in with_grad:
        key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
        groups.setdefault(key, []).append(p)
    norms = [full_tensor(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type))
             for group in groups.values()]
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type) if norms \
        else torch.zeros((), device=parameters[0].device if parameters else None)
    if across is not None:
        total = _norm_across(total.float() if total.dtype in (torch.float16, torch.bfloat16) else total,
                             norm_type, across)
    for group in groups.values():  # one mesh per call: torch's foreach kernels take one at a time
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _norm_across(norm: torch.Tensor, norm_type: float, group: Any) -> torch.Tensor:
    """The ``norm_type``-norm of the ranks' norms in ``group``: the max for ``inf``, else ``(sum n**p)**(1/p)``."""
    import torch.distributed as dist

    p = float(norm_type)
    if p == float("inf"):
        norm = norm.clone()
        dist.all_reduce(norm, op=dist.ReduceOp.MAX, group=group)
        return norm
    powered = norm ** p
    dist.all_reduce(powered, group=group)
    return powered ** (1.0 / p)


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank must call it in the same order);
    any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


@contextlib.contextmanager
def no_gradient_sync(model: Any) -> Iterator[None]:
    """Backward passes inside accumulate unsharded gradients locally: no reduce-scatter until the
    first backward after the block (FSDP2's ``set_requires_gradient_sync``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
