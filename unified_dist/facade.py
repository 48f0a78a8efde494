"""The public functions. They hold the one process-wide backend and only delegate.

Every function initialises with defaults on first use, so ``ud.init()`` is optional.
"""
from __future__ import annotations

import atexit
import builtins
import contextlib
import datetime
import os
import random
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, List, Optional, Sequence

import torch

from . import collectives, live, rng, settings
from .backends import Backend, Config, backend_class
from .backends.base import DEFAULT_TIMEOUT_S
from .buckets import resolve_bucket_mb, resolve_bucket_view
from .compression import resolve_gradient_compression
from .data import LoaderStack, PreparedDataLoader
from .detection import Detection, detect
from .errors import LaunchError, NonFiniteLoss, UnifiedDistError
from .flags import is_set
from .precision import resolve_mixed_precision
from .sharding import full_tensor, resolve_sharding
from .sync_batchnorm import ENV as SYNC_BATCHNORM_ENV
from .training import GradientSync, PreparedOptimizer, PreparedScheduler


@dataclass
class _Session:
    """Everything one ``init`` set up; :func:`shutdown` drops it whole."""

    backend: Backend
    detection: Detection
    sync: GradientSync
    loaders: LoaderStack
    optimizers: List[PreparedOptimizer] = field(default_factory=list)
    prepared_from: dict = field(default_factory=dict)  # id(user's optimizer) -> PreparedOptimizer
    check_finite: bool = True
    seed: int = 0  # the loaders' shuffle seed (seed_everything)
    failed: bool = False  # an exception reached the top of the program (see _note_failure)


_session: Optional[_Session] = None
_hooks_installed = False
_previous_excepthook: Any = None


_warned: set = set()


def _warn_once(message: str) -> None:
    """A ``UserWarning`` the first time ``message`` is said in this process (a loop repeats the mistake)."""
    if message not in _warned:
        _warned.add(message)
        warnings.warn(f"unified_dist: {message}", UserWarning, stacklevel=3)


def _env_flag(name: str) -> bool:
    return is_set(os.environ.get(name))


def _resolve_timeout(timeout: Optional[float]) -> datetime.timedelta:
    if timeout is None:
        raw = os.environ.get("UNIFIED_DIST_TIMEOUT")
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise UnifiedDistError(f"UNIFIED_DIST_TIMEOUT={raw!r} is not a number of seconds") from None
    if timeout <= 0:
        raise UnifiedDistError(f"timeout must be a positive number of seconds, got {timeout}")
    return datetime.timedelta(seconds=timeout)


