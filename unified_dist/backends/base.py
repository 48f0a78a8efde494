"""The Backend protocol: the few primitives each distributed stack must provide.

Everything user-facing (nested inputs, ``op="mean"``, uneven ``all_gather``, accumulation
rules, checkpoints) is built once on top of these primitives, so it means the same on every
backend. A backend only says *how* its library does each primitive.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
from abc import ABC, abstractmethod
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, ContextManager, List, Optional, Tuple

import torch

from ..compat import DDP_WITHOUT_BUFFER_SYNC
from ..detection import Detection
from ..errors import PeerLost, UnifiedDistError, collective_timeout, peer_lost_message
from ..parallel import sync_batchnorm
from ..parallel.mesh import Layout
from ..parallel.pipeline import PipelinedModel
from ..parallel.sharding import KEYWORDS as SHARDING_KEYWORDS, Sharding, clip_grad_norm, full_tensor
from ..settings import TABLE
from .precision import Precision

# torch.distributed raises DistBackendError/RuntimeError for everything gloo and nccl report: the
# text is the only witness of a timeout or of a peer's closed connection.
_TIMEOUT_WORDS = ("timed out", "timeout", "deadline exceeded", "stalled")
_PEER_WORDS = ("connection closed by peer", "connection reset", "broken pipe", "connection refused",
               "socket closed")

REDUCE_OPS = ("sum", "mean", "max", "min")
"""What ``all_reduce`` accepts."""
PRIMITIVE_OPS = tuple(op for op in REDUCE_OPS if op != "mean")
"""Reductions every backend implements; ``mean`` is ``sum`` divided by world size."""


DDP_BUFFER_KWARGS = DDP_WITHOUT_BUFFER_SYNC
"""What DistributedDataParallel is built with (or, under Accelerate, set to on the wrapper it made:
:func:`stop_ddp_buffer_sync`): no broadcast of buffers before each synchronising forward; the facade
gives every rank rank 0's buffers after each optimizer step instead (:mod:`unified_dist.training.buffers`).
Which keyword that is depends on the torch release: :data:`unified_dist.compat.DDP_WITHOUT_BUFFER_SYNC`."""


def stop_ddp_buffer_sync(model: torch.nn.Module) -> torch.nn.Module:
    """Turn off a ``DistributedDataParallel``'s broadcast of buffers before each forward, as
    :data:`DDP_BUFFER_KWARGS` does at construction (Accelerate's ``DistributedDataParallelKwargs`` has
    no ``forward_sync_buffers``). Returns ``model``; anything but DDP is returned untouched."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        for name, value in DDP_BUFFER_KWARGS.items():
            setattr(model, name, value)
    return model
DEFAULT_TIMEOUT_S = float(TABLE["timeout"].default)
"""Seconds a collective may take when neither ``init(timeout=...)`` nor ``UNIFIED_DIST_TIMEOUT`` says."""


@dataclass(frozen=True)
class Config:
    """Settings resolved by ``init`` and handed to the backend's constructor: one field per
    ``init`` keyword of :data:`unified_dist.settings.TABLE` (defaults the table's), except that
    ``sharding`` holds the sharding keywords together and ``timeout`` is a ``timedelta``
    (``tests/unit/test_settings.py`` checks that the two agree)."""

    mixed_precision: str = TABLE["mixed_precision"].default
    gradient_accumulation_steps: int = TABLE["gradient_accumulation_steps"].default
    timeout: datetime.timedelta = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)
    debug: bool = TABLE["debug"].default
    sharding: Sharding = Sharding()
    sync_batchnorm: bool = TABLE["sync_batchnorm"].default
    gradient_compression: Optional[str] = TABLE["gradient_compression"].default  # see unified_dist.backends.compression
    bucket_mb: Optional[float] = TABLE["bucket_mb"].default  # MiB per fused reduction (unified_dist.backends.buckets)
    bucket_view: bool = TABLE["bucket_view"].default  # DDP's gradient_as_bucket_view (unified_dist.backends.buckets)
    check_finite: bool = TABLE["check_finite"].default  # ud.backward's NaN/inf check
    compile: Optional[str] = TABLE["compile"].default  # torch.compile backend ud.prepare uses (None: off)
    compile_mode: str = TABLE["compile_mode"].default  # torch.compile's mode
    stop_signals: Tuple[str, ...] = TABLE["stop_signals"].default  # what ud.should_stop() listens to
    zero_stage: Optional[int] = TABLE["zero_stage"].default  # the deepspeed backend's ZeRO stage (None: not said)
    deepspeed_config: Optional[str] = TABLE["deepspeed_config"].default  # a DeepSpeed config file (deepspeed backend)
    offload_optimizer: Optional[str] = TABLE["offload_optimizer"].default  # ZeRO-Offload's device (deepspeed backend)
    offload_param: Optional[str] = TABLE["offload_param"].default  # ZeRO-3's parameter offload device (deepspeed)
    gradient_clipping: Optional[float] = TABLE["gradient_clipping"].default  # DeepSpeed's clip in its step (deepspeed)

    def value(self, name: str) -> Any:
        """The value of setting ``name`` as ``init`` takes it (the sharding keywords from
        ``sharding``, the timeout in seconds)."""
        if name == "timeout":
            return self.timeout.total_seconds()
        if name in SHARDING_KEYWORDS:
            return self.sharding.field(name)
        return getattr(self, name)


