"""Pipeline parallelism: each rank holds one stage of the model, and a schedule of
``torch.distributed.pipelining`` runs forward and backward of several microbatches together.

What ``pp=P`` means (``ud.init(pp=...)``, ``UNIFIED_DIST_PP``, ``unified-dist launch --pp``):

- The mesh gains an outermost ``"pp"`` dimension (:mod:`unified_dist.parallel.mesh`): rank ``r`` holds
  stage ``r // (world / P)``; inside a stage the ranks are laid out as without ``pp`` (FSDP2 shards,
  HSDP replicas, ``tp``), and rank ``r`` of every stage is given the same batches by a prepared loader.
- ``ud.prepare(model)`` keeps only this rank's stage of ``model``, in place: the *units* of the model
  (its children in registration order, each ``nn.ModuleList``/``nn.ModuleDict``/``nn.Sequential``
  child expanded into its items, and the modules on the way to a stack nested deeper, such as
  transformers' ``bert.encoder.layer``, opened into their children) are cut into ``P`` runs, and every
  unit another stage owns is replaced by :class:`OtherStage` (an ``nn.Identity`` that returns its first
  argument whatever else it is given). Parameters keep their fully-qualified names (``layers.3.w``), so state
  dicts are keyed as in the whole model. The split points are ``pp_split`` (the names of the units
  that begin stages 1..P-1, e.g. ``["layers.2"]``), by default the layers of the model's largest
  ``ModuleList`` at any depth cut evenly (units before them join the first stage, units after them the
  last).
  The model's own ``forward`` then runs on each stage, so it must apply its units one after the
  other, each to the previous one's output (embeddings, blocks, head): an ``Identity`` stands for a
  unit another stage ran. A forward that does anything else with the activation (an operation
  between units) is refused at the first forward of each schedule (:class:`UnitChain`). A model with
  parameters or buffers on its root, too few layers, an unknown or out-of-order split point, or a
  parameter shared between two stages is refused in one line.
- The training step differs in one explicit place: ``loss = ud.pipeline_step(model, inputs, targets,
  loss_fn)`` runs the schedule (forward and backward of ``pp_microbatches`` microbatches) and returns
  the mean of ``loss_fn(output, target)`` over the microbatches, detached, on every stage (the last
  stage computes it; one scalar broadcast over the pipeline). ``loss_fn`` must average over its
  microbatch: the schedule divides the gradients by the number of microbatches, so the step applies
  the gradient of the mean loss over the batch, as one process would. ``inputs`` may be a mapping,
  given by keyword to every stage (an attention mask). Each batch shape gets a schedule of its own (a
  schedule fixes the shapes it sends), built by a stage's ranks together. ``ud.pipeline_forward`` runs
  the forward passes alone, for evaluation (the output on the last stage, an empty tensor elsewhere).
  ``model(batch)`` of a pipelined model is refused (a stage alone would compute something else).
- Schedules by name (``pp_schedule``): ``gpipe`` (every forward, then every backward) and ``1f1b``
  (one forward, one backward; fewer activations held). Interleaved and zero-bubble schedules
  (several stages per rank) are refused: they have hung on gloo, and unified_dist builds one stage
  per rank. Microbatches (``pp_microbatches``, default the number of stages) below the number of
  stages are refused (1F1B hangs there), and so is a batch they do not divide.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from ..errors import PipelineError
from .sharding import full_tensor

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}
"""The schedules unified_dist runs, by the name ``pp_schedule`` takes, to their torch class."""
MULTI_STAGE_SCHEDULES = ("interleaved1f1b", "loopedbfs", "interleavedzerobubble", "zbvzerobubble", "dualpipev")
"""torch's schedules with several stages per rank: named so that the refusal can say why."""
CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


