"""The one process-wide session: what ``ud.init`` set up, and the work behind the facade.

:func:`init` resolves the settings (:mod:`unified_dist.settings`), detects the launcher
(:mod:`unified_dist.detection`), builds the backend and the :class:`Session` around it; every
other module of the API layer (:mod:`unified_dist.facade`, :mod:`unified_dist.saving`,
:mod:`unified_dist.elastic`) reaches it through :func:`current`. A :class:`Session` owns the
gradient synchronisation, the prepared loaders and optimizers, and the exit hooks.

Layers (``tests/unit/test_layers.py`` checks them): the API layer imports this module; this module
imports the layers below (backends, collectives, training, data, settings); nothing below
imports this module or the API layer.
"""
from __future__ import annotations

import atexit
import contextlib
import datetime
import os
import random
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Tuple

import torch

from . import settings
from .backends import Backend, Config, backend_class, replica_groups
from .backends.base import DEEPSPEED_SETTINGS
from .backends.precision import Precision
from .checkpoint import background as background_save, rng
from .collectives import ops as collectives
from .data.loaders import LoaderStack, PreparedDataLoader
from .data.streams import PreparedStreamLoader
from .detection import Detection, detect, live
from .errors import LaunchError, NonFiniteLoss, PipelineError, UnifiedDistError, warn_once
from .parallel import compiling, pipeline
from .parallel.mesh import accelerate_dp_shard
from .parallel.sharding import Sharding
from .training import preemption
from .training.accumulation import GradientSync, PreparedOptimizer, PreparedScheduler, is_scheduler


def config_from(given: Mapping[str, Any], environ: Mapping[str, str], cuda: bool) -> Config:
    """The :class:`Config` that ``init``'s keywords ``given`` (``None``: not given) and ``environ``
    resolve to (:func:`unified_dist.settings.resolve_all`), checked against this machine (``cuda``)
    and against itself. Raises the setting's error, :class:`LaunchError` for a contradiction with the
    launcher, :class:`UnifiedDistError` for settings that exclude each other."""
    values = settings.resolve_all(given, environ)
    Precision(values["mixed_precision"]).check_device(cuda)
    compiling.check_backend(values["compile"], values["compile_mode"])
    modules = values.pop("shard_modules")
    sharding = Sharding(values.pop("sharding"), tuple(modules) if modules else None,
                        values.pop("reshard_after_forward"), dp_replicate=values.pop("dp_replicate"),
                        tp=values.pop("tp"), tp_plan=values.pop("tp_plan"), cpu_offload=values.pop("cpu_offload"),
                        activation_checkpointing=values.pop("activation_checkpointing"),
                        dp_shard=accelerate_dp_shard(environ), pp=values.pop("pp"),
                        pp_schedule=values.pop("pp_schedule"), pp_microbatches=values.pop("pp_microbatches"),
                        pp_split=pipeline.split_names(values.pop("pp_split")))
    if settings.TABLE["sharding"].from_launcher(environ)[0] and environ.get("FSDP_VERSION", "1").strip() != "2":
        raise LaunchError("accelerate launch --use_fsdp asks for FSDP version "
                          f"{environ.get('FSDP_VERSION', '1')}; unified_dist shards with FSDP2: add --fsdp_version 2")
    if sharding.problem():
        raise UnifiedDistError(sharding.problem())
    refusal = pipeline.settings_problem(sharding.pp, sharding.pp_schedule, sharding.pp_microbatches,
                                        sharding.dp_replicate, values["gradient_accumulation_steps"], values["compile"])
    if refusal:
        raise PipelineError(refusal)
    if sharding.splits_model and values["gradient_compression"]:
        raise UnifiedDistError(
            f"gradient_compression={values['gradient_compression']!r} compresses DDP's and Horovod's all-reduce; "
            "sharding='fsdp' reduce-scatters instead, and tensor parallelism reduces inside its layers: "
            "use one of the two")
    return Config(sharding=sharding, timeout=datetime.timedelta(seconds=values.pop("timeout")), **values)


