"""``horovod.torch.elastic`` (``run``, ``TorchState``, ``ElasticSampler``) on every launcher.

Under real Horovod (see :func:`unified_dist.horovod.real_horovod`) these are Horovod's own: workers come and
go and the others roll back to the last ``commit()``. Elsewhere the launcher restarts the *whole* job
when a process is lost (``torchrun --max-restarts N``): :func:`run` synchronises the state from rank 0
and runs the function; ``commit()``/``restore()`` keep and bring back an in-memory copy, which a whole-job
restart does not keep (to resume after one, use ``ud.ElasticState(checkpoint_dir=...)``, which writes
its commits to disk: ``docs/faults.md``).
"""
from __future__ import annotations

import copy
import functools
import math
import random
from typing import Any, Callable, Dict

import torch

from . import real_horovod

_OURS = ("TorchState", "ElasticSampler", "run")


def __getattr__(name: str) -> Any:
    real = real_horovod()
    if real is None or name not in _OURS:
        raise AttributeError(f"module 'unified_dist.horovod.elastic' has no attribute {name!r}")
    return getattr(real.elastic, name)


def _hvd() -> Any:
    import unified_dist.horovod as hvd

    return hvd


class _OurTorchState:
    """Horovod's ``TorchState``: ``model``, ``optimizer`` and any keyword (a value or an object with
    ``state_dict``) as attributes; ``commit()`` saves a copy, ``restore()`` brings it back, ``sync()``
    makes every rank hold rank 0's."""

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        items = dict(kwargs)
        if model is not None:
            items["model"] = model
        if optimizer is not None:
            items["optimizer"] = optimizer
        self.__dict__["_items"] = items
        self.__dict__["_saved"] = None
        self.__dict__["_callbacks"] = []
        self.save()

    def __getattr__(self, name: str) -> Any:
        try:
            return self.__dict__["_items"][name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name: str, value: Any) -> None:
        self._items[name] = value

    def _snapshot(self) -> Dict[str, Any]:
        return {k: copy.deepcopy(v.state_dict() if hasattr(v, "state_dict") else v) for k, v in self._items.items()}

    def _apply(self, snapshot: Dict[str, Any]) -> None:
        for key, value in snapshot.items():
            target = self._items.get(key)
            if hasattr(target, "load_state_dict"):
                target.load_state_dict(value)
            else:
                self._items[key] = value

    def register_reset_callbacks(self, callbacks: Any) -> None:
        """Functions to call after a reset (a whole-job restart calls none: the job starts again)."""
        self._callbacks.extend(callbacks)

    def save(self) -> None:
        """Keep a copy of the current state in memory."""
        self.__dict__["_saved"] = self._snapshot()

    def commit(self) -> None:
        """Make the current state the one :meth:`restore` goes back to."""
        self.save()

    def check_host_updates(self) -> None:
        """No host changes off Horovod: the launcher restarts the whole job instead."""

    def restore(self) -> None:
        """Go back to the last committed state."""
        if self._saved is not None:
            self._apply(copy.deepcopy(self._saved))

    def sync(self) -> None:
        """Every rank takes rank 0's state (a collective), then commits it."""
        hvd = _hvd()
        model = self._items.get("model")
        if model is not None:
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = self._items.get("optimizer")
        if optimizer is not None and optimizer.state_dict()["state"]:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        rest = {k: v for k, v in self._snapshot().items() if k not in ("model", "optimizer")}
        self._apply(hvd.broadcast_object(rest, root_rank=0))
        self.save()


class _OurElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``ElasticSampler``: a shuffled (seed + epoch) partition of ``dataset`` over the ranks,
    padded to equal length, that skips the samples :meth:`record_batch` counted in this epoch."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (call it at the end of each epoch): nothing of it is processed yet."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """Count one batch of ``batch_size`` per rank as processed."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> Dict[str, int]:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state_dict: Dict[str, int]) -> None:
        self.epoch = state_dict["epoch"]
        self.processed_num = state_dict["processed_num"]
        self.reset()

    def reset(self) -> None:
        """Partition the samples not yet processed over the current ranks."""
        hvd = _hvd()
        self.num_replicas, self.rank = hvd.size(), hvd.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self) -> Any:
        padded = self.remaining_indices + self.remaining_indices[:self.total_size - len(self.remaining_indices)]
        return iter(padded[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


def _our_run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Decorate ``func(state, ...)``: synchronise ``state`` from rank 0, then run it. A lost process ends
    the job, which the launcher restarts (``torchrun --max-restarts``)."""
    @functools.wraps(func)
    def wrapper(state: Any, *args: Any, **kwargs: Any) -> Any:
        state.sync()
        return func(state, *args, **kwargs)
    return wrapper


if real_horovod() is None:
    TorchState = _OurTorchState
    ElasticSampler = _OurElasticSampler
    run = _our_run