def settings_problem(pp: int, schedule: str, microbatches: Optional[int], dp_replicate: Any,
                     accumulation: int = 1, compile_backend: Optional[str] = None) -> Optional[str]:
    """Why these pipeline settings cannot run (one line with the fix), or ``None``."""
    if pp == 1:
        return None
    if compile_backend:
        return f"compile={compile_backend!r} with pp={pp} is not supported yet (the stages run uncompiled); drop one"
    if accumulation > 1:
        return (f"gradient_accumulation_steps={accumulation} with pp={pp}: the pipeline's microbatches already "
                "accumulate within a step; raise pp_microbatches (and the batch) instead")
    if schedule in MULTI_STAGE_SCHEDULES:
        return (f"pp_schedule={schedule!r} runs several stages per rank, which unified_dist does not build, and "
                "such schedules have hung on gloo (non-NCCL backends); use pp_schedule='gpipe' or '1f1b'")
    if microbatches is not None and microbatches < pp:
        return (f"pp_microbatches={microbatches} is fewer than the pp={pp} stages (1F1B hangs there and GPipe "
                f"leaves a stage idle); use pp_microbatches >= {pp}")
    if dp_replicate == "nodes":
        return "dp_replicate='nodes' with pp > 1 is not supported; give dp_replicate as a number"
    return None


# ---------------------------------------------------------------------- the split
def split_names(value: Any) -> Optional[Tuple[str, ...]]:
    """``pp_split`` as a tuple of unit names: a list of names, or one string of names separated by commas."""
    if not value:
        return None
    names = value.split(",") if isinstance(value, str) else list(value)
    return tuple(str(name).strip() for name in names)