@dataclass
class Session:
    """Everything one ``init`` set up; :func:`shutdown` drops it whole."""

    backend: Backend
    detection: Detection
    sync: GradientSync
    loaders: LoaderStack
    optimizers: List[PreparedOptimizer] = field(default_factory=list)
    prepared_from: dict = field(default_factory=dict)  # id(user's optimizer) -> PreparedOptimizer
    scaler: Any = None  # the fp16 loss scaler every prepared optimizer shares (None: the backend's own, or none)
    seed: int = 0  # the loaders' shuffle seed (seed_everything)
    failed: bool = False  # an exception reached the top of the program (see _note_failure)
    _finite: Optional[torch.Tensor] = None  # on the device: every loss of this accumulation window was finite
    stops: Optional[preemption.StopSignals] = None  # the stop signals this process records (None: off)
    stop_step: Optional[int] = None  # the optimizer step at which every rank agreed to stop
    _exchanged: bool = False  # an exchange ran since the last should_stop()
    _backward_seen: bool = False  # ud.backward ran since the last should_stop()
    healable: List[Any] = field(default_factory=list)  # prepared objects a rejoining replica group takes from a peer
    _training_loader: Any = None  # the prepared loader the latest ud.backward ran on (replica groups)
    _evaluating: dict = field(default_factory=dict)  # prepared loader -> why its latest pass is an evaluation

    # ------------------------------------------------------------------ replica groups
    def begin_replica_step(self) -> None:
        """A prepared loader is about to fetch a batch: hold the step's quorum if it is a training pass (the
        loader a ``ud.backward`` ran on before, or any loader before the first ``ud.backward``), so an
        evaluation pass (:meth:`_evaluation_pass`) holds none."""
        current = self.loaders.current
        if current in self._evaluating:
            return
        if self._training_loader is None or current is self._training_loader:
            self.backend.replicas.begin_step()

    def end_replica_pass(self, loader: Any) -> None:
        """A pass of a prepared loader ended: a training loop that left its loader with a step's quorum held
        (a ``break`` right after a fetch) stops that step's timing until its next fetch
        (:meth:`~unified_dist.backends.replica_groups.ReplicaGroups.pause_step`)."""
        replicas = self.backend.replicas
        if loader not in self._evaluating and replicas.opened:
            replicas.pause_step()

    def _evaluation_pass(self, loader: Any) -> Optional[str]:
        """Why the pass of ``loader`` beginning now is an evaluation, in words (``None``: a training pass).

        With replica groups the two differ. A training pass holds each step's quorum and gives each group its
        share of the data. An evaluation pass holds none and is sharded over the group's own ranks: the groups
        hold equal weights, so each evaluates the whole split and ``gather_for_metrics`` (a gather inside the
        group) returns every example once. A pass is an evaluation when it begins with gradients off, else
        when it is not the training loader's (the loader ``ud.backward`` ran on) and either every prepared
        model is in eval mode or another loader is the training loader."""
        if not torch.is_grad_enabled():
            return "it began with gradients off (torch.no_grad or torch.inference_mode)"
        if loader is self._training_loader:
            return None
        models = [obj for obj in self.healable if isinstance(obj, torch.nn.Module)]
        if models and not any(model.training for model in models):
            return "it began with every prepared model in eval mode (model.eval())"
        if self._training_loader is not None:
            return "another prepared loader is the training loader (the one ud.backward ran on)"
        return None

    def _replica_pass_topology(self, loader: Any) -> Optional[Tuple[int, int]]:
        """The (rank, world size) a pass of ``loader`` beginning now is sharded over: the group's own
        data-parallel ranks for an evaluation pass, ``None`` (every group's) for a training pass."""
        why = self._evaluation_pass(loader)
        if why is None:
            self._evaluating.pop(loader, None)
            return None
        self._evaluating[loader] = why
        backend, layout = self.backend, self.backend.replicas.layout
        world = backend.data_parallel_world_size // layout.groups
        return backend.data_parallel_rank - layout.group * world, world

    def _replica_state(self) -> dict:
        """What a live peer sends a replica group that (re)joins: every prepared model, optimizer, scheduler
        and loader's state, in prepare order, and this process's generators."""
        return {"objects": [obj.state_dict() for obj in self.healable], "rng": rng.capture()}

    def _load_replica_state(self, state: dict, generators: bool = True) -> None:
        """Take a peer's state (:meth:`_replica_state`), its generators if ``generators``: a loader mid-pass
        continues at the peer's position."""
        objects = state.get("objects", [])
        if len(objects) != len(self.healable):
            raise UnifiedDistError(
                f"a live replica group sent the state of {len(objects)} prepared objects, this one prepared "
                f"{len(self.healable)}: every replica group must run the same script")
        for obj, value in zip(self.healable, objects):
            if isinstance(obj, PreparedDataLoader):
                obj.jump_to(value)
            else:
                obj.load_state_dict(value)
        if generators:
            rng.restore(state["rng"])

    # ------------------------------------------------------------------ prepare
    def prepare(self, objs: tuple) -> List[Any]:
        """``ud.prepare``'s work: each object made ready, in the order given (see the facade)."""
        backend = self.backend
        models = [o for o in objs if isinstance(o, torch.nn.Module)]
        out: List[Any] = [None] * len(objs)
        # models first (sharding replaces their parameters, which the optimizers must then step);
        # schedulers last, so they can be pointed at the optimizer prepared in the same call
        order = sorted(range(len(objs)),
                       key=lambda i: (not isinstance(objs[i], torch.nn.Module), is_scheduler(objs[i])))
        backend.about_to_prepare(objs)
        replicas = backend.replicas
        if replicas is not None:
            refusal = replica_groups.refuse_objects(objs, len(self.optimizers))
            if refusal:
                raise UnifiedDistError(refusal)
        for i in order:
            obj = objs[i]
            if isinstance(obj, torch.nn.Module):
                out[i] = self._prepare_model(obj)
            elif isinstance(obj, PreparedOptimizer):
                out[i] = obj
            elif isinstance(obj, torch.optim.Optimizer):
                inner = backend.prepare_optimizer(obj, models[0] if len(models) == 1 else None)
                if self.sync.scaler is None:  # one loss scale for every optimizer, as Accelerate's one scaler
                    self.sync.scaler = backend.make_grad_scaler()
                prepared = PreparedOptimizer(inner, self.sync, self.sync.scaler)
                if self.stops is not None:  # training: a signal before the first ask is held (training.preemption)
                    self.stops.hold_from(lambda: self.sync.optimizer_steps)
                    self.sync.stops = self.stops
                self.optimizers.append(prepared)
                self.prepared_from[id(obj)] = prepared
                out[i] = prepared
            elif isinstance(obj, torch.utils.data.DataLoader):
                topology = lambda: (backend.data_parallel_rank, backend.data_parallel_world_size)  # noqa: E731
                if isinstance(obj.dataset, torch.utils.data.IterableDataset):
                    out[i] = PreparedStreamLoader(obj, topology, backend.device, self.seed, self.loaders,
                                                  self._gather_ints, backend.config.gradient_accumulation_steps)
                else:
                    out[i] = PreparedDataLoader(obj, topology, backend.device, self.seed, self.loaders)
            elif is_scheduler(obj):
                # The scheduler must drive the optimizer that steps: Horovod's DistributedOptimizer is
                # a new object, and load_state_dict() replaces param_groups, so a scheduler left on
                # the original optimizer would stop changing the learning rate after a resume.
                if id(obj.optimizer) in self.prepared_from:
                    obj.optimizer = self.prepared_from[id(obj.optimizer)]
                out[i] = PreparedScheduler(obj, self.sync)
            else:
                raise UnifiedDistError(
                    f"prepare() got a {type(obj).__name__}; it accepts torch.nn.Module, torch.optim.Optimizer, "
                    "LR schedulers and torch.utils.data.DataLoader")
        if replicas is not None:
            self.healable += [out[i] for i in order if isinstance(out[i], (torch.nn.Module, PreparedOptimizer,
                                                                           PreparedScheduler, PreparedDataLoader))]
            replicas.heal_with(self._replica_state, self._load_replica_state)
        return out

    def _gather_ints(self, values: List[int]) -> List[List[int]]:
        """Each data-parallel rank's ``values`` (the same length everywhere), in data-parallel rank order:
        what prepared streams exchange (one all_gather; tensor-parallel peers hold the same values)."""
        backend = self.backend
        mine = torch.tensor([values], dtype=torch.int64, device=backend.device)
        rows = collectives.all_gather(backend, mine, what="prepared stream (examples per rank)").cpu().tolist()
        tp = backend.world_size // backend.data_parallel_world_size
        return rows[::tp]

    def _prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        backend = self.backend
        if backend.config.sync_batchnorm:
            model = backend.convert_sync_batchnorm(
                model, gather=lambda t: collectives.all_gather(backend, t, what="SyncBatchNorm"),
                reduce_sum=lambda t: collectives.all_reduce(backend, t, "sum"))
        prepared = backend.prepare_model(model)
        if backend.config.compile:
            prepared = backend.compile_model(prepared)
        if not isinstance(prepared, pipeline.PipelinedModel):  # stages hold different buffers (none floating)
            self.sync.buffers.add(prepared)  # every rank starts from rank 0's buffers (unified_dist.training.buffers)
        return prepared

    def pipeline_step(self, model: Any, inputs: Any, targets: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        """``ud.pipeline_step``'s work (see the facade): the schedule's forward and backward, counted as
        ``ud.backward`` is, and the once-per-step exchange (non-finite loss, stop signals) after it."""
        if not isinstance(model, pipeline.PipelinedModel):
            raise PipelineError(f"pipeline_step needs a model that ud.prepare cut into pipeline stages (init(pp=2) or "
                                f"more); got {type(model).__name__}: train it with ud.backward(loss_fn(model(x), y))")
        self.sync.check_backward_context()
        self.sync.backward_calls += 1
        self.loaders.note_training()
        self._backward_seen = True
        loss = model.step(inputs, targets, loss_fn)
        if self.exchanges:
            self._exchange(torch.isfinite(loss).all() if self.backend.config.check_finite else None)
        return loss

    def pipeline_forward(self, model: Any, inputs: Any) -> torch.Tensor:
        """``ud.pipeline_forward``'s work (see the facade)."""
        if not isinstance(model, pipeline.PipelinedModel):
            raise PipelineError(f"pipeline_forward needs a model that ud.prepare cut into pipeline stages (init(pp=2) "
                                f"or more); got {type(model).__name__}: evaluate it with model(inputs)")
        return model.forward_only(inputs)

    # ------------------------------------------------------------------ training
    def backward(self, loss: torch.Tensor) -> None:
        """``ud.backward``'s work (see the facade).

        The non-finite check costs nothing on a micro-step that only accumulates: whether the loss is
        finite is kept on the device (no host sync, no collective), and once per optimizer step, on
        the micro-step that synchronises gradients and before its backward starts, one tiny
        all-reduce tells every rank which ranks saw a non-finite loss in the window (one host sync).
        """
        if not isinstance(loss, torch.Tensor):
            raise UnifiedDistError(f"backward() expects the loss tensor, got {type(loss).__name__}")
        self.sync.check_backward_context()
        self.sync.backward_calls += 1
        self.loaders.note_training()  # the current loader's pass is no peek (unified_dist.data.loaders.Epochs)
        self._backward_seen = True
        if self.backend.replicas is not None:
            current = self.loaders.current
            if current in self._evaluating:
                raise UnifiedDistError(
                    "ud.backward() in a pass of a prepared loader that replica groups take for an evaluation, as "
                    f"{self._evaluating[current]}: that pass is sharded over this group's ranks and holds no step's "
                    "quorum. Train with gradients on and the model in train mode (model.train() before the loop), "
                    "on one prepared training loader")
            self._training_loader = current
        if self.backend.config.check_finite:
            finite = torch.isfinite(loss.detach()).all()
            self._finite = finite if self._finite is None else self._finite & finite
        if self.sync.sync_gradients and self.exchanges:
            window, self._finite = self._finite, None
            self._exchange(window)
        self.backend.backward(loss, self.sync.loss_scaler(), self.sync.loss_weight())

    @property
    def exchanges(self) -> bool:
        """Whether the optimizer steps exchange flags (the non-finite check or stop signals are on):
        a setting, the same on every rank."""
        return self.backend.config.check_finite or bool(self.backend.config.stop_signals)

    def _exchange(self, finite: Optional[torch.Tensor]) -> None:
        """The once-per-optimizer-step exchange: one all-reduce of a world-long int32 vector in which
        each rank sets its own slot (bit 0: a loss of its window was NaN/inf, ``finite`` being a 0-d
        bool on the device or ``None``; bit 1: it received a stop signal). Reading it is the step's one
        host sync. Every rank then agrees to stop (:attr:`stop_step`), or raises :class:`NonFiniteLoss`
        naming the ranks and the step, before that step's backward starts."""
        backend = self.backend
        mine = torch.zeros(backend.world_size, dtype=torch.int32, device=backend.device)
        if finite is not None:
            mine[backend.rank] = (~finite).to(torch.int32)  # on the device: no host sync before the exchange
        if self.stops is not None and self.stops.pending:
            mine[backend.rank] += 2
        flags = collectives.all_reduce(backend, mine, "sum").tolist()  # the step's one host sync
        self._exchanged = True
        step = (self.optimizers[-1].steps_taken if self.optimizers else 0) + 1
        if self.stop_step is None and any(n & 2 for n in flags):
            self.stop_step = step
        bad = [r for r, n in enumerate(flags) if n & 1]
        if not bad:
            return
        raise NonFiniteLoss(
            f"loss is not finite on rank {', '.join(map(str, bad))} at optimizer step {step}: nothing was "
            "updated and earlier checkpoints are intact; lower the learning rate, clip gradients or check "
            "the inputs (UNIFIED_DIST_CHECK_FINITE=0 skips this check)")

    # ------------------------------------------------------------------ preemption
    def should_stop(self) -> bool:
        """``ud.should_stop``'s work (see the facade)."""
        if self.stops is None:
            return False
        self.stops.asked = True
        if self.stop_step is None and self._backward_seen is False and self._exchanged is False:
            self._exchange(None)  # a loop without ud.backward: this call is the exchange (on every rank)
        self._exchanged = self._backward_seen = False
        if self.stop_step is None:
            return False
        self.settle_saves()  # the job is about to stop: the save in flight ends first
        return True

    def settle_saves(self) -> None:
        """A settling point (:mod:`unified_dist.checkpoint.background`): when an async save is unsettled, wait
        for this rank's write and raise on every rank if any rank's failed (one all-gather); else nothing."""
        background_save.WRITER.settle(lambda mine: collectives.all_gather_object(self.backend, mine))

    def requeue(self) -> None:
        """``ud.requeue``'s work (see the facade)."""
        if self.stop_step is None:
            raise UnifiedDistError(
                "ud.requeue() runs the job again, which is right only after a stop signal, and ud.should_stop() "
                "is False here; a job that failed for another reason must end: let the exception propagate")
        backend = self.backend
        self.settle_saves()  # a background save ends before the job leaves
        collectives.barrier(backend)  # every rank has written its part of the checkpoint
        problem = None
        job = os.environ.get("SLURM_JOB_ID")
        if job and backend.rank == 0:
            problem = preemption.slurm_requeue(job)
        problem = collectives.broadcast(backend, problem, 0, what="requeue") if job else None
        if problem:
            raise UnifiedDistError(problem)
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(0 if job else preemption.REQUEUE_EXIT_CODE)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float) -> Optional[torch.Tensor]:
        """``ud.clip_grad_norm_``'s work (see the facade)."""
        if not self.sync.sync_gradients:
            return None
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        clipped = {id(p) for p in parameters}
        for optimizer in self.optimizers:  # only those that step these parameters: another optimizer's
            # averaging is not this clip's to wait for (under Horovod, finishing an idle optimizer's
            # averaging would send its parameters' gradients under the names this step's use)
            if any(id(p) in clipped for group in optimizer.param_groups for p in group["params"]):
                optimizer.synchronize()
        return self.backend.clip_gradients(parameters, max_norm, norm_type)

    def seed_everything(self, seed: int, per_rank: bool) -> int:
        """``ud.seed_everything``'s work (see the facade)."""
        self.seed = int(seed)
        value = self.seed + (self.backend.data_parallel_rank if per_rank else 0)
        random.seed(value)
        with contextlib.suppress(ImportError):
            import numpy

            numpy.random.seed(value % 2**32)
        torch.manual_seed(value)
        return value

    # ------------------------------------------------------------------ metrics
    def gather_for_metrics(self, x: Any) -> Any:
        """``ud.gather_for_metrics``'s work (see the facade)."""
        replicas = self.backend.replicas
        current = self.loaders.current
        if replicas is not None and replicas.layout.groups > 1 and current is not None \
                and current not in self._evaluating:
            raise UnifiedDistError(
                f"gather_for_metrics() in a training pass of a prepared loader under {replicas.layout.groups} replica "
                "groups would gather one group's share of the data only: evaluate with gradients off (torch.no_grad()) "
                "or the model in eval mode (model.eval()) when the pass begins; then each group evaluates the whole "
                "split over its own ranks")
        if not self.backend.gives_metric_rows:  # each row once (tensor-parallel peers, pipeline stages)
            x = collectives.map_each(x, lambda t: t.reshape(1)[:0] if t.dim() == 0 else t[:0], "gather_for_metrics")
        gathered = collectives.all_gather(self.backend, x, what="gather_for_metrics")
        if self.loaders.current is None:
            warn_once("gather_for_metrics() ran outside the loop of a prepared DataLoader: no padding to drop "
                      "there, so it returns every rank's rows, as ud.all_gather does. If every rank ran over the "
                      "whole evaluation set (a loader not given to ud.prepare), each example comes back "
                      "world_size times, and rows kept from a prepared loop keep its padding: prepare the "
                      "evaluation loader with ud.prepare(...) and call gather_for_metrics inside its loop")
        info = self.loaders.current_batch
        rows = info.kept_rows() if info is not None else None
        if rows is None:
            return gathered
        index = torch.tensor(rows, dtype=torch.long)

        def real_rows(t: torch.Tensor) -> torch.Tensor:  # torch indexes no uint16/uint32: select in the wire dtype
            if t.shape[0] != info.padded:
                return t
            return collectives.from_wire(collectives.to_wire(t).index_select(0, index.to(t.device)), t.dtype)
        return collectives.map_each(gathered, real_rows, "gather_for_metrics")


