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
"""
from __future__ import annotations

import copy
import functools
from typing import Any, Callable, Dict, Optional

import torch

from . import facade, nested, rng, saving

_OWN = ("_objects", "_values", "checkpoint_dir", "keep_last", "restored_from", "backend_state")


class ElasticState:
    """Named objects and values committed together; see the module docstring."""

    def __init__(self, checkpoint_dir: Optional[str] = None, keep_last: int = 2, **items: Any) -> None:
        object.__setattr__(self, "_objects", {k: v for k, v in items.items() if hasattr(v, "state_dict")})
        object.__setattr__(self, "_values", {k: v for k, v in items.items() if k not in self._objects})
        self.checkpoint_dir = checkpoint_dir
        self.keep_last = keep_last
        self.restored_from: Optional[str] = None
        self.backend_state: Any = None  # what the backend keeps for elastic runs (Horovod's State)
        latest = saving.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
        if latest is not None:
            self.apply(saving.load(latest))
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
        """A deep copy of every object's state, every value and this rank's RNG (no communication)."""
        objects = {}
        for name, obj in self._objects.items():
            if isinstance(obj, torch.nn.Module):
                state = facade.unwrap(obj).state_dict()
            else:
                state = obj.state_dict()
            objects[name] = _cpu_copy(state)
        return {"objects": objects, "values": copy.deepcopy(self._values), "rng_local": rng.capture()}

    def apply(self, snapshot: Dict[str, Any], restore_rng: bool = True) -> None:
        """Load ``snapshot`` (from :meth:`snapshot` or a checkpoint) into the objects and values.

        RNG: a checkpoint's per-rank ``rng`` list, else the snapshot's own ``rng_local``.
        """
        for name, state in snapshot["objects"].items():
            obj = self._objects[name]
            (facade.unwrap(obj) if isinstance(obj, torch.nn.Module) else obj).load_state_dict(state)
        self._values.update(snapshot["values"])
        if restore_rng and snapshot.get("rng"):
            facade.restore_rng_states(snapshot["rng"])
        elif restore_rng and snapshot.get("rng_local"):
            rng.restore(snapshot["rng_local"])

    def save_checkpoint(self) -> Optional[str]:
        """Write the current state to ``checkpoint_dir`` (rotated); ``None`` without a directory."""
        if not self.checkpoint_dir:
            return None
        step = int(self._values.get("step", 0))
        state = self.snapshot()
        state["rng"] = facade.rng_states()  # every rank's generators (a collective: all ranks commit)
        del state["rng_local"]
        return saving.save_checkpoint(state, self.checkpoint_dir, step, keep_last=self.keep_last)

    def commit(self) -> None:
        """Make the current state the one a failure rolls back to. Every rank calls it."""
        facade.current_backend().elastic_commit(self)


def elastic_run(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate the training function ``fn(state, ...)`` so a lost process does not end the job."""

    @functools.wraps(fn)
    def wrapper(state: ElasticState, *args: Any, **kwargs: Any) -> Any:
        return facade.current_backend().elastic_run(fn, state, *args, **kwargs)

    return wrapper


def _cpu_copy(state: Any) -> Any:
    """A deep copy of ``state`` whose tensors are detached copies on the CPU."""
    return nested.map_leaves(
        lambda leaf: leaf.detach().to("cpu", copy=True) if isinstance(leaf, torch.Tensor) else copy.deepcopy(leaf),
        state)