def init(backend: Optional[str] = None, *, mixed_precision: Optional[str] = None,
         gradient_accumulation_steps: int = 1, timeout: Optional[float] = None,
         debug: Optional[bool] = None, sharding: Optional[str] = None,
         shard_modules: Optional[Sequence[Any]] = None, reshard_after_forward: Optional[bool] = None,
         sync_batchnorm: Optional[bool] = None, gradient_compression: Optional[str] = None,
         bucket_mb: Optional[float] = None) -> None:
    """Join the job's process group through the detected (or given) backend.

    Idempotent: a second call with compatible arguments does nothing; asking for another
    backend or settings once initialised is an error (call :func:`shutdown` first).
    ``timeout`` (seconds, default ``UNIFIED_DIST_TIMEOUT`` or 600) bounds every collective.
    ``sharding="fsdp"`` (or ``UNIFIED_DIST_SHARDING``, or ``accelerate launch --use_fsdp
    --fsdp_version 2``) makes :func:`prepare` shard models with FSDP2 (see
    :mod:`unified_dist.sharding`; ``shard_modules`` and ``reshard_after_forward`` tune it);
    ``sync_batchnorm=True`` (or ``UNIFIED_DIST_SYNC_BATCHNORM=1``) makes it synchronise BatchNorm
    statistics over the global batch (see :mod:`unified_dist.sync_batchnorm`).
    ``gradient_compression`` (``"bf16"``, ``"fp16"``, default ``UNIFIED_DIST_GRADIENT_COMPRESSION``
    or none) sends gradients in 16 bits (see :mod:`unified_dist.compression`). ``bucket_mb``
    (default ``UNIFIED_DIST_BUCKET_MB`` or each stack's own) sizes the fused gradient reductions:
    DDP's buckets, Horovod's fusion buffer (see :mod:`unified_dist.buckets`).
    """
    global _session
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise UnifiedDistError(
            f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}")
    if _session is not None:
        current = _session.backend
        if backend is not None and backend != current.name:
            raise UnifiedDistError(
                f"unified_dist is already running backend {current.name!r}; call ud.shutdown() before init({backend!r})")
        if gradient_accumulation_steps != 1 and gradient_accumulation_steps != current.config.gradient_accumulation_steps:
            raise UnifiedDistError(
                "init() was already called with gradient_accumulation_steps="
                f"{current.config.gradient_accumulation_steps}; call ud.init(...) before any other ud function")
        return
    settings.warn_unknown(os.environ)  # a misspelled UNIFIED_DIST_* variable would do nothing silently
    detection = detect(os.environ, backend, live.probe())
    if detection.problems:
        raise LaunchError(detection.problems[0])
    for message in detection.warnings:
        warnings.warn(f"unified_dist: {message}", UserWarning, stacklevel=2)
    config = Config(
        mixed_precision=resolve_mixed_precision(mixed_precision, os.environ, torch.cuda.is_available()),
        gradient_accumulation_steps=gradient_accumulation_steps,
        timeout=_resolve_timeout(timeout),
        debug=_env_flag("UNIFIED_DIST_DEBUG") if debug is None else bool(debug),
        sharding=resolve_sharding(sharding, os.environ, shard_modules, reshard_after_forward),
        sync_batchnorm=_env_flag(SYNC_BATCHNORM_ENV) if sync_batchnorm is None else bool(sync_batchnorm),
        gradient_compression=resolve_gradient_compression(gradient_compression, os.environ),
        bucket_mb=resolve_bucket_mb(bucket_mb, os.environ),
        bucket_view=resolve_bucket_view(os.environ),
    )
    cls = backend_class(detection.backend)
    if config.sharding.enabled and not cls.supports_sharding:
        raise UnifiedDistError(
            f"sharding='fsdp' needs torch.distributed, and {detection.launcher} runs the {cls.name} backend, which "
            "has no sharding; launch with torchrun, accelerate launch, srun or mpirun, or use sharding='no'")
    if config.sharding.enabled and config.gradient_compression:
        raise UnifiedDistError(
            f"gradient_compression={config.gradient_compression!r} compresses DDP's and Horovod's all-reduce; "
            "sharding='fsdp' reduce-scatters instead: use one of the two")
    instance = cls(detection, config)
    loaders = LoaderStack()
    _session = _Session(instance, detection, GradientSync(instance, loaders), loaders,
                        check_finite=os.environ.get("UNIFIED_DIST_CHECK_FINITE", "1") != "0")
    _install_exit_hooks()


def _current() -> _Session:
    if _session is None:
        init()
    assert _session is not None
    return _session


def current_backend() -> Backend:
    """The session's backend (initialising with defaults if needed): the seam unified_dist's own
    layers (e.g. :mod:`unified_dist.elastic`) use to reach it; not part of the user API."""
    return _current().backend


