"""Tensor parallelism behind ``prepare``: a plan of module-name patterns → styles, applied with torch's
``parallelize_module`` on a one-dimensional TP device mesh.

Two functions, both called by the core (``ud.init(tp=T, tp_plan=...)``) and usable on their own::

    plan = resolve_plan(model, tp_plan, tp=T)   # pure: no communication, no change to the model
    apply_tp_plan(model, plan, tp_mesh)         # shards in place, returns model

The plan format is Hugging Face's ``base_model_tp_plan``: ``{"blocks.*.w1": "colwise",
"blocks.*.w2": "rowwise"}``. A pattern is a dotted module name in which ``*`` stands for exactly one
dotted component (a ``ModuleList`` index or any single name); it must match whole module names.

Styles, mirroring what transformers 5.23 registers under the same names in
``transformers.distributed.tensor_parallel`` (its own classes, with torch's semantics), mapped to
torch's ``torch.distributed.tensor.parallel`` styles:

=========================  ==========================================  ===========================
style                      torch style                                 modules
=========================  ==========================================  ===========================
``colwise``                ``ColwiseParallel()``                       ``nn.Linear``, ``nn.Embedding``
``rowwise``                ``RowwiseParallel()`` (on an Embedding:     ``nn.Linear``, ``nn.Embedding``
                           ``input_layouts=Replicate()``)
``colwise_gather_output``  ``ColwiseParallel(output_layouts=           ``nn.Linear``
                           Replicate())``
``rowwise_split_input``    ``RowwiseParallel(input_layouts=            ``nn.Linear``
                           Replicate())``
``embedding_rowwise``      ``RowwiseParallel(input_layouts=            ``nn.Embedding``
                           Replicate())`` (vocabulary-parallel)
=========================  ==========================================  ===========================

All outputs are local tensors (``use_local_output=True``): a ``colwise`` output is this rank's slice
of the last dimension (so a Hugging Face attention module sees ``heads / T`` local heads), a
``rowwise`` output is the full, all-reduced result. Any other style raises
:class:`~unified_dist.errors.UnifiedDistError` naming the supported ones.

Contract after :func:`apply_tp_plan`:

- Every parameter of a planned module is a ``DTensor`` on ``tp_mesh`` (a colwise weight ``Shard(0)``,
  a rowwise weight ``Shard(1)``, an embedding_rowwise weight ``Shard(0)``; a rowwise bias
  ``Replicate()``), and so is its gradient. ``DTensor.full_tensor()`` gives the unsharded value.
- Every other parameter stays a plain tensor, replicated: each TP rank holds the same value and,
  after ``backward``, the same gradient, equal to the unsharded model's. **No extra all-reduce is
  needed for them**: the input hooks turn a replicated activation into a ``Replicate`` DTensor,
  whose backward all-reduces the partial input gradient of a colwise / rowwise_split_input layer,
  and a rowwise / embedding_rowwise output is all-reduced in forward, so every activation gradient
  reaching an unplanned parameter is already complete on every rank
  (``tests/launchers/workers/tp_worker.py`` checks it after 3 AdamW steps against a one-process model).
- Forward and backward compute the same values as the unsharded model (up to float rounding of
  the split sums). Every TP rank must be fed the same batch.
- An optimizer must be built from ``model.parameters()`` *after* :func:`apply_tp_plan`
  (the sharded parameters are new objects).

For the core: apply the TP plan *before* ``fully_shard`` on the data-parallel sub-mesh (torch's 2-D
recipe; both meshes must be slices of one 2-D mesh, ``mesh["tp"]`` and ``mesh["dp"]``), and build
the optimizer after both.
"""
from __future__ import annotations

import re
from typing import Dict, List, Mapping, Optional, Union

from torch import nn

from ..errors import UnifiedDistError

SUPPORTED_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise")
"""The style names a plan may use (see the module docstring for what each becomes)."""

# which module types each style shards (torch's ColwiseParallel / RowwiseParallel take nn.Linear and nn.Embedding)
_ACCEPTS = {
    "colwise": (nn.Linear, nn.Embedding),
    "rowwise": (nn.Linear, nn.Embedding),
    "colwise_gather_output": (nn.Linear,),
    "rowwise_split_input": (nn.Linear,),
    "embedding_rowwise": (nn.Embedding,),
}

# a Hugging Face attention projection: its output (colwise) or input (rowwise) is split by heads
_HEAD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value")

PlanArg = Union[None, str, Mapping[str, str]]


def _pattern_regex(pattern: str) -> "re.Pattern[str]":
    """``*`` is one dotted component; everything else is literal; the whole name must match."""
    return re.compile(r"[^.]+".join(re.escape(part) for part in pattern.split("*")) + r"\Z")