# ---------------------------------------------------------------------- the process's session
_session: Optional[Session] = None
_hooks_installed = False
_previous_excepthook: Any = None


def init(backend: Optional[str], given: Mapping[str, Any]) -> None:
    """``ud.init``'s work: ``given`` holds its keywords (``None``: not given); see the facade."""
    global _session
    if _session is not None:
        _check_same(_session, backend, given)
        _refuse_a_stack_started_later(_session)
        return
    settings.warn_unknown(os.environ, stacklevel=4)  # a misspelled UNIFIED_DIST_* variable would do nothing silently
    config = config_from(given, os.environ, torch.cuda.is_available())
    detection = detect(os.environ, backend, live.probe())
    if detection.problems:
        raise LaunchError(detection.problems[0])
    for message in detection.warnings:
        warnings.warn(f"unified_dist: {message}", UserWarning, stacklevel=3)
    name = detection.backend
    if name == "single" and replica_groups.layout_from(os.environ) is not None:
        name = "torch"  # a replica group of one process (python, srun -n 1) is a torch world of one: torchft needs it
    cls = backend_class(name)
    said = [setting for setting in DEEPSPEED_SETTINGS if config.value(setting) is not None]
    if not cls.reads_deepspeed_settings and said:
        raise UnifiedDistError(f"{said[0]}={config.value(said[0])!r} is the deepspeed backend's setting and {cls.name} "
                               "would ignore it; add backend='deepspeed' (UNIFIED_DIST_BACKEND=deepspeed), or drop it")
    refusal = replica_groups.refuse_layout(os.environ, config, cls.name, detection.launcher)
    if refusal:
        raise UnifiedDistError(refusal)
    if config.sharding.pp > 1 and (not cls.supports_pipeline or replica_groups.layout_from(os.environ) is not None):
        raise PipelineError(
            f"pp={config.sharding.pp} runs on the torch backend only (torchrun, srun, mpirun), without replica "
            f"groups; {detection.launcher} runs the {cls.name} backend"
            f"{' with replica groups' if cls.supports_pipeline else ''}: launch with torchrun, or leave pp=1")
    if config.sharding.splits_model and not cls.supports_sharding:
        what = "sharding='fsdp'" if config.sharding.enabled else f"tp={config.sharding.tp}"
        raise UnifiedDistError(
            f"{what} needs torch.distributed, and {detection.launcher} runs the {cls.name} backend, which "
            "has no sharding or tensor parallelism; launch with torchrun, accelerate launch, srun or mpirun, "
            "or leave sharding='no' and tp=1")
    instance = cls(detection, config)
    loaders = LoaderStack()
    _session = Session(instance, detection, GradientSync(instance, loaders), loaders)
    if instance.replicas is not None:
        loaders.before_batch = _session.begin_replica_step  # the quorum, and any healing, before the batch
        loaders.pass_topology = _session._replica_pass_topology  # an evaluation pass: the group's own ranks
        loaders.pass_ended = _session.end_replica_pass
    if config.stop_signals:
        _session.stops = preemption.StopSignals(config.stop_signals)
        _session.stops.install()
    _install_exit_hooks()