def shutdown() -> None:
    """Leave the process group; a later call to any function initialises again."""
    global _session
    if _session is not None:
        session, _session = _session, None
        session.backend.shutdown()


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
    (no communication): see :meth:`Backend.leave_at_exit`.

    Skipped after an uncaught exception: a reducer with a collective still pending on a lost
    peer cannot be freed, and the launcher must see this process end.
    """
    if _session is not None and not _session.failed:
        with contextlib.suppress(Exception):
            _session.backend.leave_at_exit()


# ---------------------------------------------------------------------- identity
def backend_name() -> str:
    """``"torch"``, ``"accelerate"``, ``"horovod"`` or ``"single"``."""
    return current_backend().name


def launcher() -> str:
    """What started this process: ``"python"``, ``"torchrun"``, ``"accelerate"``, ``"horovodrun"``,
    ``"srun"``, ``"mpirun"``, ``"ud.launch"``, or ``"existing"`` (a group the code had joined itself)."""
    return _current().detection.launcher


def rank() -> int:
    """Global rank of this process (0 on the main process)."""
    return current_backend().rank


def local_rank() -> int:
    """Rank of this process on its machine."""
    return current_backend().local_rank


def world_size() -> int:
    """Number of processes in the job."""
    return current_backend().world_size


def device() -> torch.device:
    """The device this process should compute on."""
    return current_backend().device


def is_main() -> bool:
    """True on global rank 0 only."""
    return rank() == 0


def is_local_main() -> bool:
    """True on local rank 0 of each machine."""
    return local_rank() == 0


def mixed_precision() -> str:
    """The active mixed-precision mode: ``"no"``, ``"bf16"`` or ``"fp16"``."""
    return current_backend().config.mixed_precision


def sharding_mode() -> str:
    """``"fsdp"`` when :func:`prepare` shards models (see :func:`init`), else ``"no"``."""
    return current_backend().config.sharding.mode


def gradient_compression() -> Optional[str]:
    """The format gradients travel in: ``"bf16"``, ``"fp16"`` or ``None`` (float32)."""
    return current_backend().config.gradient_compression


def gradient_accumulation_steps() -> int:
    """Micro-batches per optimizer step, as given to :func:`init`."""
    return current_backend().config.gradient_accumulation_steps


# ---------------------------------------------------------------------- preparation
def prepare(*objs: Any) -> Any:
    """Make models, optimizers, LR schedulers and DataLoaders ready; returned in the order given.

    One object in gives that object back (not a 1-tuple). Models are moved to :func:`device`
    and their gradients averaged across ranks (or sharded, with ``init(sharding="fsdp")``;
    BatchNorm synchronised with ``init(sync_batchnorm=True)``); optimizers step only when
    gradients are synchronised (an optimizer built on a model's parameters before this call
    steps the prepared model's); loaders are sharded (see :mod:`unified_dist.data`) and
    reshuffle each epoch.
    """
    session = _current()
    backend = session.backend
    models = [o for o in objs if isinstance(o, torch.nn.Module)]
    out: List[Any] = [None] * len(objs)
    # models first (sharding replaces their parameters, which the optimizers must then step);
    # schedulers last, so they can be pointed at the optimizer prepared in the same call
    order = sorted(range(len(objs)), key=lambda i: (not isinstance(objs[i], torch.nn.Module), _is_scheduler(objs[i])))
    for i in order:
        obj = objs[i]
        if isinstance(obj, torch.nn.Module):
            if backend.config.sync_batchnorm:
                obj = backend.convert_sync_batchnorm(obj)
            out[i] = backend.prepare_model(obj)
            session.sync.buffers.add(out[i])  # every rank starts from rank 0's buffers (unified_dist.buffers)
        elif isinstance(obj, PreparedOptimizer):
            out[i] = obj
        elif isinstance(obj, torch.optim.Optimizer):
            inner = backend.prepare_optimizer(obj, models[0] if len(models) == 1 else None)
            prepared = PreparedOptimizer(inner, session.sync, backend.make_grad_scaler())
            session.optimizers.append(prepared)
            session.prepared_from[id(obj)] = prepared
            out[i] = prepared
        elif isinstance(obj, torch.utils.data.DataLoader):
            out[i] = PreparedDataLoader(obj, lambda: (backend.rank, backend.world_size), backend.device,
                                        session.seed, session.loaders)
        elif _is_scheduler(obj):
            # The scheduler must drive the optimizer that steps: Horovod's DistributedOptimizer is
            # a new object, and load_state_dict() replaces param_groups, so a scheduler left on
            # the original optimizer would stop changing the learning rate after a resume.
            if id(obj.optimizer) in session.prepared_from:
                obj.optimizer = session.prepared_from[id(obj.optimizer)]
            out[i] = PreparedScheduler(obj, session.sync)
        else:
            raise UnifiedDistError(
                f"prepare() got a {type(obj).__name__}; it accepts torch.nn.Module, torch.optim.Optimizer, "
                "LR schedulers and torch.utils.data.DataLoader")
    return out[0] if len(out) == 1 else tuple(out)


def _is_scheduler(obj: Any) -> bool:
    return isinstance(obj, torch.optim.lr_scheduler.LRScheduler) or (
        hasattr(obj, "step") and hasattr(obj, "state_dict") and hasattr(obj, "optimizer"))


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The original module inside a prepared model (for saving, ``save_pretrained``, inspection)."""
    return current_backend().unwrap(model)


# ---------------------------------------------------------------------- training
def backward(loss: torch.Tensor) -> None:
    """Backpropagate ``loss``, the mean over this rank's micro-batch, weighted so that the optimizer
    step applies the gradient of the mean loss over all its real samples: ``1/k`` with
    ``gradient_accumulation_steps=k`` and full batches; a ragged last batch or a short last
    accumulation window by what it really holds (scaled for fp16 if needed)."""
    if not isinstance(loss, torch.Tensor):
        raise UnifiedDistError(f"backward() expects the loss tensor, got {type(loss).__name__}")
    session = _current()
    session.sync.check_backward_context()
    session.sync.backward_calls += 1
    if session.check_finite:
        _stop_on_non_finite(session, loss)
    scaler = session.optimizers[-1].scaler if session.optimizers else None
    session.backend.backward(loss, scaler, session.sync.loss_weight())


def _stop_on_non_finite(session: _Session, loss: torch.Tensor) -> None:
    """Every rank learns whether any rank's loss is NaN/inf, and all stop at the same step."""
    finite = torch.isfinite(loss.detach()).all().to(torch.uint8).reshape(1)
    flags = collectives.all_gather(session.backend, finite, what="backward(non-finite check)")
    if bool(flags.all()):
        return
    bad = [r for r, ok in enumerate(flags.tolist()) if not ok]
    step = (session.optimizers[-1].steps_taken if session.optimizers else 0) + 1
    raise NonFiniteLoss(
        f"loss is not finite on rank {', '.join(map(str, bad))} at optimizer step {step}: nothing was "
        "updated and earlier checkpoints are intact; lower the learning rate, clip gradients or check "
        "the inputs (UNIFIED_DIST_CHECK_FINITE=0 skips this check)")


@contextlib.contextmanager
def accumulate(model: torch.nn.Module) -> Iterator[None]:
    """Wrap one micro-step (forward, backward, step): only every k-th one synchronises.

    With ``gradient_accumulation_steps=k`` the prepared optimizer steps on every k-th
    micro-step and on the last batch of a prepared loader; in between, gradients
    accumulate locally with no communication.
    """
    with _current().sync.accumulate(model):
        yield


def sync_gradients() -> bool:
    """True when the current micro-step synchronises gradients (and the optimizer steps)."""
    return _current().sync.sync_gradients


def clip_grad_norm_(parameters: Any, max_norm: float, norm_type: float = 2.0) -> Optional[torch.Tensor]:
    """Clip the averaged gradients; returns the total norm, or ``None`` on a non-synchronising micro-step.

    Waits for gradient averaging first (Horovod averages asynchronously) and unscales fp16 gradients.
    The norm is of the whole gradient, a plain tensor, also when the parameters are sharded.
    """
    session = _current()
    if not session.sync.sync_gradients:
        return None
    for optimizer in session.optimizers:
        optimizer.synchronize()
    return full_tensor(torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type=norm_type))


