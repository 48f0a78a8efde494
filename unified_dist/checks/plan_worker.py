"""One simulated rank of ``unified-dist plan``: runs the user's script in this process, as rank
``RANK`` of ``WORLD_SIZE``, up to and including its first optimizer step, and writes what the rank
would hold and send (a JSON file).

    python -m unified_dist.checks.plan_worker OUT.json SCRIPT [ARGS...]   # RANK, WORLD_SIZE, ... set

How the world is simulated, and why each piece is needed:

- torch's fake process group (``init_process_group("fake")``) is joined before the script runs, so
  ``ud.init`` adopts it as a group the process joined itself: every collective returns at once, and
  every rank-dependent choice (the mesh, the shards) is the real rank's. The collectives run on fake
  tensors through the ``Meta`` kernels torch ships (:func:`unified_dist.compat.enable_fake_collectives`
  registers them where the torch release does not at import).
- torch's ``FakeTensorMode`` is active while the script runs: every tensor the script and the library
  create has its real shape, dtype and device but no data, so a 1 B-parameter model costs nothing.
  The device mesh and ``ud.init`` run outside it (their rank tables are real data); a module
  moved to the device all its tensors already report stays as it is (torch would swap each fake
  parameter for itself, and cannot); a value the host reads from a fake tensor (``loss.item()``) is 0.
- The collectives are counted from the first forward of a prepared model (before FSDP2's own hooks)
  to the end of the first optimizer step. That step runs outside the fake mode (its step counter is a
  real scalar), on the fake shards; the rank's bytes are counted right after torch's step, and the
  script is stopped once ``ud.prepare``'s optimizer returns (it broadcasts the buffers after the update).
- DDP's reducer cannot run on fake tensors: a DDP model stays unwrapped, and DDP's all-reduce per step
  is given as the gradients' bytes (what DDP's buckets reduce), marked ``derived``.
- The deepspeed backend: DeepSpeed's engine flattens and partitions real storages, and is not run. The script
  runs on :class:`PlannedDeepSpeed` (the torch backend, its model unwrapped as under DDP, with the ZeRO stage
  DeepSpeed would take and its refusals); after the first step the rank's bytes are those
  :func:`~unified_dist.parallel.accounting.zero_rank_bytes` derives for the stage from the model's parameters and
  the optimizer's groups and state (its doc says what is counted and what is not). DeepSpeed's collectives are
  not counted (the table is empty), and what the plan does not model (mixed precision, offload, a DeepSpeed
  config file's optimizer) is a ``PlanError``.
- A pipeline (``pp`` > 1): a schedule's shape inference reads the activations the previous stage sends, which the
  fake process group never delivers, so the schedule is not run. ``ud.pipeline_step`` instead runs, on fake
  tensors, what the schedule's first microbatch does up to this rank's stage: the model's forward with each earlier
  stage's units put back in turn (the units ``keep_stage`` dropped, kept aside when ``ud.prepare`` dropped them),
  each on the previous one's output, then this stage's own (sharded) units on that, and on the last stage the loss,
  counting what this stage saves for backward (:class:`~unified_dist.parallel.accounting.SavedBytes`; a stage
  after the first receives a leaf that needs its gradient, as the schedule's). The schedule holds
  :func:`~unified_dist.parallel.pipeline.microbatches_held` microbatches' of those at once, the batch's own
  storages (the microbatches are views of it) once. On the first stage, torch 2.13's schedule also keeps the graph
  of the forward its shape inference ran on the first batch's first microbatch for as long as the schedule lives
  (measured: it is alive between steps; the later stages' is freed), so one more microbatch, with its batch, counts
  there: the peak of every step after the first. It then gives each of the stage's trainable
  parameters a gradient of its own shape (and layout: a DTensor's for a sharded stage) and returns a zero loss;
  the optimizer steps as usual, and the rank's bytes are its stage's parameters, gradients and optimizer state.
  What the schedule sends is not planned: the collectives table is empty.

An exception the script raises (a layout that does not divide the world, a TP plan that does not fit
the heads) is the error the real job would meet: it is written as it is, type and one-line message.
"""
from __future__ import annotations

import json
import os
import resource
import runpy
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import nested
from ..backends.deepspeed_backend import (
    _said,
    offload_devices,
    offload_problem,
    read_config_file,
    refusal,
    zero_stage_of,
)
from ..backends.torch_ddp import TorchBackend
from ..compat import enable_fake_collectives
from ..errors import SettingError, UnifiedDistError
from ..parallel.accounting import (
    CollectiveCounter,
    SavedBytes,
    group_labels,
    rank_bytes,
    storage_key,
    zero_rank_bytes,
)