def _model_plan(model: nn.Module) -> Dict[str, str]:
    """The plan a Hugging Face model declares, built the way transformers 5.23 builds ``model.tp_plan``
    (``DistributedMixin.init_parallel_plans``): the class's ``_tp_plan`` (e.g. ``lm_head``), then for
    the base model its config's ``base_model_tp_plan`` (with ``embed_tokens: embedding_rowwise`` in
    front when the base model has an ``nn.Embedding`` ``embed_tokens`` and the plan is not empty),
    each child's plan prefixed with the child's name (``model.layers.*...`` under a ``*ForCausalLM``)."""
    plan: Dict[str, str] = dict(getattr(type(model), "_tp_plan", None) or {})
    base = getattr(model, "base_model", model) if getattr(model, "base_model_prefix", "") else model
    if base is model:
        config = getattr(model, "config", None)
        plan.update(getattr(config, "base_model_tp_plan", None) or {})
        if plan and isinstance(getattr(model, "embed_tokens", None), nn.Embedding):
            plan = {"embed_tokens": "embedding_rowwise", **plan}
    for name, child in model.named_children():
        if hasattr(child, "config") and hasattr(type(child), "base_model_prefix"):  # a PreTrainedModel child
            plan.update({f"{name}.{k}": v for k, v in _model_plan(child).items()})
    return plan


def _needs_plan(model: nn.Module, tp: Optional[int]) -> UnifiedDistError:
    size = tp if tp is not None else "T>1"
    return UnifiedDistError(f"tp={size} needs a plan: {type(model).__name__} declares no base_model_tp_plan; "
                            "pass ud.init(tp_plan={...}) (e.g. {'layers.*.fc1': 'colwise', 'layers.*.fc2': 'rowwise'})")


def resolve_plan(model: nn.Module, tp_plan: PlanArg, tp: Optional[int] = None) -> Dict[str, str]:
    """The concrete plan ``{module name: style}`` for ``model``, in ``model.named_modules()`` order.

    ``tp_plan``: ``"auto"`` (the model's own Hugging Face plan, see :func:`_model_plan`), a dict of
    patterns → styles, or ``None`` (an error unless ``tp == 1``, which gives ``{}``). Pure: reads the
    model, communicates nothing, changes nothing. Resolving an already resolved plan returns it.

    Raises :class:`UnifiedDistError` (one line) when: the model declares no plan under ``"auto"``
    (or ``None``); a style is not one of :data:`SUPPORTED_STYLES`; a pattern matches no module (the
    message names a few real ones); a matched module is not of a type its style shards; and, when
    ``tp`` is given, a sharded dimension (colwise: ``out_features`` / ``embedding_dim``; rowwise:
    ``in_features`` / ``num_embeddings``) or an attention module's ``num_attention_heads`` /
    ``num_key_value_heads`` is not divisible by ``tp``.
    """
    if tp_plan is None:
        if tp == 1:
            return {}
        raise _needs_plan(model, tp)
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise UnifiedDistError(f"tp_plan={tp_plan!r} is not a plan: pass 'auto' (the model's own "
                                   "base_model_tp_plan) or a dict {module pattern: style}")
        patterns = _model_plan(model)
        if not patterns:
            raise _needs_plan(model, tp)
    elif isinstance(tp_plan, Mapping):
        patterns = dict(tp_plan)
        if not patterns and tp != 1:
            raise _needs_plan(model, tp)
    else:
        raise UnifiedDistError(f"tp_plan must be None, 'auto' or a dict {{module pattern: style}}, "
                               f"not {type(tp_plan).__name__}")

    for pattern, style in patterns.items():
        if style not in SUPPORTED_STYLES:
            raise UnifiedDistError(f"tp_plan[{pattern!r}] = {style!r} is not a supported style; "
                                   f"supported: {', '.join(SUPPORTED_STYLES)}")

    modules = dict(model.named_modules())
    names = [name for name in modules if name]
    plan: Dict[str, str] = {}
    matched_by: Dict[str, str] = {}
    for pattern, style in patterns.items():
        regex = _pattern_regex(pattern)
        hits = [name for name in names if regex.match(name)]
        if not hits:
            raise UnifiedDistError(f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                                   f"its modules are named like {_examples(names)}")
        for name in hits:
            if name in plan and plan[name] != style:
                raise UnifiedDistError(f"module {name!r} is matched by tp_plan patterns {matched_by[name]!r} "
                                       f"({plan[name]}) and {pattern!r} ({style}); give it one style")
            module = modules[name]
            if not isinstance(module, _ACCEPTS[style]):
                kinds = " or ".join(f"nn.{cls.__name__}" for cls in _ACCEPTS[style])
                raise UnifiedDistError(f"tp_plan pattern {pattern!r} matches {name!r}, a {type(module).__name__}, "
                                       f"but {style!r} shards only {kinds}")
            plan[name] = style
            matched_by[name] = pattern

    ordered = {name: plan[name] for name in names if name in plan}
    if tp is not None:
        _check_divisible(model, modules, ordered, tp)
    return ordered


def _examples(names: List[str], limit: int = 6) -> str:
    leaves = [n for n in names if "." in n] or names
    picked = leaves[:limit]
    return ", ".join(picked) + (", ..." if len(leaves) > limit else "")


