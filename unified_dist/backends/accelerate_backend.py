"""Hugging Face Accelerate, as started by ``accelerate launch``."""
from __future__ import annotations

import contextlib
import os
from dataclasses import replace
from typing import Any, ContextManager, Iterator, Optional

import torch

from ..detection import Detection
from ..errors import BackendNotInstalled, UnifiedDistError
from .base import Config, stop_ddp_buffer_sync
from .buckets import ddp_kwargs
from .process_group import note_group_joined_elsewhere, put_back_environ, withdraw_rendezvous
from .torch_group import TorchGroupBackend

ACCELERATE_WRITES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT")
"""The variables Accelerate's ``PartialState`` sets on a CPU; the backend gives them back at shutdown as it found
them (the process's next backend must find the launch's own)."""


def _running_precision(config: Config) -> Config:
    """``config`` with the mixed precision of an ``Accelerator`` the user already created, if any.

    Accelerate cannot change it once set; the running stack's choice is kept, and only an
    explicit, different request (anything but the default ``"no"``) is an error.
    """
    from accelerate.state import AcceleratorState

    if not AcceleratorState._shared_state:
        return config
    running = AcceleratorState().mixed_precision
    running = str(getattr(running, "value", running))
    if running == config.mixed_precision:
        return config
    if config.mixed_precision != "no":
        raise UnifiedDistError(
            f"an Accelerator with mixed_precision={running!r} already runs in this process and Accelerate cannot "
            f"change it to {config.mixed_precision!r}; create it with mixed_precision={config.mixed_precision!r} "
            "or leave ud.init(mixed_precision=...) unset")
    return replace(config, mixed_precision=running)


def _running_accumulation(config: Config) -> Config:
    """``config`` with the gradient accumulation of an ``Accelerator`` the user already created, if any
    (``unified_dist.accelerate.Accelerator``, then a ``ud`` call): Accelerate keeps one accumulation for
    the process, and building the backend's ``Accelerator`` with another would change the user's silently.
    A running value other than the default 1 is kept; a different one asked of ``ud.init`` too is an error."""
    from accelerate.state import GradientState

    running = GradientState().num_steps if GradientState._shared_state else 1
    wanted = config.gradient_accumulation_steps
    if running in (1, wanted):
        return config
    if wanted != 1:
        raise UnifiedDistError(
            f"an Accelerator with gradient_accumulation_steps={running} already runs in this process and "
            f"ud.init(gradient_accumulation_steps={wanted}) would change it; create the Accelerator with "
            f"{wanted}, or leave ud.init(gradient_accumulation_steps=...) unset")
    return replace(config, gradient_accumulation_steps=running)


def _accumulation_plugin() -> Optional[dict]:
    """Accelerate's process-wide accumulation plugin (``None``: no ``GradientState`` yet)."""
    from accelerate.state import GradientState

    return dict(GradientState._shared_state.get("plugin_kwargs") or {}) if GradientState._shared_state else None


def _restore_accumulation_plugin(plugin: Optional[dict]) -> None:
    """Put back what :func:`_accumulation_plugin` read (an ``Accelerator`` the user made keeps its own)."""
    from accelerate.state import GradientState

    if plugin is None:
        GradientState._reset_state()
    else:
        GradientState._shared_state["plugin_kwargs"] = plugin