class PlanLimit(UnifiedDistError):
    """What the simulation cannot plan (reported as a ``PlanError``, the plan's limit, not the job's error)."""


def zero_plan_limit(file: Dict[str, Any], mixed_precision: Optional[str],
                    offload: Optional[Dict[str, str]] = None) -> Optional[str]:
    """Why a plan cannot model a deepspeed job whose DeepSpeed config is ``file`` (a dict, ``{}`` without one) and
    whose ``mixed_precision`` setting is given, in one line; ``None``: float32 without offload, which it models.
    ``offload``: where the job offloads (:func:`~unified_dist.backends.deepspeed_backend.offload_devices`). Pure."""
    unmodelled = [f"{key}={device!r}" for key, device in (offload or {}).items()] + \
        [key for key in ("optimizer", "scheduler") if _said(file.get(key))] + \
        [key for key in ("bf16", "fp16") if file.get(key, {}).get("enabled") not in (None, False, "auto")]
    if mixed_precision not in (None, "no"):
        unmodelled.insert(0, f"mixed_precision={mixed_precision!r}")
    if not unmodelled:
        return None
    return (f"plan models DeepSpeed's float32 training without offload; {', '.join(unmodelled)} is not modelled "
            "(plan the float32 job, or measure one real step)")


class PlannedDeepSpeed(TorchBackend):
    """The deepspeed backend as a plan runs it: the torch backend (no DeepSpeed engine), with the ZeRO stage and the
    refusals of :class:`~unified_dist.backends.deepspeed_backend.DeepSpeedBackend`; what the plan does not model
    raises :class:`PlanLimit`."""

    name = "deepspeed"
    reads_deepspeed_settings = True

    def __init__(self, detection, config) -> None:
        problem = refusal(config)
        if problem:
            raise UnifiedDistError(problem)
        file = read_config_file(config.deepspeed_config)
        self.zero_stage = zero_stage_of(config, file, detection.launcher)
        offload = offload_devices(file, config)
        problem = offload_problem(offload, self.zero_stage)
        if problem:  # the job's own refusal, not the plan's limit
            raise SettingError(problem)
        limit = zero_plan_limit(file, config.mixed_precision, offload)
        if limit:
            raise PlanLimit(limit)
        super().__init__(detection, config)


class _Planned(BaseException):
    """Stops the script after its first optimizer step (a BaseException: a script's ``except
    Exception`` must not swallow it)."""


class _HostReads(TorchDispatchMode):
    """Answers 0 (or False) where the host reads a number out of a fake tensor (``.item()``,
    ``.tolist()``): the plan computes no values, only shapes."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import FakeTensor

        if func is torch.ops.aten._local_scalar_dense.default and isinstance(args[0], FakeTensor):
            return False if args[0].dtype == torch.bool else (0.0 if args[0].is_floating_point() else 0)
        return func(*args, **(kwargs or {}))


def _outside_fake(function):
    """``function`` run with the fake mode suspended (its tensors are real: rank tables, settings)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def run(*args, **kwargs):
        with unset_fake_temporarily():
            return function(*args, **kwargs)
    return run


def _stay_if_there(to):
    """``Module.to`` that returns a module at once when asked only for the device all its parameters
    and buffers already report (torch would try to swap each fake parameter for itself, and fail)."""

    def moved(self, *args, **kwargs):
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if device is not None and dtype is None and memory_format is None and tensors \
                and all(_same_device(t.device, device) for t in tensors):
            return self
        return to(self, *args, **kwargs)
    return moved


def _same_device(have: torch.device, want: torch.device) -> bool:
    return have.type == want.type and (want.index is None or have.index == want.index)


