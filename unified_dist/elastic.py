"""Training state that survives a lost process, on every backend.

    state = ud.ElasticState(model=model, optimizer=optimizer, scheduler=scheduler,
                            loader=train_loader, step=0, checkpoint_dir="ckpts")

    @ud.elastic_run
    def train(state):
        for batch in state.loader:          # resumes where the last commit left it
            ...
            state.step += 1
            if state.step % 10 == 0:
                state.commit()

    train(state)

- Under ``horovodrun`` in elastic mode (``--min-np/--max-np/--host-discovery-script``),
  ``commit()`` keeps an in-memory copy (``horovod.common.elastic.State``) and ``elastic_run`` is
  ``horovod.torch.elastic.run``: when a process is lost, the others roll back to the last commit
  and continue with the processes left (and new ones, when the discovery script offers them).
- Under ``torchrun --max-restarts N`` (or ``accelerate launch --max_restarts N``) the launcher
  restarts every process; ``commit()`` writes ``checkpoint_dir/checkpoint-<step>.pt`` (atomic,
  rotated) and a new ``ElasticState`` loads the newest one, so the restarted job continues.

With ``checkpoint_dir`` set, Horovod commits also write the checkpoint (for whole-job restarts).
Objects are anything with ``state_dict``/``load_state_dict`` (prepared models are stored
unwrapped); every other keyword is a plain value, readable and writable as an attribute.

A checkpoint is what ``ud.save_checkpoint({**objects, **values, "rng": ud.RNG}, checkpoint_dir, step)``
writes: one flat dict, name -> state or value, plus every rank's generators under ``"rng"``. So
``ud.load(path, {"model": model, ..., "rng": ud.RNG})`` restores an ElasticState checkpoint, and an
ElasticState resumes from a ``save_checkpoint`` of that dict. The name ``rng`` is therefore reserved.
Checkpoints of the earlier nested layout (``{"objects": ..., "values": ..., "rng": ...}``) still load.
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, Optional

import torch

from . import facade, nested, saving
from .checkpoint import rng
from .errors import CheckpointError, UnifiedDistError

_OWN = ("_objects", "_values", "checkpoint_dir", "keep_last", "restored_from", "backend_state")
RNG_KEY = "rng"
"""Where a checkpoint (and a snapshot) holds the generators: a list of rank states (ud.rng_states())."""


class ElasticState:
    """Named objects and values committed together; see the module docstring."""

    def __init__(self, checkpoint_dir: Optional[str] = None, keep_last: int = 2, **items: Any) -> None:
        if RNG_KEY in items:
            raise UnifiedDistError(f"ElasticState(..., {RNG_KEY}=...): the name {RNG_KEY!r} is where its checkpoints "
                                   "keep every rank's random generators (restored for you); choose another name")
        object.__setattr__(self, "_objects", {k: v for k, v in items.items() if hasattr(v, "state_dict")})
        object.__setattr__(self, "_values", {k: v for k, v in items.items() if k not in self._objects})
        self.checkpoint_dir = checkpoint_dir
        self.keep_last = keep_last
        self.restored_from: Optional[str] = None
        self.backend_state: Any = None  # what the backend keeps for elastic runs (Horovod's State)
        latest = saving.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
        if latest is not None:
            self._apply(saving.load(latest), latest, restore_rng=True)
            self.restored_from = latest

    # values as attributes ------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name in self._values:
            return self._values[name]
        if name in self._objects:
            return self._objects[name]
        raise AttributeError(name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _OWN:
            object.__setattr__(self, name, value)
        elif name in self._objects:
            raise AttributeError(f"{name} is a tracked object; load a state into it instead of replacing it")
        else:
            self._values[name] = value

    # snapshots -----------------------------------------------------------------
    def snapshot(self) -> Dict[str, Any]:
        """A deep copy of every object's state, every value and this rank's RNG (no communication),
        in the checkpoint's flat layout; its ``"rng"`` list holds this rank's generators only."""
        snap = {name: _cpu_copy(_live(obj).state_dict()) for name, obj in self._objects.items()}
        snap.update(copy.deepcopy(self._values))
        snap[RNG_KEY] = [rng.capture()]
        return snap

    def apply(self, snapshot: Dict[str, Any], restore_rng: bool = True) -> None:
        """Load ``snapshot`` (from :meth:`snapshot` or a checkpoint, either layout) into the objects and
        values; with ``restore_rng``, this rank's generators too (rank r takes ``rng[r % len(rng)]``)."""
        self._apply(snapshot, "the snapshot", restore_rng)

    def _apply(self, saved: Any, source: str, restore_rng: bool) -> None:
        flat = _flat(saved)
        live: Dict[str, Any] = dict(self._objects)
        if restore_rng and flat.get(RNG_KEY):
            live[RNG_KEY] = rng.RNG
        values = saving.restore(flat, live, source)  # every object must be there; schedulers after optimizers
        values.pop(RNG_KEY, None)
        self._values.update(values)

    def save_checkpoint(self) -> Optional[str]:
        """Write the current state to ``checkpoint_dir`` (rotated); ``None`` without a directory.
        Every rank calls it (the generators of every rank are gathered)."""
        if not self.checkpoint_dir:
            return None
        step = int(self._values.get("step", 0))
        return saving.save_checkpoint({**self._objects, **self._values, RNG_KEY: rng.RNG}, self.checkpoint_dir, step,
                                      keep_last=self.keep_last)

    def commit(self) -> None:
        """Make the current state the one a failure rolls back to. Every rank calls it."""
        facade.current_backend().elastic_commit(self)


def elastic_run(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``fn(state, ...)`` so a lost process does not end the job."""

    @functools.wraps(fn)
    def wrapper(state: ElasticState, *args: Any, **kwargs: Any) -> Any:
        return facade.current_backend().elastic_run(fn, state, *args, **kwargs)

    return wrapper


def _live(obj: Any) -> Any:
    """What holds ``obj``'s state: a prepared model's original module, else ``obj``."""
    return facade.unwrap(obj) if isinstance(obj, torch.nn.Module) else obj


def _flat(saved: Any) -> Dict[str, Any]:
    """A checkpoint or snapshot in the flat layout; the earlier nested one is converted."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"an ElasticState checkpoint is a dict, got {type(saved).__name__}")
    if set(saved) <= {"objects", "values", "rng", "rng_local"} and isinstance(saved.get("objects"), dict) \
            and isinstance(saved.get("values"), dict):  # {"objects": ..., "values": ..., "rng"/"rng_local": ...}
        states = saved.get("rng") or ([saved["rng_local"]] if saved.get("rng_local") else None)
        return {**saved["objects"], **saved["values"], **({RNG_KEY: states} if states else {})}
    return saved


def _cpu_copy(state: Any) -> Any:
    """A deep copy of ``state`` whose tensors are detached copies on the CPU."""
    return nested.map_leaves(
        lambda leaf: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else copy.deepcopy(leaf),
        state)