def _sharded_size(module: nn.Module, style: str):
    """``(what, size)`` of the dimension ``style`` splits across the TP ranks."""
    colwise = style in ("colwise", "colwise_gather_output")
    if isinstance(module, nn.Embedding):
        return ("embedding_dim", module.embedding_dim) if colwise else ("num_embeddings", module.num_embeddings)
    return ("out_features", module.out_features) if colwise else ("in_features", module.in_features)


def _check_divisible(model: nn.Module, modules: Mapping[str, nn.Module], plan: Mapping[str, str], tp: int) -> None:
    for name, style in plan.items():
        what, size = _sharded_size(modules[name], style)
        if size % tp:
            raise UnifiedDistError(f"tp={tp} cannot shard {name} ({style}): its {what}={size} is not divisible "
                                   f"by {tp}")
        parent_name, _, leaf = name.rpartition(".")
        # a head-split projection: the attention module reshapes its local output into heads
        if leaf in _HEAD_PROJECTIONS and style in ("colwise", "rowwise"):
            parent = modules.get(parent_name, model)
            config = getattr(parent, "config", None) or getattr(model, "config", None)
            if config is not None and hasattr(config, "get_text_config"):
                config = config.get_text_config()
            heads = getattr(config, "num_attention_heads", None)
            kv_heads = getattr(config, "num_key_value_heads", None) or heads
            for field, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
                if isinstance(value, int) and value % tp:
                    raise UnifiedDistError(f"tp={tp} cannot split the heads of {parent_name or name}: "
                                           f"{field}={value} is not divisible by {tp}")


def torch_style(style: str, module: nn.Module):
    """The ``torch.distributed.tensor.parallel`` style object that ``style`` becomes on ``module``."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "colwise_gather_output":
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise" and not isinstance(module, nn.Embedding):
        return RowwiseParallel()
    if style in ("rowwise", "embedding_rowwise", "rowwise_split_input"):
        # token ids (and a split-input Linear's input) are replicated on every rank
        return RowwiseParallel(input_layouts=Replicate())
    raise UnifiedDistError(f"{style!r} is not a supported style; supported: {', '.join(SUPPORTED_STYLES)}")


def apply_tp_plan(model: nn.Module, plan: Mapping[str, str], tp_mesh) -> nn.Module:
    """Shard ``model`` in place on the 1-D device mesh ``tp_mesh`` following ``plan`` and return it.

    ``plan`` is what :func:`resolve_plan` returned (patterns are accepted too: it is resolved again,
    with the divisibility checks for ``tp_mesh.size()``, before anything is changed, so an error
    leaves the model untouched). Every rank of ``tp_mesh`` must call it with the same plan. The
    contract of the result is in the module docstring.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    if tp_mesh.ndim != 1:
        raise UnifiedDistError(f"apply_tp_plan needs a 1-D TP mesh, got a {tp_mesh.ndim}-D one; pass mesh['tp']")
    concrete = resolve_plan(model, dict(plan), tp=tp_mesh.size())
    modules = dict(model.named_modules())
    tied = _tied_groups(model, concrete)
    for name, style in concrete.items():
        module = modules[name]
        parallelize_module(module, tp_mesh, torch_style(style, module))
    for owners in tied:  # parallelize_module gave each owner its own new Parameter: share the first again
        (_, first, first_attr), *rest = owners
        for _, module, attr in rest:
            setattr(module, attr, getattr(first, attr))
    return model


def _placement(style: str, module: nn.Module, attr: str) -> str:
    """How ``style`` lays out ``module``'s parameter ``attr`` (torch's styles): ``Shard(d)`` or ``Replicate()``."""
    if isinstance(module, nn.Embedding):
        return "Shard(1)" if style == "colwise" else "Shard(0)"
    if style in ("colwise", "colwise_gather_output"):
        return "Shard(0)"
    return "Replicate()" if attr == "bias" else "Shard(1)"


def _tied_groups(model: nn.Module, plan: Mapping[str, str]) -> List[List[tuple]]:
    """The groups ``[(module name, module, attribute), ...]`` that share one parameter (tied weights,
    e.g. ``lm_head.weight is embed_tokens.weight``) and touch the plan. Raises when sharing them is
    impossible: one owner planned and another not, or two owners laying the tensor out differently."""
    owners: Dict[int, Dict[tuple, tuple]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for attr, param in module.named_parameters(recurse=False):
            seen = owners.setdefault(id(param), {})
            # one module registered under two names is one owner: keep the name the plan uses
            if (id(module), attr) not in seen or name in plan:
                seen[(id(module), attr)] = (name, module, attr)
    groups = []
    for by_module in owners.values():
        group = list(by_module.values())
        names = {name for name, _, _ in group}
        if len(group) < 2 or not names & plan.keys():
            continue
        layouts = {(name, attr): _placement(plan[name], module, attr) if name in plan else "not sharded"
                   for name, module, attr in group}
        if len(set(layouts.values())) > 1:
            described = ", ".join(f"{name}.{attr} ({how})" for (name, attr), how in layouts.items())
            raise UnifiedDistError(f"tied parameter shared by {described}: give every module that shares it a style "
                                   "with the same layout, or untie it")
        groups.append(group)
    return groups
