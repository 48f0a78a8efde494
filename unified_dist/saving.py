"""The public checkpoint functions: portable files (``save``/``load``/``save_checkpoint``), a
sharded model's full weights (``get_state_dict``), and per-rank shards (``save_sharded``/``load_sharded``).
They reach the session's backend through :func:`unified_dist.facade.current_backend` and only delegate
to :mod:`unified_dist.checkpoint.files` and :mod:`unified_dist.checkpoint.sharded`.
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

from . import nested, session
from .checkpoint import deepspeed_directory, files as checkpoint, rng, sharded as sharded_checkpoint
from .checkpoint.background import WRITER
from .collectives import ops as collectives
from .errors import CheckpointError, UnifiedDistError, summary
from .facade import barrier, restore_rng_states, rng_states
from .parallel.sharding import full_tensor
from .session import current_backend
from .training.accumulation import PreparedScheduler, is_scheduler

ARRIVAL_SECONDS = 20.0
"""How long rank 0 waits for the other ranks at a collective save (sharded, or with ``ud.RNG``) before
it names the ``if ud.is_main():`` mistake (:func:`_every_rank_calls`), if the collective timeout is not shorter."""


def save(obj: Any, path: str, *, async_save: bool = False) -> None:
    """The main process writes ``obj`` to ``path`` atomically; on the other ranks it does nothing.

    ``obj`` is usually the dict of live objects that :func:`load` restores, e.g. ``{"model": model,
    "optimizer": optimizer, "scheduler": scheduler, "loader": loader, "rng": ud.RNG, "epoch": 3}``.
    Prepared models are stored unwrapped (no ``module.`` prefix); optimizers, schedulers, loaders
    and anything else with ``state_dict()`` as their state dicts (a prepared optimizer's includes
    ``steps_taken``); :data:`ud.RNG <unified_dist.checkpoint.rng.RNG>` as every rank's generator states, in
    rank order; tensors on the CPU; plain values as they are. A failed write raises on the main
    process and leaves any previous file at ``path`` intact.

    Without sharding or ``ud.RNG`` it is no collective: call it on every rank or under
    ``if ud.is_main():``, as DDP scripts do; no rank waits for the write, so call :func:`barrier`
    before another rank reads the file. With ``sharding="fsdp"`` or ``tp > 1`` or a ZeRO stage under the deepspeed
    backend (gathering the shards) or an ``ud.RNG`` entry (gathering every rank's generators) it is a collective:
    every rank must call it, every rank raises if the write fails, and rank 0 raises within seconds, naming the
    mistake, when the others do not call it.

    ``async_save=True`` (a collective too) returns once the state is copied off the live tensors and
    writes it in a background thread (:mod:`unified_dist.checkpoint.background`): the next optimizer step
    does not reach the file; a failed write raises on every rank at the next settling point (the next
    collective save, :func:`barrier`, ``should_stop()`` turning True, ``requeue()``, ``shutdown()``).
    """
    _save(obj, path, async_save, None)


def _save(obj: Any, path: str, async_save: bool, keep_last: Optional[int]) -> None:
    """:func:`save`'s work; with ``keep_last`` the main process then keeps that many checkpoints of
    ``path``'s directory (:func:`checkpoint.rotate`, after the write is complete)."""
    backend = current_backend()
    _refuse_models(backend, obj, "save")
    sharded = backend.saves_collectively
    with_rng = _holds_rng(obj)
    if sharded or with_rng or async_save:
        of = "of a sharded model" if sharded else "of ud.RNG" if with_rng else "with async_save=True"
        _every_rank_calls(backend, "save", of)
        session.current().settle_saves()  # the save in flight ends (and its failure is raised) first
    else:
        WRITER.wait()  # one save in flight at a time; a failure is raised at the next settling point
    obj = _rng_states_for_markers(obj) if with_rng else obj
    if sharded:  # an optimizer's state may be gathered too (every rank walks, in the same order)
        obj = nested.map_leaves(lambda leaf: backend.optimizer_state_dict(leaf)
                                if isinstance(leaf, torch.optim.Optimizer) else leaf, obj)
    if async_save:
        state = checkpoint.to_state(obj, backend.unwrap, _staged(backend.rank, sharded), backend.model_state_dict) \
            if sharded or backend.rank == 0 else None  # gathering a shard is a collective
        WRITER.submit(path, (lambda: _write_then_rotate(state, path, keep_last)) if backend.rank == 0 else None)
        return
    state = None
    if sharded:  # gathering a shard is a collective: every rank walks the state
        state = checkpoint.to_state(obj, backend.unwrap, _full_on_main(backend.rank), backend.model_state_dict)
    error = None
    if backend.rank == 0:
        if not sharded:
            state = checkpoint.to_state(obj, backend.unwrap, module_state=backend.model_state_dict)
        error = _write(state, path, keep_last)
    if sharded or with_rng:  # the other ranks are here too: each raises the main process's error
        error = collectives.broadcast(backend, error, 0, what="save")
    if error is not None:
        raise UnifiedDistError(f"saving {path} failed on the main process: {error}")


def reserve_async_save(obj: Any) -> None:
    """Make, in a background thread, the CPU copy that the next ``async_save=True`` save of ``obj`` stages
    into, so that save (the first of a run, say) returns as fast as the later ones: without it, the first
    save also waits for the operating system to give the process that much new memory.

    Call it on every rank (it sends nothing) once ``obj`` holds the tensors it will hold when saved, e.g.
    after the first optimizer step, which creates the optimizer's state. It costs what the first async save
    would keep anyway: one more copy of ``obj``'s tensors in memory on the main process. Training goes on
    while the copy is made; a save called before it is ready waits for it. Nothing under a sharded model
    (its async saves gather each tensor on rank 0 instead) and nothing on the other ranks.
    """
    backend = current_backend()
    if backend.saves_collectively or backend.rank != 0:
        return
    specs: list = []
    checkpoint.to_state(obj, backend.unwrap, lambda t: specs.append((tuple(t.shape), t.dtype)))
    WRITER.reserve(specs)


def _staged(rank: int, sharded: bool) -> Any:
    """How an async save copies each tensor off the live one: into a CPU buffer of its own (the
    previous save's, reused: :meth:`Writer.staging`; a sharded model's full value on rank 0)."""
    if not sharded:
        return WRITER.staging()
    full = _full_on_main(rank)
    return lambda t: None if (value := full(t)) is None else value.clone()


def _write_then_rotate(state: Any, path: str, keep_last: Optional[int]) -> None:
    """Write ``state`` atomically, then (only once it is complete) keep the ``keep_last`` newest checkpoints."""
    checkpoint.write_atomic(state, path)
    if keep_last is not None:
        checkpoint.rotate(os.path.dirname(path), keep_last, path)


def _holds_rng(obj: Any) -> bool:
    return any(leaf is rng.RNG for _, leaf in nested.leaves(obj))


def _rng_states_for_markers(obj: Any) -> Any:
    """``obj`` with each ``ud.RNG`` replaced by every rank's generator states (a collective)."""
    states = rng_states()
    return nested.map_leaves(lambda leaf: states if leaf is rng.RNG else leaf, obj)


def _write(state: Any, path: str, keep_last: Optional[int] = None) -> Optional[str]:
    """:func:`_write_then_rotate`; the failure's one-line summary, or ``None``."""
    try:
        _write_then_rotate(state, path, keep_last)
    except Exception as exc:
        return summary(exc)
    return None


def _every_rank_calls(backend: Any, what: str, of: str = "of a sharded model") -> None:
    """Before a collective save or load (of sharded state, or of ``ud.RNG``): rank 0 raises at once if
    the other ranks do not arrive within :data:`ARRIVAL_SECONDS` (e.g. ``if ud.is_main(): ud.save(...)``),
    instead of hanging in the gather until the collective timeout."""
    seconds = min(ARRIVAL_SECONDS, backend.config.timeout.total_seconds())
    missing = backend.missing_peers(what, seconds)
    if missing:
        raise UnifiedDistError(
            f"ud.{what}() {of} is collective, but rank(s) {', '.join(map(str, missing))} did not call "
            f"it within {seconds:g} s; `if ud.is_main(): ud.{what}(...)` hangs: call ud.{what}(...) on every rank "
            "(only the main process writes)")


def _full_on_main(rank: int) -> Any:
    """Each tensor's full value on the CPU of rank 0; the other ranks take part and keep nothing."""
    def full(t: torch.Tensor) -> Optional[torch.Tensor]:
        value = full_tensor(t.detach())
        return value.cpu() if rank == 0 else None
    return full


def _refuse_models(backend: Any, obj: Any, action: str) -> None:
    """A one-line :class:`CheckpointError` when ``obj`` (a model, or a dict holding one) has weights the backend
    cannot ``action`` in the portable format now (:meth:`~unified_dist.backends.base.Backend.checkpoint_problem`),
    or holds an optimizer whose state it cannot (``optimizer_checkpoint_problem``), before anything is written."""
    values = obj.values() if isinstance(obj, dict) else [obj]
    if any(isinstance(value, torch.nn.Module) for value in values):
        problem = backend.checkpoint_problem("save" if action == "get_state_dict" else action)
        if problem:
            raise CheckpointError(problem)
    if action in ("save", "load") and any(isinstance(leaf, torch.optim.Optimizer) for _, leaf in nested.leaves(obj)):
        problem = backend.optimizer_checkpoint_problem(action)
        if problem:
            raise CheckpointError(problem)


def get_state_dict(model: torch.nn.Module) -> Optional[dict]:
    """The model's full, unsharded state dict (unwrapped keys, CPU tensors) on the main process,
    ``None`` on the others. Every rank must call it (gathering shards is a collective), e.g.
    ``state = ud.get_state_dict(model)`` then ``if ud.is_main(): hf_model.save_pretrained(dir, state_dict=state)``.
    """
    backend = current_backend()
    _refuse_models(backend, model, "get_state_dict")
    if not backend.saves_collectively:  # nothing to gather: only the main process walks
        return checkpoint.to_state(model, backend.unwrap, module_state=backend.model_state_dict) \
            if backend.rank == 0 else None
    _every_rank_calls(backend, "get_state_dict")
    state = checkpoint.to_state(model, backend.unwrap, _full_on_main(backend.rank), backend.model_state_dict)
    return state if backend.rank == 0 else None


def save_sharded(obj: dict, directory: str, *, async_save: bool = False) -> None:
    """Every rank writes its own shards of ``obj``'s model and optimizers to ``directory`` with
    ``torch.distributed.checkpoint``; other values in ``obj`` are written beside them.

    ``obj`` is a dict with exactly one model, e.g. ``{"model": model, "optimizer": optimizer,
    "rng": ud.RNG, "step": step}`` (``ud.RNG``: every rank's generator states). Atomic: a killed save
    leaves the previous checkpoint loadable. For models too large to gather on one rank; :func:`save`
    writes one portable file instead. ``async_save=True``: as :func:`save`'s (each rank copies its
    shards, then writes them in the background, with DCP's collectives on a gloo group of their own).
    """
    backend = current_backend()
    _refuse_models(backend, obj, "save_sharded")
    _every_rank_calls(backend, "save_sharded")
    session.current().settle_saves()
    if _holds_rng(obj):
        obj = _rng_states_for_markers(obj)
    parts = sharded_checkpoint.split(obj, backend.unwrap, _torch_optimizer)
    agree = lambda value: collectives.broadcast(backend, value, 0, what="save_sharded")  # noqa: E731
    if not async_save:
        sharded_checkpoint.save(parts, directory, backend.rank, agree, lambda: collectives.barrier(backend))
        return
    staged = sharded_checkpoint.stage(parts, directory, agree, copy=True)
    group = WRITER.side_group(backend.config.timeout)
    barrier = (lambda: torch.distributed.barrier(group=group)) if group is not None else (lambda: None)
    WRITER.submit(staged.directory, lambda: sharded_checkpoint.write(staged, backend.rank, barrier, group))


def load_sharded(obj: dict, directory: str) -> dict:
    """Load what :func:`save_sharded` wrote into ``obj``'s model and optimizers, under any world
    size and sharding (state is resharded on load), and for an ``ud.RNG`` entry this rank's
    generators; returns the other values that were saved. A background save still in flight ends first."""
    backend = current_backend()
    _refuse_models(backend, obj, "load_sharded")
    _every_rank_calls(backend, "load_sharded")
    session.current().settle_saves()
    extra = sharded_checkpoint.load(sharded_checkpoint.split(obj, backend.unwrap, _torch_optimizer), directory)
    for name in [name for name, value in obj.items() if value is rng.RNG and name in extra]:
        restore_rng_states(extra.pop(name))
    return extra


def _torch_optimizer(obj: Any) -> Optional[torch.optim.Optimizer]:
    """The torch optimizer inside a prepared (or plain) optimizer; ``None`` for anything else."""
    while isinstance(getattr(obj, "optimizer", None), torch.optim.Optimizer):
        obj = obj.optimizer
    return obj if isinstance(obj, torch.optim.Optimizer) else None


def save_checkpoint(obj: Any, directory: str, step: int, keep_last: Optional[int] = 3, *,
                    async_save: bool = False) -> str:
    """:func:`save` to ``directory/checkpoint-<step>.pt``, then keep only the ``keep_last`` newest.

    Older checkpoints are deleted only after the new one is completely written (with ``async_save``,
    by the background write, after its rename), so the last good checkpoint always survives a crash.
    Returns the new checkpoint's path. Collective only where :func:`save` is (sharded models, an
    ``ud.RNG`` entry, ``async_save=True``): ``if ud.is_main(): ud.save_checkpoint(...)`` works otherwise.
    """
    if keep_last is not None:
        checkpoint.check_keep_last(keep_last)  # on every rank, before anyone waits for the write
    path = checkpoint.checkpoint_path(directory, step)
    _save(obj, path, async_save, keep_last)
    if current_backend().saves_collectively and not async_save:
        barrier()
    return path


def latest_checkpoint(directory: str) -> Optional[str]:
    """Path of the newest complete checkpoint written by :func:`save_checkpoint`, or ``None``; on the
    rank writing into ``directory`` in the background, after that write."""
    WRITER.wait(directory)
    return checkpoint.latest(directory)


def load(path: str, state: Optional[dict] = None, map_location: Optional[Any] = None, *, strict: bool = True) -> Any:
    """Read a checkpoint written by :func:`save` (under any backend, any world size) with
    ``weights_only=True``; every rank reads ``path`` itself, so it must be visible to every rank.

    Without ``state``, returns what was saved. With ``state``, the same dict of live objects given to
    :func:`save` (e.g. ``{"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader":
    loader, "rng": ud.RNG, "epoch": 0}``), restores it in place and returns the saved entries that
    ``state`` does not name: models, prepared or not (DDP wrappers and FSDP2 shards included), take
    their weights (``load_state_dict(strict=strict)``); optimizers (a prepared one with its
    ``steps_taken``), loaders and anything else with ``load_state_dict`` their state; schedulers
    theirs after every optimizer (whatever the order of ``state``), and a ``LambdaLR`` (e.g.
    transformers' ``get_linear_schedule_with_warmup``) then sets each group's learning rate from
    this run's lambdas at the restored step; ``ud.RNG`` restores this rank's generators; plain
    values in ``state`` are replaced by the saved ones. A name in ``state`` that the checkpoint
    lacks is a :class:`CheckpointError` before anything is loaded (``strict=False``: skipped, and
    models may miss or add keys). On the rank whose background save writes ``path``, it waits for that
    write (and raises if it failed); another rank reads only after :func:`barrier`. Under a ZeRO stage of the
    deepspeed backend, loading a model or optimizer is a collective (every rank calls it). ``path`` may also be a
    directory DeepSpeed's ``engine.save_checkpoint`` wrote: its model's weights, as ``{"model": weights}`` or into
    the one model ``state`` names (:mod:`unified_dist.checkpoint.deepspeed_directory`).
    """
    if state is not None and not isinstance(state, dict):
        raise CheckpointError(
            f"load(path, state) takes a dict of names to live objects, got {type(state).__name__}; "
            "pass the device as ud.load(path, map_location=...)")
    if deepspeed_directory.holds_one(path):
        return _load_deepspeed_directory(path, state, strict)
    failed = WRITER.wait(path)  # this rank's background save of ``path`` ends first
    if failed and WRITER.unsettled:
        raise CheckpointError(f"{path} was not written: its background save failed ({failed}); "
                              "the file there is the previous one: load it by name if that is what you want")
    saved = checkpoint.read_safe(path, map_location)
    if state is None:
        return saved
    return restore(saved, state, path, strict=strict)


def _load_deepspeed_directory(path: str, state: Optional[dict], strict: bool) -> Any:
    """:func:`load` of a directory written by DeepSpeed's ``engine.save_checkpoint``: its model's float32 weights
    (DeepSpeed's ``zero_to_fp32``), as ``{"model": weights}``, or restored into the one model ``state`` names."""
    weights = deepspeed_directory.read_weights(path)
    if state is None:
        return {"model": weights}
    models = [name for name, value in state.items() if isinstance(value, torch.nn.Module)]
    if len(models) != 1 or len(state) != 1:
        raise CheckpointError(
            f"{path} is a DeepSpeed checkpoint directory, which gives one model's weights only (DeepSpeed's "
            f"zero_to_fp32), not {', '.join(map(repr, state))}: pass ud.load(path, {{'model': model}}), and take the "
            "optimizer's state from a ud.save checkpoint or DeepSpeed's engine.load_checkpoint(dir)")
    return restore({models[0]: weights}, state, path, strict=strict)


def restore(saved: Any, state: dict, source: str, *, strict: bool = True) -> dict:
    """:func:`load`'s work once the checkpoint ``source`` is read: restore ``saved`` into ``state``'s
    live objects (see :func:`load`) and return the entries ``state`` does not name."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"{source} holds a {type(saved).__name__}, not the dict that load(path, state) restores")
    missing = [name for name in state if name not in saved]
    if missing and strict:
        raise CheckpointError(f"{source} has no {', '.join(map(repr, missing))} "
                              f"(it holds {', '.join(map(repr, saved))}); "
                              "leave those names out of state, or pass strict=False to skip them")
    backend = current_backend()
    _refuse_models(backend, {name: state[name] for name in state if name in saved}, "load")
    # schedulers after optimizers (an optimizer's state overwrites the learning rates), RNG last
    names = sorted((name for name in state if name in saved),
                   key=lambda name: 2 if state[name] is rng.RNG else 1 if is_scheduler(state[name]) else 0)
    for name in names:
        target = state[name]
        if target is rng.RNG:
            restore_rng_states(saved[name])
        elif isinstance(target, torch.nn.Module):
            backend.load_model_state_dict(target, saved[name], strict)
        elif isinstance(target, torch.optim.Optimizer):
            backend.load_optimizer_state_dict(target, saved[name], source)
        elif hasattr(target, "load_state_dict") and callable(target.load_state_dict):
            target.load_state_dict(saved[name])
            if is_scheduler(target):
                _lr_from_this_runs_schedule(target.scheduler if isinstance(target, PreparedScheduler) else target)
        else:
            state[name] = saved[name]
    return {name: value for name, value in saved.items() if name not in state}


def _lr_from_this_runs_schedule(scheduler: Any) -> None:
    """After a ``LambdaLR`` took its state: each group's learning rate is ``base_lr * lambda(step)``
    with this run's lambdas (which are code, not state), so a resumed run whose schedule changed
    (e.g. a larger --max-steps) takes the new schedule's rate on its very next step rather than the
    rate the old schedule had left in the optimizer. Other schedulers compute their rate from the
    previous one (``MultiplicativeLR``, ``StepLR``, ...) and are left as they loaded."""
    if not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    groups = scheduler.optimizer.param_groups
    for group, base, factor in zip(groups, scheduler.base_lrs, scheduler.lr_lambdas):
        rate = base * factor(scheduler.last_epoch)
        if isinstance(group["lr"], torch.Tensor):  # a tensor learning rate is updated in place, as torch does
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate
    scheduler._last_lr = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in groups]