class AccelerateBackend(TorchGroupBackend):
    """Drives one ``accelerate.Accelerator``.

    The scheduler is *not* stepped by Accelerate (``step_scheduler_with_optimizer=False``):
    Accelerate would step it once per process per call, a different meaning from the other
    backends; unified_dist steps it once per optimizer step everywhere.
    """

    name = "accelerate"

    def __init__(self, detection: Detection, config: Config) -> None:
        super().__init__(detection, config)
        try:
            from accelerate import Accelerator
            from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs
        except ImportError as exc:
            raise BackendNotInstalled(
                f"backend 'accelerate' needs the accelerate package ({exc}); install it with "
                "`pip install unified_dist[accelerate]` or `make setup`") from None
        from accelerate.state import PartialState

        # What this process had already started stays running at shutdown (see unified_dist.detection.live).
        self._owns_state = not PartialState._shared_state
        # Accelerate's PartialState writes these on a CPU (MULTI_CPU), LOCAL_WORLD_SIZE as 1 where only the
        # launcher's own names (HOROVOD_LOCAL_SIZE, ...) say the host's count: put back at shutdown as found
        self._environ_before = {name: os.environ.get(name) for name in ACCELERATE_WRITES} if self._owns_state else {}
        # srun/mpirun: Accelerate reads torch's env:// variables. A torchrun restart needs a per-attempt
        # store; Accelerate then reuses the joined group.
        joined = self._join_group(detection, always=False, export=detection.master_addr is not None)
        self.config = config = _running_accumulation(_running_precision(config))
        self._plugin_before = _accumulation_plugin()  # the user's Accelerator's, put back at shutdown
        with _without_parallelism_config():  # the facade builds the mesh itself, on every device
            self.accelerator = Accelerator(
                # Without cpu=True, Accelerate ignores a multi-process launch on a GPU-less machine
                # (DistributedType.NO, each process alone); with it, it uses gloo (MULTI_CPU).
                cpu=not torch.cuda.is_available(),
                mixed_precision=config.mixed_precision,
                gradient_accumulation_steps=config.gradient_accumulation_steps,
                step_scheduler_with_optimizer=False,
                # the facade compiles (unified_dist.parallel.compiling), in place: Accelerate's own compile would wrap
                # the model in an OptimizedModule (with _orig_mod. in its state dict) before the facade's hooks
                dynamo_backend="no",
                # buffers: stop_ddp_buffer_sync in prepare_model (the handler cannot say forward_sync_buffers)
                kwargs_handlers=[InitProcessGroupKwargs(timeout=config.timeout),
                                 DistributedDataParallelKwargs(**ddp_kwargs(config.bucket_mb, config.bucket_view))],
            )
        before = self._plugin_before
        if before is not None and before.get("num_steps", 1) == config.gradient_accumulation_steps:
            _restore_accumulation_plugin(before)  # the same accumulation: the user's plugin as it was
        if self._owns_group and not joined:
            note_group_joined_elsewhere()  # Accelerate joined it: a re-init must not meet its store keys
        # Accelerate's own FSDP (accelerate launch --use_fsdp) only runs on GPUs: on a CPU it keeps
        # DistributedType.MULTI_CPU and would wrap the model in DDP. The facade shards with torch's
        # fully_shard itself on every device, so the meaning is the same everywhere.
        self._split_models(self.world_size)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def local_rank(self) -> int:
        return self.accelerator.local_process_index

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def shutdown(self) -> None:
        from accelerate.state import AcceleratorState, GradientState

        self.accelerator.wait_for_everyone()  # nobody is still reducing when the reducers go
        self._ddp.release()
        if self._owns_group:
            self.accelerator.end_training()  # destroys the process group
        withdraw_rendezvous(self._exported)
        put_back_environ(self._environ_before)
        if self._owns_state:
            AcceleratorState._reset_state(reset_partial_state=True)
            GradientState._reset_state()
        else:
            _restore_accumulation_plugin(self._plugin_before)

    def _wrap_ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        with _forward_left_to_the_facade(self.accelerator):
            return stop_ddp_buffer_sync(self.accelerator.prepare_model(model))

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer,
                          model: Optional[torch.nn.Module] = None) -> torch.optim.Optimizer:
        return self.accelerator.prepare_optimizer(self._fsdp.adopt(optimizer))

    def unwrap(self, model: torch.nn.Module) -> torch.nn.Module:
        return super().unwrap(self.accelerator.unwrap_model(model))

    def no_sync(self, model: torch.nn.Module) -> ContextManager:
        return self._fsdp.no_sync(model) or self.accelerator.no_sync(model)

    def set_sync_gradients(self, sync: bool) -> None:
        self.accelerator.sync_gradients = sync  # AcceleratedOptimizer skips step() when False

    def make_grad_scaler(self) -> Optional[Any]:
        return None  # AcceleratedOptimizer owns the scaler

    def native_loss_scaler(self) -> Optional[Any]:
        # one for every optimizer; each AcceleratedOptimizer.step() updates it. ud.backward scales by it through
        # the base backward (loss * weight), not accelerator.backward, which would divide by the accumulation again
        return self.accelerator.scaler

    def finalize_gradients(self, optimizer: torch.optim.Optimizer, scaler: Optional[Any]) -> None:
        # fp16: the gradients are still multiplied by Accelerate's loss scale (its own GradScaler);
        # unscale them through Accelerate, which its optimizer's step() then knows about
        self.accelerator.unscale_gradients(optimizer)

    def broadcast_(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        from accelerate.utils import broadcast

        return broadcast(tensor, from_process=src)

    def broadcast_object(self, obj: Any, src: int) -> Any:
        from accelerate.utils import broadcast_object_list

        return broadcast_object_list([obj], from_process=src)[0]

    def barrier(self) -> None:
        self.accelerator.wait_for_everyone()


@contextlib.contextmanager
def _without_parallelism_config() -> Iterator[None]:
    """Hide ``accelerate launch --use_parallelism_config`` from the ``Accelerator`` being built: it
    would build its own mesh, and on a CPU refuse (``ParallelismConfig is only compatible
    DistributedType.FSDP``). The facade reads the same flags (:mod:`unified_dist.settings`) and
    builds the mesh itself on every device."""
    saved = os.environ.pop("ACCELERATE_USE_PARALLELISM_CONFIG", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_PARALLELISM_CONFIG"] = saved


@contextlib.contextmanager
def _forward_left_to_the_facade(accelerator: Any) -> Iterator[None]:
    """While Accelerate prepares a model: its mixed precision off for that call only, so ``prepare_model``
    wraps the model in DDP without putting every ``forward`` in autocast (with outputs cast to float32).

    Mixed precision means one thing on every backend (:class:`~unified_dist.backends.precision.Precision`):
    autocast inside ``ud.autocast()`` only, outputs in the dtype autocast gives. With Accelerate's wrapper an
    evaluation outside ``ud.autocast()`` would run in bf16 under ``accelerate launch`` and in float32 under
    every other launcher. Everything else of the mode stays Accelerate's: its state, its fp16 ``GradScaler``
    (stepped by its ``AcceleratedOptimizer``)."""
    amp = accelerator.native_amp
    accelerator.native_amp = False
    try:
        yield
    finally:
        accelerator.native_amp = amp
