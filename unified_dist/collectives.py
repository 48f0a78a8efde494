"""Collectives with one meaning on every backend, built on the Backend primitives.

- ``all_reduce(x, op)``: op in sum/mean/max/min; ``mean`` is ``sum / world_size`` everywhere
  (gloo has no AVG, Horovod averages by default, Accelerate's defaults differ: none leaks through).
- ``all_gather(x)``: concatenation along dim 0 in rank order; dim 0 may differ between ranks.
- Inputs are never modified; nested list/tuple/dict structures are kept.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, List

import torch

from . import checkmode
from .backends.base import Backend
from .errors import CollectiveError, UnifiedDistError

REDUCE_OPS = ("sum", "mean", "max", "min")


def map_tensors(x: Any, fn: Callable[[torch.Tensor], Any], what: str, path: str = "x") -> Any:
    """Apply ``fn`` to every tensor in a nested list/tuple/dict; anything else is an error."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return type(x)((k, map_tensors(v, fn, what, f"{path}[{k!r}]")) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        items = [map_tensors(v, fn, what, f"{path}[{i}]") for i, v in enumerate(x)]
        return type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
    raise CollectiveError(
        f"{what} expects a tensor or a nested list/tuple/dict of tensors, but {path} is "
        f"{type(x).__name__}; wrap numbers with torch.tensor(...)")


def _private_copy(backend: Backend, t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy on the backend's device, so the caller's tensor is never touched."""
    return t.detach().to(backend.device, copy=True, memory_format=torch.contiguous_format)


@contextlib.contextmanager
def guarded(backend: Backend, what: str, checked: Any = None, **args: Any) -> Iterator[None]:
    """Run one collective: compare signatures first in check mode; the backend turns its library's
    errors for hangs and lost peers into :class:`CollectiveTimeout` and :class:`PeerLost`."""
    if backend.config.debug:
        checkmode.verify(backend, checkmode.signature(what, checked, **args))
    try:
        yield
    except UnifiedDistError:
        raise
    except Exception as exc:
        translated = backend.translate_error(exc, what)
        if translated is None:
            raise
        raise translated from exc


def barrier(backend: Backend) -> None:
    """Return when every rank has called it."""
    with guarded(backend, "barrier"):
        backend.barrier()


def all_reduce(backend: Backend, x: Any, op: str = "mean") -> Any:
    """Reduce every tensor in ``x`` across ranks; returns new tensors on the backend's device.

    ``mean`` of an integer or bool tensor returns a floating tensor (the true mean).
    """
    if op not in REDUCE_OPS:
        raise CollectiveError(f"unknown all_reduce op {op!r}; use one of {', '.join(REDUCE_OPS)}")
    if not isinstance(x, torch.Tensor):
        map_tensors(x, lambda t: t, "all_reduce")  # validate before any rank communicates

    def reduce_one(t: torch.Tensor) -> torch.Tensor:
        work = _private_copy(backend, t)
        was_bool = work.dtype == torch.bool
        if was_bool:
            work = work.to(torch.int64)
        if op == "mean" and not work.is_floating_point():
            work = work.to(torch.float64)
        out = backend.all_reduce_(work, "sum" if op == "mean" else op)
        if op == "mean":
            return out / backend.world_size
        return out.to(torch.bool) if was_bool and op != "sum" else out

    with guarded(backend, "all_reduce", x, op=op):
        return map_tensors(x, reduce_one, "all_reduce")


def all_gather(backend: Backend, x: Any, what: str = "all_gather") -> Any:
    """Concatenate every rank's tensors along dim 0 in rank order (0-d tensors become one row).

    Dim 0 may differ between ranks; the other dims and the dtype must match, else every rank
    raises a :class:`CollectiveError` naming each rank's shape.
    """
    map_tensors(x, lambda t: t, "all_gather")
    with guarded(backend, what, x):
        return map_tensors(x, lambda t: _gather_one(backend, t), what)


def _gather_one(backend: Backend, t: torch.Tensor) -> torch.Tensor:
    work = t.detach().to(backend.device).contiguous()  # gathering copies it; the input stays untouched
    if work.dim() == 0:
        work = work.reshape(1)
    if backend.world_size == 1:
        return work.clone()
    return backend.all_gather_uneven(work)


def broadcast(backend: Backend, obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s value on every rank: a tensor (same shape/dtype on all ranks) or any picklable object."""
    if not 0 <= src < backend.world_size:
        raise CollectiveError(f"broadcast src={src} is not a rank; use 0 .. {backend.world_size - 1}")
    is_tensor = isinstance(obj, torch.Tensor)
    with guarded(backend, "broadcast", obj if is_tensor else None, src=src, tensor=is_tensor):
        if is_tensor:
            return backend.broadcast_(_private_copy(backend, obj), src)
        return backend.broadcast_object(obj, src)


def all_gather_object(backend: Backend, obj: Any) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order (payloads may differ in size)."""
    import pickle

    with guarded(backend, "all_gather_object"):
        if backend.world_size == 1:
            return [pickle.loads(pickle.dumps(obj))]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(backend.device)
        return [pickle.loads(part.cpu().numpy().tobytes()) for part in backend.all_gather_parts(payload)]