DEEPSPEED_SETTINGS = ("zero_stage", "deepspeed_config", "offload_optimizer", "offload_param", "gradient_clipping")
"""The settings only the deepspeed backend reads (another backend would ignore them, so it refuses them)."""


def weighted(loss: torch.Tensor, weight: Fraction) -> torch.Tensor:
    """``loss * weight`` with as few roundings as the fraction allows (``1/k`` divides once)."""
    if weight == 1:
        return loss
    if weight.numerator == 1:
        return loss / weight.denominator
    return loss * weight.numerator / weight.denominator


class Backend(ABC):
    """One distributed stack. Constructing it joins the process group; ``shutdown`` leaves it."""

    name: str = "?"
    replicas: Any = None
    """The replica groups this process trains with (a :class:`~unified_dist.backends.replica_groups.ReplicaGroups`,
    torch backend only), or ``None``: no fault tolerance across groups."""
    supports_sharding: bool = True
    """Whether ``sharding="fsdp"`` can run on this stack (Horovod has no sharding)."""
    supports_pipeline: bool = False
    """Whether ``pp > 1`` can run on this stack (torch's own backend only: :mod:`unified_dist.parallel.pipeline`)."""
    reads_deepspeed_settings: bool = False
    """Whether this stack honours :data:`DEEPSPEED_SETTINGS` (the others refuse them at ``init``)."""
    zero_stage: Optional[int] = None
    """The ZeRO stage this stack shards with (the deepspeed backend: 0-3), ``None`` on stacks without ZeRO."""

    def __init__(self, detection: Detection, config: Config) -> None:
        self.detection = detection
        self.config = config

    def leave_at_exit(self) -> None:
        """At a clean interpreter exit, without communicating: free what the library's threads hold
        while Python is still whole (backends that own DDP reducers or a process group free them
        too, see :mod:`unified_dist.backends.ddp_lifetime`). This default collects garbage."""
        gc.collect()

    # ----------------------------------------------------------------- identity
    @property
    @abstractmethod
    def rank(self) -> int:
        """Global rank of this process, 0 .. world_size-1."""

    @property
    @abstractmethod
    def local_rank(self) -> int:
        """Rank of this process on its own machine."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of processes in the job."""

    @property
    def device(self) -> torch.device:
        """The device this process computes on: its local GPU if there is one, else the CPU."""
        return self.device_for(self.local_rank)

    @property
    def layout(self) -> Layout:
        """How the ranks split the model (:mod:`unified_dist.parallel.mesh`); here every rank a data-parallel one."""
        return Layout(1, self.world_size, 1)

    @property
    def device_mesh(self) -> Any:
        """The torch ``DeviceMesh`` of :attr:`layout` (``None`` without sharding or tensor parallelism)."""
        return None

    @property
    def data_parallel_rank(self) -> int:
        """This rank's index among the ranks that see different data (its tensor-parallel peers share it)."""
        return self.layout.data_parallel_rank(self.rank)

    @property
    def data_parallel_world_size(self) -> int:
        """How many ranks see different data: the world size over the tensor-parallel size."""
        return self.layout.data_parallel

    @property
    def participating_world_size(self) -> int:
        """The data-parallel ranks whose gradients the latest optimizer step averaged: the data-parallel
        world size, except with replica groups (:mod:`unified_dist.backends.replica_groups`), where a
        group that is down does not take part."""
        return self.data_parallel_world_size

    @property
    def tp_rank(self) -> int:
        """This rank's index among its tensor-parallel peers (0 without tensor parallelism)."""
        return self.layout.tp_rank(self.rank)

    @property
    def gives_metric_rows(self) -> bool:
        """Whether this rank's rows count in ``gather_for_metrics``, so that each row counts once: a tensor-parallel
        group's rank 0 (its peers hold the same rows), and under pipeline parallelism on the last stage only (every
        stage reads the same batches; the last holds the outputs)."""
        layout = self.layout
        return self.tp_rank == 0 and layout.pp_rank(self.rank) == layout.pp - 1

    @staticmethod
    def device_for(local_rank: int) -> torch.device:
        """The device of the process with ``local_rank`` on its machine (GPU ``local_rank % count``, or CPU)."""
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")

    @property
    def communicates_at_prepare(self) -> bool:
        """Whether ``prepare`` may run collectives now (not in an elastic job whose late joiners
        meet the others only in ``elastic_run``'s state sync)."""
        return True

    def shutdown(self) -> None:  # noqa: B027 - optional hook, no-op by default
        """Leave the process group; the backend is unusable afterwards."""

    # ----------------------------------------------------------------- preparation
    @abstractmethod
    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to :attr:`device` and make its gradients averaged across ranks."""

    def convert_sync_batchnorm(self, model: torch.nn.Module, gather: sync_batchnorm.Gather,
                               reduce_sum: sync_batchnorm.ReduceSum) -> torch.nn.Module:
        """``model`` with every BatchNorm1d/2d/3d computing batch statistics over the global batch
        (``init(sync_batchnorm=True)``); a stack's own implementation where one runs on this device
        (CUDA), else the portable :mod:`unified_dist.parallel.sync_batchnorm` communicating through ``gather``
        and ``reduce_sum`` (the caller's collectives over this backend). Unchanged for one process."""
        if self.world_size == 1:
            return model
        if self.device.type == "cuda":
            return self.cuda_sync_batchnorm(model)
        return sync_batchnorm.convert(
            model, sync_batchnorm.portable(gather, reduce_sum, lambda: (self.rank, self.world_size)))

    def cuda_sync_batchnorm(self, model: torch.nn.Module) -> torch.nn.Module:
        """:meth:`convert_sync_batchnorm` for CUDA modules: torch's ``SyncBatchNorm`` (its own
        kernels over the default process group, CUDA only). A stack with its own class overrides."""
        return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)

    def about_to_prepare(self, objs: tuple) -> None:  # noqa: B027 - optional hook, no-op by default
        """Told every object of one ``ud.prepare`` call before any is prepared (DeepSpeed builds a model and its
        optimizer into one engine). This default does nothing."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        """Return the optimizer that must be stepped (may be ``optimizer`` itself)."""
        return optimizer

    def clip_gradients(self, parameters: List[torch.Tensor], max_norm: float, norm_type: float) -> torch.Tensor:
        """Clip the final (averaged, unscaled) gradients of ``parameters`` to total norm ``max_norm``; return that
        norm as a plain tensor, also when the parameters are sharded."""
        return full_tensor(clip_grad_norm(parameters, max_norm, norm_type))

    def checkpoint_problem(self, action: str) -> Optional[str]:
        """Why ``action`` (``"save"``: write a model's weights in the portable format; ``"load"``: load them into
        a prepared model; ``"save_sharded"``/``"load_sharded"``: the same per rank) cannot be done right now, in one
        line (``None``: it can)."""
        return None

    def optimizer_checkpoint_problem(self, action: str) -> Optional[str]:
        """Why an optimizer's state cannot be ``action``-ed (``"save"``/``"load"``) in the portable format right now,
        in one line (``None``: it can)."""
        return None

    def optimizer_state_dict(self, optimizer: torch.optim.Optimizer) -> dict:
        """``optimizer``'s state in torch's positional layout over the whole model (``optimizer.state_dict()``); its
        tensors may still be shards (DTensors), which the caller gathers. A collective where
        :attr:`saves_collectively`."""
        return optimizer.state_dict()

    def load_optimizer_state_dict(self, optimizer: torch.optim.Optimizer, state: dict, source: str) -> None:
        """Load ``state`` (torch's positional layout over the whole model, from ``source``) into ``optimizer``: every
        rank passes the same and keeps its own part (``optimizer.load_state_dict``)."""
        optimizer.load_state_dict(state)

    @property
    def saves_collectively(self) -> bool:
        """Whether the portable state of a prepared model or optimizer is gathered from every rank, so that
        ``ud.save`` is a collective (every rank calls it; only the main process writes)."""
        return self.config.sharding.splits_model

    def model_state_dict(self, model: torch.nn.Module) -> dict:
        """``model``'s state dict by parameter name, unwrapped; its tensors may still be shards (DTensors), which
        the caller gathers. A collective where :attr:`saves_collectively`."""
        return self.unwrap(model).state_dict()

    def load_model_state_dict(self, model: torch.nn.Module, state: dict, strict: bool) -> None:
        """Load a full state dict (by parameter name) into ``model``, prepared or not: every rank passes the same
        ``state`` and keeps its own part of it (``load_state_dict(strict=strict)``)."""
        self.unwrap(model).load_state_dict(state, strict=strict)

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """The user's original module inside whatever wrappers :meth:`prepare_model` and
        ``torch.compile`` (before or after ``prepare``) added, in any order."""
        while True:
            if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel, PipelinedModel)):
                model = model.module
            elif isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):  # torch.compile's wrapper
                model = model._orig_mod
            else:
                return model

    def compile_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Compile a prepared ``model`` in place as ``config.compile`` says (:mod:`unified_dist.parallel.compiling`):
        by :meth:`compile_regions` when there are any, else whole."""
        from ..parallel.compiling import compile_in_place

        return compile_in_place(model, self.config.compile, self.config.compile_mode, self.compile_regions(model))

    def compile_regions(self, model: torch.nn.Module) -> Optional[List[torch.nn.Module]]:
        """The blocks to compile one by one (``None``: the whole model; sharded models override)."""
        return None

    # ----------------------------------------------------------------- training
    def backward(self, loss: torch.Tensor, scaler: Optional[Any] = None, weight: Fraction = Fraction(1)) -> None:
        """Backpropagate ``loss * weight`` (scaled by ``scaler`` for fp16); the gradient averaging
        across ranks then gives the step's exact gradient (see :mod:`unified_dist.training.accumulation`)."""
        loss = weighted(loss, weight)
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def finalize_gradients(self, optimizer: torch.optim.Optimizer, scaler: Optional[Any]) -> None:
        """Make the gradients ``optimizer`` will apply final (averaged across ranks, unscaled from
        fp16 loss scaling), so the user can read or clip them; called at most once per step."""
        if scaler is not None:
            scaler.unscale_(optimizer)

    def step_context(self, optimizer: torch.optim.Optimizer, finalized: bool) -> ContextManager:
        """Context around ``optimizer.step()``; ``finalized``: :meth:`finalize_gradients` ran this step."""
        return contextlib.nullcontext()

    def average_buffers_across_groups(self, buffers: List[torch.Tensor]) -> None:  # noqa: B027 - optional hook
        """Inside a step, before its commit decision, with replica groups: make the floating-point ``buffers``
        (BatchNorm's statistics) the average over the groups taking part, so every group evaluates alike.
        Elsewhere nothing (a job has one group)."""

    def commit_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Asked right before ``optimizer`` steps: whether this step's update may be applied. Always, except
        with replica groups, where a step during which a group failed is dropped on every group."""
        return True

    def release_gradients(self, optimizer: torch.optim.Optimizer) -> None:  # noqa: B027 - optional hook
        """Called before the facade zeroes ``optimizer``'s gradients (whether or not it stepped): a
        stack that averages asynchronously finishes what is in flight here. This default does nothing."""

    def no_sync(self, model: torch.nn.Module) -> ContextManager:
        """Context in which backward passes accumulate locally without communicating."""
        return contextlib.nullcontext()

    def set_sync_gradients(self, sync: bool) -> None:  # noqa: B027 - optional hook, no-op by default
        """Told before each micro-step whether its backward is the one that synchronises."""

    @property
    def precision(self) -> Precision:
        """The configured mixed precision (:class:`~unified_dist.backends.precision.Precision`)."""
        return Precision(self.config.mixed_precision)

    def autocast(self) -> ContextManager:
        """Autocast context for the configured mixed precision (no-op for ``"no"``)."""
        return self.precision.autocast(self.device.type)

    def native_loss_scaler(self) -> Optional[Any]:
        """The ``GradScaler`` the library keeps and applies itself (Accelerate's), else ``None``."""
        return None

    def make_grad_scaler(self) -> Optional[Any]:
        """A gradient scaler when fp16 needs one, else ``None``."""
        return self.precision.grad_scaler(self.device.type)

    # ----------------------------------------------------------------- elastic
    def elastic_commit(self, state: Any) -> None:
        """Make ``state`` (an ``ElasticState``) the restore point: here, its checkpoint on disk.

        torchrun/accelerate restart every process after a failure, and a new ElasticState
        loads the newest checkpoint.
        """
        state.save_checkpoint()

    def elastic_run(self, fn: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(state, ...)``; recovery from a lost process is the launcher's restart here."""
        return fn(state, *args, **kwargs)

    # ----------------------------------------------------------------- primitives
    @abstractmethod
    def all_reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        """Reduce ``tensor`` (a private copy, may be modified) with op in :data:`PRIMITIVE_OPS`; return the result."""

    @abstractmethod
    def all_gather_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape on all ranks) stacked on a new dim 0, in rank order."""

    gathers_uneven: bool = False
    """True when the library gathers tensors whose dim 0 differs between ranks itself, keeping no
    state between calls (:meth:`all_gather_uneven`). Otherwise the collectives layer builds that
    gather from :meth:`all_gather_equal` and :meth:`broadcast_` (:mod:`unified_dist.collectives.uneven_gather`)."""

    def all_gather_uneven(self, tensor: torch.Tensor) -> Optional[torch.Tensor]:
        """Only where :attr:`gathers_uneven`: every rank's ``tensor`` (at least 1-d; dim 0 may differ)
        concatenated along dim 0 in rank order. Mismatched trailing dims or dtypes raise
        :class:`~unified_dist.errors.ShapeMismatch` on every rank. Elsewhere ``None`` (nothing sent)."""
        return None

    @abstractmethod
    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Rank ``src``'s ``tensor`` (a private copy, may be modified) on every rank."""

    @abstractmethod
    def broadcast_object(self, obj: Any, src: int) -> Any:
        """Rank ``src``'s picklable ``obj`` on every rank."""

    def translate_error(self, exc: BaseException, what: str) -> Optional[UnifiedDistError]:
        """What the library's ``exc``, raised during collective ``what``, means to the user:
        a :class:`CollectiveTimeout`, a :class:`PeerLost`, or ``None`` to let ``exc`` through.

        This default reads torch.distributed's error text (gloo and nccl give no finer types).
        """
        text = f"{type(exc).__name__}: {exc}".lower()
        if any(word in text for word in _TIMEOUT_WORDS):
            return collective_timeout(what, self.rank, int(self.config.timeout.total_seconds()), exc)
        if any(word in text for word in _PEER_WORDS):
            return PeerLost(peer_lost_message(what, self.rank, exc))
        return None

    @abstractmethod
    def barrier(self) -> None:
        """Return only when every rank has called it."""

    def missing_peers(self, name: str, seconds: float) -> List[int]:
        """Without a collective: this rank says it reached the ``name`` point (its n-th time);
        rank 0 then waits up to ``seconds`` for the other ranks to say the same and returns
        those that did not (ranks > 0 return ``[]`` at once). Lets rank 0 tell "called on the main
        process only" from "the others are on their way" before it enters a collective that would
        hang. This default, for stacks without a side channel, reports nobody missing."""
        return []