def _stack_name(model: torch.nn.Module) -> Optional[str]:
    """The name of the model's largest ``nn.ModuleList`` at any depth but not inside another one (the first
    of the largest, in registration order): its stack of layers; ``None`` when it has none."""
    lists: List[Tuple[str, torch.nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name and \
                not any(name.startswith(outer + ".") for outer, _ in lists):
            lists.append((name, module))
    return max(lists, key=lambda item: len(item[1]))[0] if lists else None


def _expanded_path(model: torch.nn.Module) -> List[str]:
    """The modules between the root and its stack (``bert``, ``bert.encoder`` for ``bert.encoder.layer``),
    which :func:`units` opens into their children."""
    stack = _stack_name(model)
    if stack is None or isinstance(model, CONTAINERS):
        return []
    parts = stack.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def units(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module]]:
    """The model's units in order, by fully-qualified name: its children in registration order,
    a ``ModuleList``/``ModuleDict``/``Sequential`` child expanded into its items (the root itself
    when it is a ``Sequential``), and the modules on the way to a stack of layers nested deeper
    (``bert.encoder.layer``) opened into their children, so that the stack's layers are units
    (``bert.embeddings``, ``bert.encoder.layer.0``, ..., ``bert.pooler``, ``classifier``)."""
    if isinstance(model, CONTAINERS):
        return [(name, child) for name, child in model.named_children()]
    path = set(_expanded_path(model))

    def walk(module: torch.nn.Module, prefix: str) -> List[Tuple[str, torch.nn.Module]]:
        out: List[Tuple[str, torch.nn.Module]] = []
        for name, child in module.named_children():
            if isinstance(child, CONTAINERS):
                out += [(f"{prefix}{name}.{item}", grandchild) for item, grandchild in child.named_children()]
            elif prefix + name in path:
                out += walk(child, f"{prefix}{name}.")
            else:
                out.append((prefix + name, child))
        return out
    return walk(model, "")


def default_split(model: torch.nn.Module, stages: int) -> List[str]:
    """The names of the units that begin stages ``1..stages-1``: the layers of the model's largest
    ``ModuleList`` (at any depth, see :func:`units`; or of a ``Sequential`` root) cut evenly, the first
    stages taking one layer more when they do not divide."""
    if isinstance(model, CONTAINERS):
        prefix, layers = "", [name for name, _ in model.named_children()]
    else:
        name = _stack_name(model)
        if name is None:
            raise PipelineError(
                f"pp={stages} cannot split {type(model).__name__}: it has no nn.ModuleList of layers (nor is it an "
                "nn.Sequential); pass pp_split=[names of the units that begin each stage after the first]")
        prefix, layers = f"{name}.", [item for item, _ in model.get_submodule(name).named_children()]
    if len(layers) < stages:
        raise PipelineError(
            f"pp={stages} cannot split {type(model).__name__}: its stack has {len(layers)} layers, fewer than the "
            "stages; use fewer stages or pass pp_split")
    per, extra = divmod(len(layers), stages)
    starts, at = [], 0
    for stage in range(stages - 1):
        at += per + (1 if stage < extra else 0)
        starts.append(prefix + layers[at])
    return starts


def stage_units(model: torch.nn.Module, stages: int, split: Optional[Sequence[str]] = None) -> List[List[str]]:
    """The unit names of each stage, in order (see the module docstring). Raises :class:`PipelineError`
    in one line for a model or split that cannot be cut into ``stages`` stages."""
    for path in ["", *_expanded_path(model)]:
        module = model.get_submodule(path)
        held = [name for name, _ in module.named_parameters(recurse=False)] + \
               [name for name, _ in module.named_buffers(recurse=False)]
        if held:
            where = f"its {path} holds" if path else "its root holds"
            raise PipelineError(
                f"pp={stages} cannot split {type(model).__name__}: {where} {', '.join(held)} directly, which no "
                "single stage owns; move them into a sub-module")
    starts = list(split) if split else default_split(model, stages)
    names = [name for name, _ in units(model)]
    if len(starts) != stages - 1:
        raise PipelineError(f"pp_split={starts!r} names {len(starts)} split points; pp={stages} stages need "
                            f"{stages - 1} (the unit that begins each stage after the first)")
    unknown = [s for s in starts if s not in names]
    if unknown:
        raise PipelineError(f"pp_split names {unknown!r}, which are not units of {type(model).__name__}; "
                            f"its units are {', '.join(names)}")
    at = [names.index(s) for s in starts]
    if at != sorted(set(at)) or at[0] == 0:
        raise PipelineError(f"pp_split={starts!r} must name units in the model's order, after its first unit "
                            f"({names[0]}), each once, so that every stage holds at least one unit")
    bounds = [0, *at, len(names)]
    return [names[bounds[i]:bounds[i + 1]] for i in range(stages)]


def _owner_of_each_parameter(model: torch.nn.Module, plan: List[List[str]]) -> Dict[int, int]:
    modules = dict(units(model))
    owner: Dict[int, int] = {}
    for stage, names in enumerate(plan):
        for name in names:
            for pname, p in modules[name].named_parameters():
                if owner.setdefault(id(p), stage) != stage:
                    raise PipelineError(
                        f"parameter {name}.{pname} is shared between stages {owner[id(p)]} and {stage} (tied "
                        "weights); untie it, or choose pp_split so that both users sit in one stage")
    return owner


class OtherStage(torch.nn.Identity):
    """Stands for a unit another stage runs: returns its first argument unchanged, whatever else the
    model's forward passes it (``layer(hidden, mask)`` of an encoder's loop)."""

    def forward(self, input: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: A002 - nn.Identity's name
        return input


def keep_stage(model: torch.nn.Module, stage: int, plan: List[List[str]]) -> List[torch.nn.Parameter]:
    """Replace, in place, every unit of ``model`` that stage ``stage`` of ``plan`` (from
    :func:`stage_units`) does not own by :class:`OtherStage` (an ``nn.Identity``); return the parameters
    dropped."""
    _owner_of_each_parameter(model, plan)
    kept = set(plan[stage])
    dropped: List[torch.nn.Parameter] = []
    for name, unit in units(model):
        if name in kept:
            continue
        dropped += list(unit.parameters())
        put_unit(model, name, OtherStage())
    return dropped


def put_unit(model: torch.nn.Module, name: str, unit: torch.nn.Module) -> None:
    """Make ``unit`` the unit of ``model`` named ``name`` (one of :func:`units`), in place."""
    parent, _, attr = name.rpartition(".")
    container = model.get_submodule(parent) if parent else model
    if isinstance(container, torch.nn.ModuleList | torch.nn.Sequential):
        container[int(attr)] = unit
    elif isinstance(container, torch.nn.ModuleDict):
        container[attr] = unit
    else:
        setattr(container, attr, unit)


def microbatches_held(schedule: str, microbatches: int, stages: int, stage: int) -> int:
    """How many microbatches' activations stage ``stage`` holds for backward at once under ``schedule``: GPipe
    runs every forward before the first backward (all ``microbatches``); 1F1B starts ``stages - stage - 1``
    forwards ahead and then alternates one forward and one backward, so ``min(microbatches, stages - stage)``.
    (bench/pipeline measures it: the peak of each rank's saved-for-backward bytes under both.)"""
    if schedule == "gpipe":
        return microbatches
    if schedule == "1f1b":
        return min(microbatches, stages - stage)
    raise PipelineError(f"no count of microbatches in flight for schedule {schedule!r} (one of {sorted(SCHEDULES)})")


# ---------------------------------------------------------------------- the model's forward, watched once
class UnitChain:
    """Watches the next forward of a stage's ``module`` (the user's model, other stages' units replaced) and refuses,
    in one line, a forward that does more than apply its units one after the other: every stage runs the model's
    own forward, so an operation between units (``torch.tanh(layer(x))``, ``x * scale``, ``out.squeeze()``) would
    run on every stage, once per stage, and the pipeline would compute another function than the model, silently.

    The rule, on the objects themselves: each unit the forward calls takes as its first argument the very object the
    unit called before it returned; on a stage after the first, the first unit called takes the activation the
    stage received (the module's first positional argument); and the forward returns what the last unit returned.
    Units may be skipped (a forward that runs its embeddings only when it has no hidden states), not reordered.
    Its hooks see what the forward itself passes and returns: on a unit they come first before it (before FSDP2's
    and TP's hooks, which may cast or wrap what it takes) and last after it (what the next unit is given); on the
    module, last before it (what FSDP2's root hook cast) and first after it."""

    def __init__(self, module: torch.nn.Module, stage: int) -> None:
        self.stage = stage
        self.order = {name: n for n, (name, _) in enumerate(units(module))}
        self.calls: List[Tuple[str, Any, Any]] = []  # (unit, its first argument, what it returned)
        self._args: Tuple[Any, ...] = ()
        self._handles = [module.register_forward_pre_hook(self._starts, with_kwargs=True),  # after FSDP2's casts
                         module.register_forward_hook(self._ends, prepend=True, with_kwargs=True)]  # before its own
        for name, unit in units(module):
            self._handles += [
                unit.register_forward_pre_hook(lambda m, args, kwargs, n=name: self._enters(n, args, kwargs),
                                               prepend=True, with_kwargs=True),
                unit.register_forward_hook(lambda m, args, kwargs, out, n=name: self._leaves(n, out),
                                           with_kwargs=True)]

    def _starts(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        self._args = args

    def _enters(self, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> None:
        first = args[0] if args else next(iter(kwargs.values()), None)
        self.calls.append((name, first, None))

    def _leaves(self, name: str, output: Any) -> None:
        for n in range(len(self.calls) - 1, -1, -1):
            if self.calls[n][0] == name and self.calls[n][2] is None:
                self.calls[n] = (name, self.calls[n][1], output)
                break

    def _ends(self, module: torch.nn.Module, args: Tuple[Any, ...], kwargs: Dict[str, Any], output: Any) -> None:
        self.remove()
        problem = self.problem(output)
        if problem:
            raise PipelineError(
                f"pp: {type(module).__name__}.forward {problem}: under pp every stage runs the model's forward, so "
                "that would run on every stage and the pipeline would compute another model; make it part of a unit "
                "(a module, e.g. nn.Sequential(layer, nn.Tanh())), or keep the forward to units applied one after "
                "the other (docs/pipeline.md)")

    def problem(self, output: Any) -> Optional[str]:
        """What the watched forward did besides applying its units in turn (``None``: nothing)."""
        calls = self.calls
        if not calls:
            return "called none of its units"
        for (before, _, returned), (name, took, _) in zip(calls, calls[1:]):
            if self.order[name] <= self.order[before]:
                return f"called unit {name} after {before}"
            if took is not returned:
                return f"gave unit {name} something other than what unit {before} returned"
        if self.stage and self._args and calls[0][1] is not self._args[0]:
            return f"gave its first unit, {calls[0][0]}, something other than the activation the stage received"
        if output is not calls[-1][2]:
            return f"returned something other than what its last unit, {calls[-1][0]}, returned"
        return None

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ---------------------------------------------------------------------- the prepared model and its step
class PipelinedModel(torch.nn.Module):
    """One stage of a pipelined model: ``module`` is the user's model with the other stages' units
    replaced (possibly sharded by FSDP2/TP). ``model(batch)`` is refused; train with
    :meth:`step` (``ud.pipeline_step``). ``state_dict``/``load_state_dict`` are the stage's, keyed
    by the whole model's fully-qualified names (no ``module.`` prefix)."""

    def __init__(self, module: torch.nn.Module, stage: int, stages: int, schedule: str, microbatches: int,
                 device: torch.device, pp_group: Any, whole_keys: Sequence[str] = (), stage_group: Any = None) -> None:
        super().__init__()
        self.module = module
        self.whole_keys = frozenset(whole_keys)  # every stage's state-dict keys: the whole model's
        self.stage, self.stages, self.schedule_name, self.microbatches = stage, stages, schedule, microbatches
        self._device, self._group = device, pp_group
        self._stage_group = stage_group  # this stage's ranks (None: one): they agree on when to build a schedule
        self._schedules: Dict[Tuple[Any, ...], Any] = {}  # training schedules by the shapes of their batch
        self._eval_schedules: Dict[Tuple[Any, ...], Any] = {}  # forward-only ones
        self._loss_fn: Optional[Callable] = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise PipelineError(
            f"model(batch) of a pipelined model (pp={self.stages}) would run stage {self.stage} alone; train with "
            "loss = ud.pipeline_step(model, inputs, targets, loss_fn), which runs every stage's forward and backward")

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    def whole_state_dict(self, gather: bool) -> dict:
        """The whole model's state dict, keyed by its fully-qualified names, as full CPU tensors: this stage's
        (a collective inside the stage, whose ranks must all call it), and with ``gather`` (on the ranks whose
        pipeline group holds the main process) the other stages' too, sent to this group's first stage; the
        ranks of the other stages, and those not gathering, get their own stage's."""
        import torch.distributed as dist

        own = {key: full_tensor(value.detach()).cpu() for key, value in self.module.state_dict().items()}
        if not gather:
            return own
        parts: Optional[List[dict]] = [{} for _ in range(self.stages)] if self.stage == 0 else None
        dist.gather_object(own, parts, group=self._group, group_dst=0)
        if parts is None:
            return own
        return {key: value for part in parts for key, value in part.items()}  # stage order: the model's order

    def load_whole_state_dict(self, state: dict, strict: bool = True) -> Any:
        """Load this stage's part of the whole model's ``state`` (every rank passes the same): the keys other
        stages own are skipped; with ``strict``, one this stage owns that ``state`` lacks, or one no stage owns,
        is an error (``load_state_dict``'s)."""
        own = set(self.module.state_dict())
        return self.module.load_state_dict({key: value for key, value in state.items()
                                            if key in own or key not in self.whole_keys}, strict=strict)

    @property
    def is_last(self) -> bool:
        return self.stage == self.stages - 1

    def _schedule_for(self, loss_fn: Callable, key: Tuple[Any, ...]) -> Any:
        """The schedule for batches of the shapes ``key`` names (a schedule fixes the shapes it sends
        between stages at its first step): one per shape, kept while ``loss_fn`` stays the same."""
        if loss_fn is not self._loss_fn:
            self._schedules.clear()
            self._loss_fn = loss_fn
        if key not in self._schedules:
            from torch.distributed import pipelining

            UnitChain(self.module, self.stage)  # its first forward (the schedule's shape inference) is checked
            stage = pipelining.PipelineStage(self.module, self.stage, self.stages, self._device, group=self._group)
            cls = getattr(pipelining, SCHEDULES[self.schedule_name])
            self._schedules[key] = cls(stage, n_microbatches=self.microbatches, loss_fn=loss_fn, scale_grads=True)
        return self._schedules[key]

    def _agreed(self, key: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """``key`` and the keys of this stage's other ranks (one small all-gather among them): building a
        schedule runs a forward (its shape inference), which FSDP2's collectives make a collective of the
        stage's ranks, whose batches may differ in shape (each data-parallel rank pads its own)."""
        if self._stage_group is None:
            return key
        import hashlib

        import torch.distributed as dist

        digest = hashlib.blake2b(repr(key).encode(), digest_size=7).digest()
        mine = torch.tensor([int.from_bytes(digest, "big")], dtype=torch.int64, device=self._device)
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size(self._stage_group))]
        dist.all_gather(every, mine, group=self._stage_group)
        return (key, tuple(int(t) for t in every))

    def step(self, inputs: Any, targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """Forward and backward of ``inputs`` (see :func:`_positional_and_keywords`) against ``targets`` in
        microbatches (dimension 0); the mean microbatch loss, detached, on every stage. Every stage is
        given the same batch: the first reads ``inputs``, the last ``targets``, every one the keywords."""
        args, kwargs = self._checked(inputs, targets)
        schedule = self._schedule_for(loss_fn, self._agreed(_shapes(args, kwargs)))
        losses: List[torch.Tensor] = []
        if self.stage == 0 and self.is_last:
            schedule.step(*args, target=targets, losses=losses, **kwargs)
        elif self.stage == 0:
            schedule.step(*args, **kwargs)
        elif self.is_last:
            schedule.step(target=targets, losses=losses, **kwargs)
        else:
            schedule.step(**kwargs)
        mean = torch.stack([loss.detach() for loss in losses]).mean() if self.is_last else None
        return _from_last_stage(mean, self.stages, self._group, self._device)

    def _checked(self, inputs: Any, targets: torch.Tensor) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        """The positional and keyword arguments of ``inputs``, once the rows are known to split into
        ``microbatches`` equal microbatches, as many as the rows of ``targets``; a one-line refusal otherwise."""
        args, kwargs, rows = _positional_and_keywords(inputs)
        if rows is None or rows % self.microbatches or targets.shape[0] != rows:
            raise PipelineError(
                f"pipeline_step got a batch of {rows} rows (targets {tuple(targets.shape)[:1]}) that "
                f"pp_microbatches={self.microbatches} does not divide into equal microbatches; use a batch size "
                f"that is a multiple of {self.microbatches} (drop_last=True on the loader)")
        return args, kwargs

    def first_microbatch(self, inputs: Any, targets: torch.Tensor) -> Tuple[Tuple[Any, ...], Dict[str, Any], Any]:
        """What :meth:`step`'s schedule gives the stages for the first microbatch of ``inputs`` and ``targets``:
        the positional arguments, the keywords and the targets, each tensor's first rows as a view of the batch
        (``torch.tensor_split`` on dimension 0, as the schedule splits them); refused as :meth:`step` refuses."""
        args, kwargs = self._checked(inputs, targets)

        def first(value: Any) -> Any:
            if isinstance(value, torch.Tensor) and value.dim():
                return torch.tensor_split(value, self.microbatches)[0]
            return value
        return tuple(first(a) for a in args), {k: first(v) for k, v in kwargs.items()}, first(targets)

    def forward_only(self, inputs: Any) -> torch.Tensor:
        """The model's output for ``inputs`` (as :meth:`step` takes them), forward only, without gradients:
        on the last stage's ranks the output (a tensor, its rows those of the batch); on the other stages'
        an empty tensor of its dtype and trailing shape (0 rows), so that a metric gathered on every rank
        counts each row once. Microbatches: ``pp_microbatches`` where they divide the batch, else one."""
        args, kwargs, rows = _positional_and_keywords(inputs)
        if rows is None:
            raise PipelineError("pipeline_forward needs a batch: a tensor, a tuple of tensors or a dict of tensors "
                                "whose first has a row dimension")
        microbatches = self.microbatches if rows % self.microbatches == 0 else 1
        key = self._agreed((microbatches, *_shapes(args, kwargs)))
        schedule = self._eval_schedules.get(key)
        if schedule is None:
            from torch.distributed import pipelining

            UnitChain(self.module, self.stage)
            stage = pipelining.PipelineStage(self.module, self.stage, self.stages, self._device, group=self._group)
            schedule = self._eval_schedules[key] = pipelining.ScheduleGPipe(stage, n_microbatches=microbatches)
        with torch.no_grad():
            output = schedule.step(*args, **kwargs) if self.stage == 0 else schedule.step(**kwargs)
        if self.is_last and not isinstance(output, torch.Tensor):
            raise PipelineError(f"pipeline_forward needs a model whose output is one tensor; the last stage returned "
                                f"{type(output).__name__}")
        return _empty_of_last_stage(output if self.is_last else None, self.stages, self._group, self._device)


def _positional_and_keywords(inputs: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any], Optional[int]]:
    """``inputs`` of :meth:`PipelinedModel.step`: a tensor or a tuple of tensors (the first stage's positional
    arguments), or a mapping of tensors (a dict, transformers' ``BatchEncoding``: keyword arguments of every
    stage's forward, each stage being given the same batch); with the rows of its first tensor (``None`` when
    it has none)."""
    if isinstance(inputs, Mapping):
        args, kwargs = (), dict(inputs)
    else:
        args, kwargs = (inputs if isinstance(inputs, tuple) else (inputs,)), {}
    first = next(iter([*args, *kwargs.values()]), None)
    rows = first.shape[0] if isinstance(first, torch.Tensor) and first.dim() else None
    return args, kwargs, rows


def _shapes(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Tuple[Any, ...]:
    return tuple((name, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else (name, repr(v))
                 for name, v in [*enumerate(args), *sorted(kwargs.items())])


def _empty_of_last_stage(output: Optional[torch.Tensor], stages: int, group: Any,
                         device: torch.device) -> torch.Tensor:
    """``output`` on the last stage; on the others an empty tensor of its dtype and trailing shape (one
    broadcast of ``[dtype, ndim, shape...]`` over the pipeline ``group``)."""
    import torch.distributed as dist

    box = torch.zeros(MAX_DIMS + 2, dtype=torch.int64, device=device)
    if output is not None:
        if output.dim() > MAX_DIMS or output.dtype not in OUTPUT_DTYPES:
            raise PipelineError(f"pipeline_forward's output of {output.dim()} dimensions ({output.dtype}) cannot be "
                                f"described to the other stages (at most {MAX_DIMS}, a dtype of {OUTPUT_DTYPES})")
        box[0], box[1] = OUTPUT_DTYPES.index(output.dtype), output.dim()
        box[2:2 + output.dim()] = torch.tensor(output.shape, dtype=torch.int64)
    dist.broadcast(box, group=group, group_src=stages - 1)
    if output is not None:
        return output
    shape = [int(n) for n in box[2:2 + int(box[1])].tolist()]
    return torch.empty([0, *shape[1:]], dtype=OUTPUT_DTYPES[int(box[0])], device=device)


MAX_DIMS = 6
OUTPUT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.bool)


LOSS_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _from_last_stage(loss: Optional[torch.Tensor], stages: int, group: Any, device: torch.device) -> torch.Tensor:
    """The last stage's ``loss`` (``None`` elsewhere) on every stage of the pipeline ``group``, a 0-d
    tensor of its dtype: one broadcast of ``[value, dtype]`` in float64 (which holds every value of
    the floating dtypes exactly)."""
    import torch.distributed as dist

    box = torch.zeros(2, dtype=torch.float64, device=device)
    if loss is not None:
        box[0] = loss.to(torch.float64)
        box[1] = LOSS_DTYPES.index(loss.dtype) if loss.dtype in LOSS_DTYPES else 1
    dist.broadcast(box, group=group, group_src=stages - 1)
    return box[0].to(LOSS_DTYPES[int(box[1].item())])


__all__ = ["SCHEDULES", "MULTI_STAGE_SCHEDULES", "OtherStage", "PipelinedModel", "default_split", "keep_stage",
           "microbatches_held", "put_unit", "settings_problem", "split_names", "stage_units", "UnitChain", "units"]