def _check_same(session: Session, backend: Optional[str], given: Mapping[str, Any]) -> None:
    """A second ``init``: refuse another backend, or a keyword whose value differs from the running one."""
    current = session.backend
    if backend is not None and backend != current.name:
        raise UnifiedDistError(
            f"unified_dist is already running backend {current.name!r}; call ud.shutdown() before init({backend!r})")
    for name, value in given.items():
        if value is None:
            continue
        wanted, running = settings.TABLE[name].from_code(value), current.config.value(name)
        if wanted != running:
            raise UnifiedDistError(
                f"init() was already called with {name}={running!r}; call ud.init({name}={value!r}) before any "
                "other ud function, or ud.shutdown() first")


def _refuse_a_stack_started_later(session: Session) -> None:
    """A one-process session must not outlive the start of a real stack: a ``ud`` call made before
    ``dist.init_process_group``/``hvd.init()``/``PartialState()`` started one process, and its collectives
    would now answer for this rank alone, silently. Refused; distributed sessions are not probed."""
    if session.backend.name != "single":
        return
    found = live.probe()
    if found is not None:
        raise UnifiedDistError(
            f"unified_dist started as one process (a ud call came first), but {found.stack} was initialised "
            f"after it with {found.world_size} process(es); call ud.init() after {found.stack}'s init, before "
            "any other ud function, or ud.shutdown() first")


