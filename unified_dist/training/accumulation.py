"""Gradient accumulation, and the optimizer/scheduler wrappers that honour it on every backend.

One meaning everywhere: with ``gradient_accumulation_steps=k``, inside ``ud.accumulate(model)``
(each argument list counting its own micro-steps) only every k-th backward pass (and the last
batch of a prepared loader) synchronises gradients; the prepared optimizer steps and zeroes
gradients only then, and the prepared scheduler steps once per optimizer step.

Exactness. An optimizer step must apply the gradient of the mean loss over every real sample
it saw, as one process would on the concatenated batch. Each rank's loss is the mean over its
own micro-batch, and the backends average gradients over ranks, so ``ud.backward`` multiplies
the loss by ``data_parallel_world_size * mine / step_samples`` (:meth:`GradientSync.loss_weight`): ``mine`` is
this rank's real samples in the micro-batch, ``step_samples`` the real samples of every rank and
micro-batch of the optimizer step. With full batches that is ``1/k``; a ragged last batch (its
samples split unevenly, see :mod:`unified_dist.data.loaders`) and a last accumulation window with fewer
than ``k`` micro-batches are weighted by what they really hold; a padding row weighs zero.
Without a prepared loader the weight is ``1/k``.
"""
from __future__ import annotations

import contextlib
from fractions import Fraction
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..backends.base import Backend
from ..backends.optimizer_view import OptimizerView
from ..data.loaders import LoaderStack
from ..errors import UnifiedDistError
from .buffers import ModelBuffers
from .preemption import StopSignals


class _Window:
    """One accumulation window: the micro-steps counted so far and the real samples it holds."""

    __slots__ = ("micro_step", "samples")

    def __init__(self) -> None:
        self.micro_step = 0
        self.samples: Optional[int] = None  # real samples of the whole window (a prepared loader's), once known


