"""Horovod (``horovod.torch``), as started by ``horovodrun``."""
from __future__ import annotations

import functools
import os
import pickle
import time
from fractions import Fraction
from typing import Any, List, Optional

import torch

from ..detection import Detection
from ..errors import (
    BackendNotInstalled,
    LaunchError,
    PeerLost,
    ShapeMismatch,
    UnifiedDistError,
    deadline_passed,
    first_line,
    peer_lost_message,
)
from ..parallel import sync_batchnorm
from ..registry import SPECS
from . import horovod_rendezvous
from .base import Backend, Config
from .buckets import HOROVOD_CYCLE_VAR, HOROVOD_VAR, horovod_env
from .process_group import put_back_environ

_NEVER = 2**62
_STARTS: List[dict] = []
"""Each ``hvd.init()`` with peers this process's Horovod backends made: whether a cycle time and a fusion threshold
were set (read by :func:`_refuse_a_start_that_aborts`)."""


def _refuse_a_start_that_aborts(environ: Any) -> None:
    """Horovod 0.28.1 aborts the process (SIGSEGV, or SIGABRT in gloo) in a second ``hvd.init()`` when an earlier
    start had ``HOROVOD_CYCLE_TIME`` set and that start or this one a ``HOROVOD_FUSION_THRESHOLD``; with the cycle
    alone, the threshold alone, or the threshold before the cycle, it starts again (horovodrun -np 2 --gloo, each
    order run twice, 2026-11-29). The facade sets the cycle on CPU hosts, and ``bucket_mb`` the threshold:
    refused in one line here rather than crashing."""
    fusion_now = bool(environ.get(HOROVOD_VAR, "").strip())
    if any(start["cycle"] and (start["fusion"] or fusion_now) for start in _STARTS):
        raise LaunchError(
            f"Horovod cannot start again in this process: after a Horovod with {HOROVOD_CYCLE_VAR} set, a second "
            f"hvd.init() with {HOROVOD_VAR} (bucket_mb) set at either start aborts the process (Horovod 0.28.1); "
            "run the next ud.init() in a new process, or leave bucket_mb unset")
"""A hook delay no run reaches: Horovod's hook counts it down and sends nothing (accumulating micro-steps)."""


@functools.lru_cache(maxsize=None)
def _horovod_peer_lost(horovod_internal_error: type) -> type:
    """:class:`PeerLost` that Horovod's elastic machinery also recognises as its own error."""
    return type("PeerLost", (PeerLost, horovod_internal_error),
                {"__module__": PeerLost.__module__, "__doc__": PeerLost.__doc__})


# What Horovod 0.28.1's torch ops refuse ("Tensor type torch.BoolTensor is not supported."), probed on
# its CPU/gloo build: allreduce takes int32, int64, float16, float32, float64 only; allgather and
# broadcast take uint8, int8 and int16 too; none takes bool or bfloat16.
_REDUCE_AS = {torch.bool: torch.int32, torch.uint8: torch.int32, torch.int8: torch.int32,
              torch.int16: torch.int32, torch.bfloat16: torch.float32}
_MOVE_AS = {torch.bool: torch.uint8, torch.bfloat16: torch.int16}


def wire_dtype(dtype: torch.dtype, op: str) -> torch.dtype:
    """The dtype a ``dtype`` tensor travels in through Horovod's ``op`` ("reduce", "gather" or
    "broadcast"); ``dtype`` itself where Horovod takes it.

    The contract: every result has the caller's dtype and the value torch.distributed (gloo) gives
    for that dtype. ``reduce`` converts with ``.to`` (values): bool, uint8, int8 and int16 reduce
    in int32, so max/min are exact and the sum, converted back, wraps modulo 2**bits as gloo's
    narrow-type sum does (a bool sum is "any", as on gloo; :func:`unified_dist.collectives.ops.all_reduce`
    counts Trues by summing int64); bfloat16 reduces in float32, max/min exact and the sum rounded
    once at the end (gloo rounds after each addition: the same for two ranks and whenever the
    partial sums are representable). ``gather`` and ``broadcast`` only move bytes: bool travels as
    uint8 and bfloat16 as int16, reinterpreted bit for bit with ``.view`` (exact), with one trailing
    dim of size 1 so that Horovod's shape check still refuses a rank that sent real uint8/int16.
    """
    return (_REDUCE_AS if op == "reduce" else _MOVE_AS).get(dtype, dtype)