def autocast() -> contextlib.AbstractContextManager:
    """Autocast for the configured mixed precision (a no-op for ``"no"``)."""
    return current_backend().autocast()


def seed_everything(seed: int, per_rank: bool = False) -> int:
    """Seed python, numpy and torch (plus ``per_rank`` adds the rank) and the loaders' shuffling.

    The loaders' shuffle seed is always ``seed`` itself, so every rank agrees on the order.
    Call it after :func:`init` (it initialises with defaults otherwise) and before :func:`prepare`.
    Returns the seed used for the RNGs.
    """
    session = _current()
    session.seed = int(seed)
    value = session.seed + (session.backend.rank if per_rank else 0)
    random.seed(value)
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed(value % 2**32)
    torch.manual_seed(value)
    return value


# ---------------------------------------------------------------------- collectives
def all_reduce(x: Any, op: str = "mean") -> Any:
    """Reduce ``x`` (a tensor or nested list/tuple/dict of tensors) across ranks with op sum/mean/max/min.

    Returns new tensors; the input is never modified. ``mean`` is sum / world size on every backend.
    """
    return collectives.all_reduce(current_backend(), x, op)


def all_gather(x: Any) -> Any:
    """Concatenate ``x`` from every rank along dim 0 in rank order; dim 0 may differ per rank."""
    return collectives.all_gather(current_backend(), x)