class GradientSync:
    """Counts micro-steps and decides which backward pass synchronises.

    Each ``ud.accumulate(...)`` argument list counts its own micro-steps: a GAN that enters
    ``accumulate(D)`` then ``accumulate(G)`` each batch gets two windows of ``k`` micro-batches
    (not one window of ``k`` contexts shared by both models), and ``accumulate(G, D)`` is one
    micro-step of both models together."""

    def __init__(self, backend: Backend, loaders: LoaderStack) -> None:
        self.backend = backend
        self.loaders = loaders
        self.buffers = ModelBuffers(backend)  # the prepared models' buffers, made rank 0's after each step
        self.steps = backend.config.gradient_accumulation_steps
        self.sync_gradients = True
        self.inside = False  # within a `with ud.accumulate(model):` block now
        self.ever_accumulated = False
        self.committed = True  # the latest optimizer step was applied (Backend.commit_step; replica groups)
        self.backward_calls = 0  # ud.backward calls so far (each optimizer remembers the count at its step)
        self._windows: Dict[Tuple[int, ...], _Window] = {}  # by the ids of the models accumulate() was given
        self._window: Optional[_Window] = None  # the window of the current (or last) accumulate block
        self.scaler: Any = None  # the fp16 loss scaler every prepared optimizer shares (None: the backend's, or none)
        self.optimizers: List["PreparedOptimizer"] = []  # every optimizer prepared in this session
        self.optimizer_steps = 0  # optimizer steps taken in this process, by every optimizer (a resume keeps it)
        self.stops: Optional[StopSignals] = None  # the session's stop signals, told when an optimizer step begins

    @contextlib.contextmanager
    def accumulate(self, *models: torch.nn.Module) -> Iterator[None]:
        if self.inside:
            raise UnifiedDistError(
                "ud.accumulate() inside another ud.accumulate() block; for one micro-step of several models "
                "write one block with them all: `with ud.accumulate(generator, discriminator):`")
        if not models:
            raise UnifiedDistError("ud.accumulate() needs the model(s) of the micro-step: `with ud.accumulate(model):`")
        window = self._windows.setdefault(tuple(id(m) for m in models), _Window())
        info = self.loaders.current_batch
        if window.micro_step == 0:  # a window starts: it ends after k micro-batches or with the epoch
            window.samples = self.loaders.current.window_samples(self.steps) if info is not None else None
        window.micro_step += 1
        self.sync_gradients = window.micro_step % self.steps == 0 or (info is not None and info.is_last)
        if self.sync_gradients:
            window.micro_step = 0
        self._window = window
        self.backend.set_sync_gradients(self.sync_gradients)
        self.inside = self.ever_accumulated = True
        try:
            with contextlib.ExitStack() as stack:
                if not self.sync_gradients:
                    for model in models:
                        stack.enter_context(self.backend.no_sync(model))
                yield
        finally:
            self.inside = False
            if self.sync_gradients:
                window.samples = None

    def loss_scaler(self) -> Optional[Any]:
        """The fp16 ``GradScaler`` every ``ud.backward`` scales by (``None`` without loss scaling): the facade's
        shared one, or the one the backend's library keeps and steps (Accelerate's)."""
        return self.scaler if self.scaler is not None else self.backend.native_loss_scaler()

    def loss_scale(self) -> Optional[torch.Tensor]:
        """The fp16 loss scale every ``ud.backward`` multiplies by now (a copy, on the device; ``None`` without
        loss scaling): :meth:`loss_scaler`'s."""
        # GradScaler keeps it as a tensor: reading it needs no host sync
        scale = getattr(self.loss_scaler(), "_scale", None)
        return scale.clone() if isinstance(scale, torch.Tensor) else None

    def rescale_others(self, stepped: "PreparedOptimizer", before: Optional[torch.Tensor]) -> None:
        """After ``stepped`` stepped and the shared scale went from ``before`` to its new value (growth, or
        backoff on an inf), the gradients that other optimizers still hold (a generator's micro-batches
        of a window not yet complete, a discriminator's share of the generator's loss) are scaled by the
        old one: multiply them by new/old, so that every optimizer unscales them by the scale they carry."""
        after = self.loss_scale()
        if before is None or after is None:
            return
        ratio = after / before
        for other in self.optimizers:
            if other is stepped or other._finalized:  # _finalized: already unscaled (clipped) this step
                continue
            grads = [p.grad for group in other.param_groups for p in group["params"] if p.grad is not None]
            if grads:
                torch._foreach_mul_(grads, ratio)

    def check_backward_context(self) -> None:
        """Refuse ``ud.backward`` outside ``ud.accumulate`` when micro-batches accumulate: nothing
        would ever tell the optimizer to wait, so it would step on every micro-batch with 1/k of
        the gradient."""
        if self.steps > 1 and not self.inside:
            raise UnifiedDistError(
                f"ud.backward() ran outside `with ud.accumulate(model):` while gradient_accumulation_steps="
                f"{self.steps}, so the optimizer would step every micro-batch with 1/{self.steps} of the gradient; "
                "wrap each micro-step (forward, ud.backward, optimizer.step, zero_grad) in "
                "`with ud.accumulate(model):`")

    def weighting_matters(self, scaler: Any) -> Optional[str]:
        """Why this step's gradient needs ``ud.backward``'s weighting (``None`` when a plain
        ``loss.backward()`` gives the same gradient: one micro-batch a step, evenly split, no fp16 scaling)."""
        if self.steps > 1:
            return f"gradient_accumulation_steps={self.steps} (each micro-batch weighs 1/{self.steps})"
        if scaler is not None:
            return "fp16 loss scaling"
        info = self.loaders.current_batch
        if info is not None and not info.even:  # then no rank's weight is 1
            return "this ragged last batch split unevenly across ranks"
        return None

    def loss_weight(self) -> Fraction:
        """What ``ud.backward`` multiplies this micro-batch's mean loss by (see the module doc)."""
        info = self.loaders.current_batch
        if info is None:
            return Fraction(1, self.steps)
        window_samples = self._window.samples if self._window is not None else None
        step_samples = window_samples or info.real * self.steps
        return Fraction(self.backend.data_parallel_world_size * info.mine, step_samples)