def _send_as(tensor: torch.Tensor, op: str) -> torch.Tensor:
    """``tensor`` as it travels through Horovod's ``op`` (:func:`wire_dtype`)."""
    wire = wire_dtype(tensor.dtype, op)
    if wire == tensor.dtype:
        return tensor
    return tensor.to(wire) if op == "reduce" else tensor.view(wire).unsqueeze(-1)


def _received_as(out: torch.Tensor, dtype: torch.dtype, op: str) -> torch.Tensor:
    """What Horovod returned for a ``dtype`` tensor sent with :func:`_send_as`, back in ``dtype``."""
    if out.dtype == dtype:
        return out
    return out.to(dtype) if op == "reduce" else out.squeeze(-1).view(dtype)


def _import_horovod():
    try:
        import horovod.torch as hvd
    except ImportError as exc:
        raise BackendNotInstalled(
            f"backend 'horovod' needs horovod.torch ({exc}); build it against this torch with "
            "`make setup` (runs tools/build_horovod.sh) or `pip install unified_dist[horovod]`") from None
    return hvd


def _make_horovod_state(backend: "HorovodBackend", outer: Any) -> Any:
    """A ``horovod.common.elastic.State`` whose save/restore/sync act on an ``ElasticState``."""
    from horovod.common.elastic import State

    class _State(State):
        def __init__(self) -> None:
            super().__init__(bcast_object=lambda obj: backend.broadcast_object(obj, 0), get_rank=backend.hvd.rank)
            self._saved: Any = None  # no collective here: a late joiner meets the others in sync()

        def save(self) -> None:
            self._saved = outer.snapshot()

        def restore(self) -> None:
            if self._saved is not None:
                outer.apply(self._saved)

        def sync(self) -> None:  # after a (re)start: everyone takes rank 0's state, keeps its own RNG
            outer.apply(backend.broadcast_object(outer.snapshot(), 0), restore_rng=False)
            self.save()

    return _State()