def gather_for_metrics(x: Any) -> Any:
    """``all_gather`` inside a prepared loader's loop, minus the rows its last batch padded in.

    Gathering every batch of a prepared evaluation loader yields exactly ``len(dataset)`` rows,
    each sample once, in dataset order (unshuffled loader). Outside such a loop it is
    ``all_gather`` and warns once (it cannot know which rows are padding there).
    """
    session = _current()
    gathered = collectives.all_gather(session.backend, x, what="gather_for_metrics")
    loader = session.loaders.current
    if loader is None:
        _warn_once("gather_for_metrics() ran outside the loop of a prepared DataLoader, so it cannot drop the "
                   "rows a padded last batch repeats and acts as ud.all_gather; prepare the evaluation loader "
                   "with ud.prepare(...) and call it inside that loop (or call ud.all_gather)")
    info = loader.batch_info if loader is not None else None
    if info is None or info.real == info.padded:
        return gathered
    return collectives.map_each(
        gathered, lambda t: t[:info.real] if t.shape[0] == info.padded else t, "gather_for_metrics")


def all_gather_object(obj: Any) -> List[Any]:
    """Every rank's picklable ``obj`` as a list in rank order."""
    return collectives.all_gather_object(current_backend(), obj)


def rng_states() -> List[Any]:
    """Every rank's RNG states (python, numpy, torch, CUDA), in rank order: put them in a checkpoint."""
    return all_gather_object(rng.capture())


def restore_rng_states(states: List[Any]) -> None:
    """Restore this rank's generators from :func:`rng_states` output.

    Exact when the world size is unchanged; otherwise rank r takes ``states[r % len(states)]``
    (the data order is still exact: it does not depend on these generators).
    """
    if not states:
        return
    rng.restore(states[rank() % len(states)])


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s value on every rank: a tensor (new tensor returned) or any picklable object."""
    return collectives.broadcast(current_backend(), obj, src)


def barrier() -> None:
    """Wait until every rank arrives."""
    collectives.barrier(current_backend())


def print(*args: Any, **kwargs: Any) -> None:  # noqa: A001 - mirrors builtins.print on purpose
    """``print`` on the main process only."""
    if is_main():
        kwargs.setdefault("flush", True)
        builtins.print(*args, **kwargs)


@contextlib.contextmanager
def main_process_first() -> Iterator[None]:
    """The main process runs the block first (e.g. to fill a cache); the others follow."""
    if not is_main():
        barrier()
    try:
        yield
    finally:
        if is_main():
            barrier()