def current() -> Session:
    """The session, initialised with defaults on first use. A one-process session refuses to go on once a
    stack was initialised after it (see :func:`_refuse_a_stack_started_later`)."""
    if _session is None:
        init(None, {})
    else:
        _refuse_a_stack_started_later(_session)
    assert _session is not None
    return _session


def current_backend() -> Backend:
    """The session's backend (initialising with defaults if needed)."""
    return current().backend


def shutdown() -> None:
    """Leave the process group; a later call to any function initialises again."""
    global _session
    if _session is not None:
        if _session.backend.replicas is not None:  # after the last step nothing is timed (replica groups)
            _session.backend.replicas.disarm()
        failure = None
        try:
            _session.settle_saves()  # the save in flight is written, and its failure known, before the group goes
        except UnifiedDistError as exc:
            failure = exc
        session, _session = _session, None
        background_save.WRITER.forget()
        if session.stops is not None:
            session.stops.uninstall()
        with collectives.translated(session.backend, "shutdown"):  # its barrier: a rank still training times out
            session.backend.shutdown()
        if session.stops is not None:  # a signal held for a program that never asked acts at the session's end
            session.stops.release_held()
        if failure is not None:
            raise failure


def _install_exit_hooks() -> None:
    """Once per process: the ``atexit`` handler, and :func:`_note_failure` as ``sys.excepthook``
    in front of the hook current now. A hook the user installs later replaces ours and is kept."""
    global _hooks_installed, _previous_excepthook
    if _hooks_installed:
        return
    _hooks_installed = True
    atexit.register(_shutdown_at_exit)
    _previous_excepthook = sys.excepthook
    sys.excepthook = _note_failure


def _note_failure(exc_type: Any, exc: Any, tb: Any) -> None:
    """Mark the session failed (so :func:`_shutdown_at_exit` frees nothing), then call the hook
    that was ``sys.excepthook`` when ours was installed."""
    if _session is not None:
        _session.failed = True
    (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)


def _shutdown_at_exit() -> None:
    """At a clean interpreter exit, free DDP reducers and the process group unified_dist created
    (no communication): see :meth:`Backend.leave_at_exit`. A background save still in flight is
    written first; if it failed (and no settling point said so), one line on standard error and exit status 1.

    Skipped after an uncaught exception: a reducer with a collective still pending on a lost
    peer cannot be freed, and the launcher must see this process end.
    """
    if _session is not None and _session.backend.replicas is not None:  # no step is timed at the exit
        _session.backend.replicas.disarm()
    failed_write = background_save.report_at_exit()  # the write in flight ends first
    if _session is not None and not _session.failed:
        with contextlib.suppress(Exception):
            _session.backend.leave_at_exit()
    if _session is not None and _session.stops is not None:  # a held signal the program never asked about
        _session.stops.release_held()
    if failed_write:  # a checkpoint the program believes written is not: the exit status says so
        os._exit(1)