class HorovodBackend(Backend):
    """Drives ``horovod.torch``: parameter/optimizer-state broadcast and ``DistributedOptimizer``."""

    name = "horovod"
    supports_sharding = SPECS["horovod"].sharding  # the backend's record says it
    gathers_uneven = True  # its coordinator exchanges dim 0 while negotiating; no state between calls

    def __init__(self, detection: Detection, config: Config) -> None:
        super().__init__(detection, config)
        self.hvd = _import_horovod()
        self.compressor()  # an unsupported format fails before anyone joins
        seconds = max(1, int(config.timeout.total_seconds()))
        # what this backend sets for hvd.init() it takes back at shutdown (the process's next backend finds
        # the variables as the launch left them): the name -> the value before, None where unset
        self._set_before = {"HOROVOD_GLOO_TIMEOUT_SECONDS": os.environ.get("HOROVOD_GLOO_TIMEOUT_SECONDS")}
        self._owns_horovod = not self.hvd.is_initialized()  # a user's own hvd.init() stays running
        # read by hvd.init(); a Horovod the user started keeps the cycle it started with
        on_cpu = self.device_for(0).type == "cpu"
        wanted = horovod_env(config.bucket_mb, os.environ, on_cpu=on_cpu and self._owns_horovod)
        already = os.environ.get(HOROVOD_VAR)
        if not self._owns_horovod and wanted.get(HOROVOD_VAR, already) != already:
            raise UnifiedDistError(
                f"bucket_mb={config.bucket_mb:g} cannot reach the Horovod your code started with hvd.init(): "
                f"it read its fusion buffer then; set {HOROVOD_VAR}={wanted[HOROVOD_VAR]} before hvd.init(), "
                "or drop bucket_mb")
        # with peers (the abort was seen with 2 processes), before any variable is set or anyone is joined
        with_peers = self._owns_horovod and detection.world_size > 1
        if with_peers:
            _refuse_a_start_that_aborts({**os.environ, **wanted})
        os.environ.setdefault("HOROVOD_GLOO_TIMEOUT_SECONDS", str(seconds))
        self._set_before.update({name: os.environ.get(name) for name in wanted if name not in self._set_before})
        os.environ.update(wanted)
        self._exported: dict = {}
        if detection.master_addr is not None:  # another launcher's processes: Horovod meets them by itself
            self._exported = horovod_rendezvous.join(detection, config.timeout)
        if with_peers:
            _STARTS.append({"cycle": bool(os.environ.get(HOROVOD_CYCLE_VAR, "").strip()),
                            "fusion": bool(os.environ.get(HOROVOD_VAR, "").strip())})
        self.hvd.init()
        self._distributed: List[Any] = []  # the DistributedOptimizers made, in order (their names differ)
        self._syncing = True  # whether the current micro-step's backward averages (set_sync_gradients)
        if torch.cuda.is_available():
            torch.cuda.set_device(self.device)

    @property
    def rank(self) -> int:
        return self.hvd.rank()

    @property
    def local_rank(self) -> int:
        return self.hvd.local_rank()

    @property
    def world_size(self) -> int:
        return self.hvd.size()

    def shutdown(self) -> None:
        """Ends the Horovod this backend started (one the user started keeps running) and puts back the
        variables it set for ``hvd.init()``."""
        if self._owns_horovod:
            self.hvd.shutdown()
        horovod_rendezvous.withdraw(self._exported)
        put_back_environ(self._set_before)

    @property
    def elastic(self) -> bool:
        """Started by an elastic horovodrun (--min-np/--max-np): state is synced by ElasticState."""
        return os.environ.get("HOROVOD_ELASTIC") == "1"

    @property
    def communicates_at_prepare(self) -> bool:
        # In an elastic job a worker that joins late must not run collectives before
        # elastic_run's sync (the others are in it): ElasticState broadcasts the state there.
        return not self.elastic

    def prepare_model(self, model: torch.nn.Module) -> torch.nn.Module:
        model = model.to(self.device)
        if self.communicates_at_prepare:
            self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        return model

    def cuda_sync_batchnorm(self, model: torch.nn.Module) -> torch.nn.Module:
        # hvd.SyncBatchNorm (refuses CPU tensors, hence only here) averages over Horovod's ranks
        return sync_batchnorm.convert(model, sync_batchnorm.sharing(self.hvd.SyncBatchNorm))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        hvd = self.hvd
        # horovod's broadcast_optimizer_state() initialises an *empty* state by stepping the
        # optimizer with zero gradients, which applies AdamW's weight decay once and bumps
        # Adam's step count: a silent divergence from the other backends. A fresh optimizer
        # has empty state on every rank, so there is nothing to broadcast then.
        if not self.elastic:
            has_state = torch.tensor([1.0 if optimizer.state_dict()["state"] else 0.0])
            if hvd.allreduce(has_state, op=hvd.Max, name="unified_dist.has_optimizer_state").item() > 0:
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        distributed = hvd.DistributedOptimizer(
            optimizer, named_parameters=self._tensor_names(optimizer, model), op=hvd.Average,
            backward_passes_per_step=1,  # the facade says before each backward whether it averages (backward)
            compression=self.compressor())
        self._distributed.append(distributed)
        return distributed

    def _tensor_names(self, optimizer: torch.optim.Optimizer, model: Optional[torch.nn.Module]) -> list:
        """The names the averaging sends ``optimizer``'s gradients under: unique across the optimizers
        of the job (Horovod refuses a name that another tensor in flight carries: two optimizers with
        its default ``allreduce.noname.0.0`` each collide), the model's parameter names where known."""
        prefix = f"ud.opt{len(self._distributed)}"
        if model is not None:
            return [(f"{prefix}.{name}", p) for name, p in model.named_parameters()]
        return [(f"{prefix}.group{i}.param{j}", p) for i, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])]

    def set_sync_gradients(self, sync: bool) -> None:
        self._syncing = sync
        self._ready_hooks()  # also for a plain loss.backward() in the block (refused at the step, not before)

    def backward(self, loss: torch.Tensor, scaler: Optional[Any] = None, weight: Fraction = Fraction(1)) -> None:
        self._ready_hooks()
        super().backward(loss, scaler, weight)

    def _ready_hooks(self) -> None:
        """Before a backward pass: every optimizer's averaging still in flight is finished (a new
        gradient must not race it, nor reuse its name), and each optimizer's hooks are told whether
        this pass averages (the synchronising micro-step of the current ``ud.accumulate`` block) or
        only accumulates. Horovod's own count (``backward_passes_per_step``) counts backward passes
        per parameter, so a generator's loss reaching the discriminator would shift its window."""
        for optimizer in self._distributed:
            self._settle(optimizer)
            delay = 1 if self._syncing else _NEVER
            for p in optimizer._allreduce_delay:
                optimizer._allreduce_delay[p] = delay

    def release_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Before zeroing: finish the averaging in flight and forget the passes that only accumulated,
        so that zeroing the gradients of an optimizer that did not step (a discriminator after the
        generator's loss reached it) is torch's ``zero_grad``, which Horovod's refuses."""
        if isinstance(getattr(optimizer, "_handles", None), dict):  # a DistributedOptimizer
            self._settle(optimizer)
            optimizer._handles.clear()  # only (None, None) entries are left: passes that sent nothing

    def _settle(self, optimizer: Any) -> None:
        """Wait for ``optimizer``'s gradient averages in flight and put them in the gradients, as
        Horovod's ``synchronize`` does, without sending the gradients that are not in flight."""
        handles = optimizer._handles
        for p, (handle, ctx) in list(handles.items()):
            if handle is not None:
                p.grad.set_(optimizer._compression.decompress(self._wait(handle), ctx))
                del handles[p]

    def compressor(self) -> Any:
        """The ``compression=`` Horovod's ``DistributedOptimizer`` takes for ``config.gradient_compression``
        (Horovod compresses there, not on a model)."""
        mode = self.config.gradient_compression
        if mode == "bf16":
            raise UnifiedDistError("Horovod's torch build has no bf16 gradient compression (its allreduce refuses "
                                   "bfloat16 tensors); use gradient_compression='fp16' under horovodrun")
        return self.hvd.Compression.fp16 if mode == "fp16" else self.hvd.Compression.none

    def finalize_gradients(self, optimizer: torch.optim.Optimizer, scaler: Optional[Any]) -> None:
        optimizer.synchronize()  # DistributedOptimizer averages asynchronously, hooked on backward
        super().finalize_gradients(optimizer, scaler)

    def step_context(self, optimizer: torch.optim.Optimizer, finalized: bool) -> Any:
        # after synchronize(), step() must not wait for (or start) the averaging again
        return optimizer.skip_synchronize() if finalized else super().step_context(optimizer, finalized)

    # ------------------------------------------------------------------ elastic
    def _elastic_state(self, state: Any) -> Any:
        if state.backend_state is None:
            state.backend_state = _make_horovod_state(self, state)
        return state.backend_state

    def elastic_commit(self, state: Any) -> None:
        state.save_checkpoint()
        self._elastic_state(state).commit()  # in memory; raises HostsUpdatedInterrupt on host changes

    def elastic_run(self, fn: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
        inner = self._elastic_state(state)
        runner = self.hvd.elastic.run(lambda _inner, *a, **k: fn(state, *a, **k))
        return runner(inner, *args, **kwargs)

    # ------------------------------------------------------------------ collectives
    def translate_error(self, exc: BaseException, what: str) -> Optional[UnifiedDistError]:
        """Horovod says a peer is gone with ``HorovodInternalError`` ("Horovod has been shut down
        ...") and host changes with ``HostsUpdatedInterrupt``. The former becomes a
        :class:`PeerLost` that is also a ``HorovodInternalError``, so ``hvd.elastic.run`` (and
        :func:`unified_dist.elastic.run`) still recover from it; the latter passes through."""
        from horovod.common.exceptions import HorovodInternalError, HostsUpdatedInterrupt

        if isinstance(exc, HostsUpdatedInterrupt):
            return None
        if isinstance(exc, HorovodInternalError):
            return _horovod_peer_lost(HorovodInternalError)(peer_lost_message(what, self.rank, exc))
        return super().translate_error(exc, what)

    def _wait(self, handle: Any) -> Any:
        """Horovod has no per-collective timeout: poll the async handle against our deadline."""
        timeout = self.config.timeout.total_seconds()
        start = time.monotonic()
        deadline = start + timeout
        delay = 0.0
        while not self.hvd.poll(handle):
            now = time.monotonic()
            if now > deadline:
                raise deadline_passed(timeout)  # the collectives layer names the collective
            # yield-spin first, as hvd.synchronize does (small collectives finish within a
            # few horovod cycles), then back off so a long wait does not burn a core
            if now - start > 0.005:
                delay = min(max(delay * 2, 5e-5), 1e-3)
            time.sleep(delay)
        return self.hvd.synchronize(handle)

    def all_reduce_(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        hvd_op = {"sum": self.hvd.Sum, "max": self.hvd.Max, "min": self.hvd.Min}[op]
        out = self._wait(self.hvd.allreduce_async_(_send_as(tensor, "reduce"), op=hvd_op))
        return _received_as(out, tensor.dtype, "reduce")

    def all_gather_equal(self, tensor: torch.Tensor) -> torch.Tensor:
        wire = _send_as(tensor.unsqueeze(0), "gather")  # Horovod concatenates on dim 0
        return _received_as(self._wait(self.hvd.allgather_async(wire)), tensor.dtype, "gather")

    def all_gather_uneven(self, tensor: torch.Tensor) -> torch.Tensor:
        # Horovod's allgather takes a different dim 0 per rank natively (its coordinator exchanges
        # the sizes while negotiating, not in a round trip of ours) and keeps no state between
        # calls, which an elastic job whose membership changes needs.
        try:
            out = self._wait(self.hvd.allgather_async(_send_as(tensor, "gather")))
        except UnifiedDistError:
            raise
        except Exception as exc:
            if "mismatch" not in str(exc).lower():
                raise
            raise ShapeMismatch(first_line(exc)) from exc  # every rank got it
        return _received_as(out, tensor.dtype, "gather")

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        out = self._wait(self.hvd.broadcast_async_(_send_as(tensor, "broadcast"), root_rank=src))
        return _received_as(out, tensor.dtype, "broadcast")

    def broadcast_object(self, obj: Any, src: int) -> Any:
        # as hvd.broadcast_object (size, then bytes), but with plain pickle and our deadline
        payload = pickle.dumps(obj) if self.rank == src else b""
        size = self.broadcast_(torch.tensor([len(payload)], dtype=torch.int64), src)
        data = torch.zeros(int(size.item()), dtype=torch.uint8)
        if self.rank == src:
            data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        data = self.broadcast_(data, src)
        return obj if self.rank == src else pickle.loads(data.numpy().tobytes())

    def barrier(self) -> None:
        self.all_reduce_(torch.zeros(1), "sum")