class Simulation:
    """The patches and modes of one simulated rank; :meth:`report` is what it counted."""

    def __init__(self) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.host = _HostReads()
        self.counter = CollectiveCounter()
        self.models: List[torch.nn.Module] = []
        self.saved: Optional[Dict[str, Any]] = None
        self.ddp = False
        self.result: Dict[str, Any] = {}
        self._saving: Optional[SavedBytes] = None
        self._counting_from_forward = False
        self._in_prepared_step = False
        self._labels: Dict[str, str] = {}
        self.pipeline: Optional[Dict[str, Any]] = None  # under pp: this rank's stage, stages, schedule, microbatches
        self._whole: Dict[int, tuple] = {}  # under pp: id(stage module) -> (every unit by name, the stages' units)

    # ------------------------------------------------------------------ set-up
    def install(self) -> None:
        """Patch what cannot run on fake tensors (see the module doc) and hook the first step."""
        from torch.distributed.device_mesh import DeviceMesh
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        from .. import session

        session.init = _outside_fake(session.init)
        backend_class = session.backend_class
        session.backend_class = lambda name: PlannedDeepSpeed if name == "deepspeed" else backend_class(name)
        DeviceMesh.__init__ = _outside_fake(DeviceMesh.__init__)
        torch.nn.Module.to = _stay_if_there(torch.nn.Module.to)
        TorchBackend._wrap_ddp = lambda backend, model: self._no_ddp(model)
        prepare = session.Session.prepare
        session.Session.prepare = lambda s, objs: self._prepared(s, prepare(s, objs))
        self._wrap_prepared_step()
        from ..parallel.pipeline import PipelinedModel

        PipelinedModel.step = lambda model, inputs, targets, loss_fn: self._pipeline_step(model, inputs, targets,
                                                                                         loss_fn)
        from ..parallel import pipeline

        keep_stage = pipeline.keep_stage

        def keeping_aside(model: torch.nn.Module, stage: int, plan: List[List[str]]) -> list:
            self._whole[id(model)] = (dict(pipeline.units(model)), plan)
            return keep_stage(model, stage, plan)
        pipeline.keep_stage = keeping_aside
        register_optimizer_step_pre_hook(self._before_step)
        register_optimizer_step_post_hook(self._after_step)

    def enter(self) -> None:
        self.fake.__enter__()
        self.host.__enter__()
        self.counter.__enter__()

    def _no_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        self.ddp = True
        return model

    def _prepared(self, session, out: list) -> list:
        """Remember the models ``ud.prepare`` returned; count from their first forward on."""
        for obj in out:
            if isinstance(obj, torch.nn.Module):
                self.models.append(obj)
                regions = session.backend.compile_regions(obj)
                # first of the pre-forward hooks: FSDP2's (all-gather of the root) and the buffers' broadcast count
                obj.register_forward_pre_hook(lambda m, a, r=regions: self._forward_starts(m, r), prepend=True)
                obj.register_forward_hook(lambda m, a, o: self._forward_ends())
        return out

    def _forward_starts(self, model: torch.nn.Module, regions) -> None:
        if not self._counting_from_forward:
            self._counting_from_forward = True
            self.counter.reset()  # the step's collectives only (not init's and prepare's)
        if self.saved is None and self._saving is None:
            self._saving = SavedBytes(model, _checkpointed(model, regions), twins=self._fake_twin).__enter__()

    def _fake_twin(self, param: torch.Tensor) -> list:
        """The fake copy the fake mode makes of a real parameter (one a script loaded from a file) when an
        operation uses it: what the forward saves of that parameter."""
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.tensor import DTensor

        if isinstance(param, (FakeTensor, DTensor)):
            return []
        return [self.fake.from_tensor(param)]

    def _forward_ends(self) -> None:
        if self._saving is not None and self.saved is None:
            self._saving.__exit__(None, None, None)
            self.saved = {"bytes": self._saving.bytes, "tensors": self._saving.count}
            self._saving = None

    def _pipeline_step(self, model, inputs: Any, targets: torch.Tensor, loss_fn: Callable) -> torch.Tensor:
        """``ud.pipeline_step`` without its schedule (see the module doc): what the first microbatch saves on this
        stage, then a gradient for each of the stage's trainable parameters, shaped and laid out like it; a zero
        loss."""
        self.pipeline = {"stage": model.stage, "stages": model.stages, "schedule": model.schedule_name,
                         "microbatches": model.microbatches}
        if self.saved is None:
            self.saved = self._stage_saved(model, inputs, targets, loss_fn)
        for p in model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        return torch.zeros((), device=model._device)

    def _stage_saved(self, model, inputs: Any, targets: torch.Tensor, loss_fn: Callable) -> Dict[str, Any]:
        """What this rank's stage holds for backward under its schedule (the module doc): the first microbatch's
        saved bytes, of which the batch's own storages, and how many microbatches are held at once."""
        from .. import session
        from ..parallel import pipeline

        stage, module = model.stage, model.module
        whole, plan = self._whole[id(module)]
        args, kwargs, target = model.first_microbatch(inputs, targets)
        batch = {storage_key(t) for _, t in nested.leaves((args, kwargs, target)) if isinstance(t, torch.Tensor)}
        own = dict(pipeline.units(module))  # this stage's units as prepared (sharded), the others' stand-ins

        def put(units: Dict[str, torch.nn.Module]) -> None:
            for name, unit in units.items():
                pipeline.put_unit(module, name, unit)
        try:
            for j in range(stage):  # stage j's units in the model, every other unit a stand-in
                put({name: whole[name] if name in plan[j] else pipeline.OtherStage() for name in whole})
                with torch.no_grad():
                    args = (module.forward(*args, **kwargs),)  # forward itself: no hook of the stage's own (FSDP2)
            if stage:  # what the stage receives is a leaf that needs its gradient (it sends it back)
                args = tuple(a.detach().requires_grad_(a.is_floating_point()) for a in args)
                put(own)
            blocks = _checkpointed(module, session.current().backend.compile_regions(module))
            pipeline.UnitChain(module, stage)  # the schedule's first forward is checked: the job would stop there
            with SavedBytes(module, blocks, twins=self._fake_twin) as saving:
                output = module(*args, **kwargs)
                if model.is_last:
                    loss_fn(output, target)
        finally:
            put(own)
        batch_bytes = sum(size for key, size in saving.sizes.items() if key in batch)
        held = pipeline.microbatches_held(model.schedule_name, model.microbatches, model.stages, stage)
        kept = saving.bytes if stage == 0 else 0  # torch's shape inference keeps a graph: see the module doc
        return {"bytes": kept + batch_bytes + held * (saving.bytes - batch_bytes), "microbatch_bytes": saving.bytes,
                "batch_bytes": batch_bytes, "microbatches_held": held, "kept_between_steps": kept,
                "microbatch_rows": int(target.shape[0]) if isinstance(target, torch.Tensor) else None}

    # ------------------------------------------------------------------ the step
    def _before_step(self, optimizer, args, kwargs) -> None:
        """Leave the fake mode for the step (its step counter must be a real scalar)."""
        self.counter.__exit__(None, None, None)
        self.host.__exit__(None, None, None)
        self.fake.__exit__(None, None, None)
        self.counter.__enter__()

    def _after_step(self, optimizer, args, kwargs) -> None:
        """Count what the rank holds; stop here, or, inside ``ud.prepare``'s optimizer, once its step
        (with the buffers' broadcast that follows the update) returns."""
        self.result = self.report(optimizer)
        if not self._in_prepared_step:
            self._stop()

    def _stop(self) -> None:
        self.counter.__exit__(None, None, None)
        # DeepSpeed's own collectives, and a pipeline's schedule: not simulated
        unplanned = self.result.get("zero_stage") is not None or self.result.get("pipeline") is not None
        self.result["collectives"] = [] if unplanned else _relabel(self.counter.table(), self._labels)
        raise _Planned()

    def _wrap_prepared_step(self) -> None:
        from ..training.accumulation import PreparedOptimizer

        step = PreparedOptimizer.step

        def planned_step(optimizer, *args, **kwargs):
            self._in_prepared_step = True
            try:
                result = step(optimizer, *args, **kwargs)
            finally:
                self._in_prepared_step = False
            if self.result:
                self._stop()
            return result
        PreparedOptimizer.step = planned_step

    def report(self, optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        """What this rank holds after its first optimizer step and what it sent during it."""
        from .. import session

        backend = session.current().backend
        models = [backend.unwrap(m) for m in self.models]
        held = rank_bytes(models, optimizer)
        self._labels = group_labels(backend.device_mesh)
        zero = isinstance(backend, PlannedDeepSpeed)
        if zero:
            held = zero_rank_bytes(*_unsharded(models, optimizer), backend.zero_stage, backend.world_size)
            self.ddp = False
        if self.ddp:
            self._labels["derived"] = "world (DDP buckets)"
            self.counter.add("all_reduce", "derived", held["grads"], calls=None)
        layout, config = backend.layout, backend.config
        return {"bytes": held, "saved_for_backward": self.saved, "backend": backend.name,
                "zero_stage": backend.zero_stage if zero else None,
                "model_parameters": sum(p.numel() for m in models for p in m.parameters()),
                "layout": {"pp": layout.pp, "dp_replicate": layout.replicate, "dp_shard": layout.shard,
                           "tp": layout.tp}, "pipeline": self.pipeline,
                "ddp": self.ddp, "activation_checkpointing": bool(config.sharding.activation_checkpointing),
                "mixed_precision": config.mixed_precision}


def _checkpointed(model: torch.nn.Module, regions: Optional[List[torch.nn.Module]]) -> List[torch.nn.Module]:
    """The blocks of ``model`` whose inputs a checkpointed forward holds (``regions``, the blocks the backend split,
    else those it would shard), where the session checkpoints activations; none otherwise, where autograd's own saves
    are all there is (a block whose first operation saves no input, a tanh, holds none)."""
    from .. import session
    from ..parallel.sharding import blocks_to_shard

    if not session.current().backend.config.sharding.activation_checkpointing:
        return []
    return regions if regions is not None else blocks_to_shard(model)


def _unsharded(models: List[torch.nn.Module], optimizer: torch.optim.Optimizer) -> tuple:
    """The arguments of :func:`~unified_dist.parallel.accounting.zero_rank_bytes` for ``models`` (whole, as the torch
    backend left them) and ``optimizer``: each module parameter's ``(numel, element_size)`` once, and per group each
    trainable parameter's with its state's ``(numel, element_size, shaped_like_the_parameter)``."""
    seen, module_params = set(), []
    for p in (p for m in models for p in m.parameters()):
        if id(p) not in seen:
            seen.add(id(p))
            module_params.append((p.numel(), p.element_size()))
    groups = [[(p.numel(), p.element_size(),
                [(v.numel(), v.element_size(), v.shape == p.shape) for v in optimizer.state.get(p, {}).values()
                 if isinstance(v, torch.Tensor)])
               for p in group["params"] if p.requires_grad] for group in optimizer.param_groups]
    return module_params, groups


def _join_fake_world() -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=int(os.environ["RANK"]),
                            world_size=int(os.environ["WORLD_SIZE"]))