class PreparedOptimizer(OptimizerView):
    """The user's optimizer, stepped only on synchronising micro-steps; ``param_groups``, ``state`` and
    ``defaults`` are the wrapped optimizer's own (:class:`OptimizerView`), so LR schedulers drive it."""

    def __init__(self, optimizer: torch.optim.Optimizer, sync: GradientSync,
                 scaler: Optional[Any] = None) -> None:
        super().__init__(optimizer)
        self._sync = sync
        self.scaler = scaler
        self._finalized = False
        self.steps_taken = 0
        self._backward_calls_at_step = sync.backward_calls  # ud.backward calls counted before this step
        sync.optimizers.append(self)

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict plus ``"steps_taken"``, the optimizer steps so far
        (a plain torch optimizer loads it too: torch ignores the extra key)."""
        return {**self.optimizer.state_dict(), "steps_taken": self.steps_taken}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a state dict of this optimizer or of the plain torch one; ``steps_taken`` comes back
        when it is there (a checkpoint written before it was saved leaves the count as it is)."""
        state_dict = dict(state_dict)
        steps = state_dict.pop("steps_taken", None)
        self.optimizer.load_state_dict(state_dict)
        if steps is not None:
            self.steps_taken = int(steps)

    def synchronize(self) -> None:
        """Make this step's gradients final now: averaged and unscaled (before reading or clipping them).

        Once per optimizer step; the backend does it its library's way (:meth:`Backend.finalize_gradients`).
        """
        if not self._finalized:
            self._sync.backend.finalize_gradients(self.optimizer, self.scaler)
            self._finalized = True

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        """Step only if this micro-step synchronised gradients; returns ``None`` otherwise."""
        self._sync.loaders.note_training()  # the current loader's pass is no peek (unified_dist.data.loaders.Epochs)
        if not self._sync.sync_gradients:
            return None
        if self._sync.stops is not None:  # a stop signal held through the last step, never asked about, acts now
            self._sync.stops.step_begins()
        if closure is None:
            self._refuse_unweighted_gradients()
        self._opt_called = True  # what torch's LR schedulers check before warning
        finalized, self._finalized = self._finalized, False
        self._backward_calls_at_step = self._sync.backward_calls
        scale = self._sync.loss_scale()
        result = None
        with self._sync.backend.step_context(self.optimizer, finalized):
            self._sync.buffers.before_commit(self.optimizer)  # replica groups: averaged inside the step
            self._sync.committed = self._sync.backend.commit_step(self.optimizer)
            if not self._sync.committed:  # a replica group failed during the step: no group applies it
                return None
            self.steps_taken += 1
            if self.scaler is None:
                result = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
            else:
                result = self.scaler.step(self.optimizer)
                self.scaler.update()
        self._sync.rescale_others(self, scale)
        self._sync.buffers.after_step(self.optimizer)  # every rank takes rank 0's buffers (training.buffers)
        self._sync.optimizer_steps += 1
        return result

    def _refuse_unweighted_gradients(self) -> None:
        """Gradients that came from ``loss.backward()`` (no ``ud.backward`` since this optimizer's
        last step) are refused where ``ud.backward``'s weighting would have changed them, before
        anything is updated. The same on every rank: the rule reads no rank-local value."""
        if self._sync.backward_calls != self._backward_calls_at_step:
            return
        if not any(p.grad is not None for group in self.param_groups for p in group["params"]):
            return
        why = self._sync.weighting_matters(self.scaler)
        if self._sync.steps > 1 and not self._sync.ever_accumulated:
            why = f"gradient_accumulation_steps={self._sync.steps} without `with ud.accumulate(model):`"
        if why is not None:
            raise UnifiedDistError(
                f"optimizer.step() found gradients but no ud.backward(loss) since its last step; with {why} "
                "loss.backward() gives a wrongly weighted gradient: "
                "call ud.backward(loss) instead (nothing was updated)")

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]  # counted above, as torch's wrapper does

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero gradients only on synchronising micro-steps (they accumulate in between)."""
        if not self._sync.sync_gradients:
            return
        self._finalized = False  # a step the user skipped must not leave the next one unfinalized
        self._sync.backend.release_gradients(self.optimizer)
        if set_to_none:
            self.optimizer.zero_grad()  # no argument: a wrapped optimizer's may take none; default is set_to_none
            return
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                # As torch.optim.Optimizer.zero_grad: a DDP bucket view cannot be detached in place,
                # and a gradient without a graph has nothing to detach from.
                if p.grad.grad_fn is not None:
                    p.grad.detach_()
                else:
                    p.grad.requires_grad_(False)
                p.grad.zero_()


class PreparedScheduler:
    """The user's LR scheduler, stepped once per optimizer step on every backend."""

    def __init__(self, scheduler: Any, sync: GradientSync) -> None:
        self.scheduler = scheduler
        self._sync = sync
        self._steps_at_last = sync.optimizer_steps  # committed optimizer steps when this scheduler last stepped

    def step(self, *args: Any, **kwargs: Any) -> None:
        # with replica groups, a step that did not commit is not counted, but one per epoch still steps after
        # an epoch whose last optimizer step was dropped (committed ones ran since its last step)
        committed_since = self._sync.optimizer_steps > self._steps_at_last
        if self._sync.sync_gradients and (self._sync.committed or committed_since):
            self._steps_at_last = self._sync.optimizer_steps
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict:
        return self.scheduler.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.scheduler.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.scheduler, name)


def is_scheduler(obj: Any) -> bool:
    """Whether ``obj`` is an LR scheduler: a prepared one, torch's, or anything else shaped like one
    (``step``, ``state_dict`` and an ``optimizer``) that is no optimizer. ``prepare`` and ``load`` order
    such objects after the optimizers."""
    if isinstance(obj, (PreparedScheduler, torch.optim.lr_scheduler.LRScheduler)):
        return True
    if isinstance(obj, (torch.optim.Optimizer, PreparedOptimizer)):  # a prepared optimizer has .optimizer too
        return False
    return hasattr(obj, "step") and hasattr(obj, "state_dict") and hasattr(obj, "optimizer")