def simulate(script: str, script_args: List[str]) -> Dict[str, Any]:
    """Run ``script`` as the simulated rank; the report (with ``error`` set when it failed)."""
    start = time.perf_counter()
    _join_fake_world()
    enable_fake_collectives()
    sim = Simulation()
    sim.install()
    out: Dict[str, Any] = {"rank": int(os.environ["RANK"]), "world": int(os.environ["WORLD_SIZE"]), "error": None}
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        sim.enter()
        runpy.run_path(script, run_name="__main__")
        out["error"] = {"type": "PlanError", "message": "the script ended before its first optimizer step; "
                        "plan needs a script that builds a model and steps an optimizer"}
    except _Planned:
        out.update(sim.result)
    except SystemExit as exc:
        out["error"] = {"type": "PlanError", "message": f"the script exited (status {exc.code!r}) before its first "
                        "optimizer step; its output is above"}
    except Exception as exc:  # the error the real job would meet, as it is, unless the simulation caused it
        out["error"] = _error(exc)
    out["seconds"] = round(time.perf_counter() - start, 2)
    out["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _error(exc: Exception) -> Dict[str, str]:
    """``exc`` as the plan reports it: the job's own error as it is; one that only fake tensors raise
    (an operation whose output depends on values) as the simulation's limit, not the job's."""
    from torch._subclasses.fake_tensor import (
        DataDependentOutputException,
        DynamicOutputShapeException,
        UnsupportedFakeTensorException,
    )

    message = " ".join(str(exc).split())
    if isinstance(exc, PlanLimit):
        return {"type": "PlanError", "message": message}
    if isinstance(exc, (DataDependentOutputException, DynamicOutputShapeException, UnsupportedFakeTensorException)):
        return {"type": "PlanError", "message": f"the script cannot be simulated: {type(exc).__name__}: {message} "
                "(an operation whose result depends on tensor values, which a plan does not compute)"}
    return {"type": type(exc).__name__, "message": message}


def _relabel(rows: List[Dict[str, Any]], labels: Dict[str, str]) -> List[Dict[str, Any]]:
    return [{**row, "group": labels.get(row["group"], row["group"])} for row in rows]


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    out_path, script, script_args = argv[0], argv[1], argv[2:]
    report = simulate(script, script_args)
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the script was stopped mid-way: no exit hooks of a job that never ran (they would communicate)


if __name__ == "__main__":
    main()
