"""Collectives with one meaning on every backend, built on the Backend primitives.

- ``all_reduce(x, op)``: op in sum/mean/max/min; ``mean`` is ``sum / world_size`` everywhere
  (gloo has no AVG, Horovod averages by default, Accelerate's defaults differ: none leaks through).
- ``all_gather(x)``: concatenation along dim 0 in rank order; dim 0 may differ between ranks.
- Inputs are never modified; nested list/tuple/dict structures are kept (:mod:`unified_dist.nested`).
- Any layout (transposed, sliced, expanded, 0-d, empty) and every dtype of :data:`DTYPES` is taken on
  every backend: what a library refuses travels in a form it takes and comes back exactly
  (:func:`to_wire`); any other dtype is the same one-line :class:`CollectiveError` everywhere.

This layer owns each group's :class:`~unified_dist.collectives.uneven_gather.UnevenGather` (its capacity is
state shared by every gather of the group), used where the backend has no native uneven gather.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, List

import torch

from .. import nested
from ..backends.base import REDUCE_OPS, Backend
from ..errors import CollectiveError, CollectiveTimeout, ShapeMismatch, UnifiedDistError, collective_timeout
from . import checkmode
from .uneven_gather import UnevenGather, shape_mismatch_error

_GATHERERS: "weakref.WeakKeyDictionary[Backend, UnevenGather]" = weakref.WeakKeyDictionary()

DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.uint16, torch.int32, torch.uint32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128)
"""The dtypes every collective takes on every backend."""
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
"""Integers that gloo and NCCL refuse to reduce or broadcast (Horovod refuses the unsigned ones): they
travel in a type that holds every value and are narrowed back, exactly; a sum past the range wraps
modulo 2**bits, as gloo's own uint8/int8 sums do."""


def to_wire(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) in a dtype every backend moves: complex as (real, imaginary) pairs on a new last
    dim, the integers of :data:`_WIDER` widened; anything else as it is. :func:`from_wire` undoes it."""
    if t.is_complex():
        return torch.view_as_real(t)
    wide = _WIDER.get(t.dtype)
    return t if wide is None else t.to(wide)


def from_wire(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a backend returned for a :func:`to_wire` tensor of ``dtype``, in ``dtype`` again."""
    if dtype.is_complex:
        return torch.view_as_complex(out.contiguous())
    return out if out.dtype == dtype else out.to(dtype)


def map_each(x: Any, fn: Callable[[torch.Tensor], Any], what: str) -> Any:
    """Apply ``fn`` to every tensor in a nested list/tuple/dict; any other leaf is a :class:`CollectiveError`."""
    validate(x, what)
    return nested.map_tensors(fn, x)


def validate(x: Any, what: str, op: str = "") -> None:
    """Raise the one-line :class:`CollectiveError` when ``x`` holds anything but tensors of :data:`DTYPES`
    (or, for ``op`` max/min, a complex tensor: complex numbers have no order)."""
    bad = nested.first_non_tensor(x)
    if bad is not None:
        path, leaf = bad
        raise CollectiveError(
            f"{what} expects a tensor or a nested list/tuple/dict of tensors, but {path} is "
            f"{type(leaf).__name__}; wrap numbers with torch.tensor(...)")
    for path, leaf in nested.leaves(x):
        name = str(leaf.dtype).replace("torch.", "")
        if leaf.dtype not in DTYPES:
            raise CollectiveError(f"{what} does not take {name} tensors ({path}); cast first, e.g. "
                                  f"{path}.to(torch.float32) or .to(torch.int64)")
        if op in ("max", "min") and leaf.is_complex():
            raise CollectiveError(f"{what} {op} has no order for {name} tensors ({path}); reduce "
                                  f"{path}.abs() or {path}.real instead")


def _private_copy(backend: Backend, t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy on the backend's device, so the caller's tensor is never touched."""
    return t.detach().to(backend.device, copy=True, memory_format=torch.contiguous_format)


@contextlib.contextmanager
def guarded(backend: Backend, what: str, checked: Any = None, **args: Any) -> Iterator[None]:
    """Run one collective: compare signatures first in check mode; the backend turns its library's
    errors for hangs and lost peers into :class:`CollectiveTimeout` and :class:`PeerLost`
    (:meth:`Backend.translate_error`); a timeout the backend raised itself gets ``what``'s name."""
    if backend.config.debug:
        checkmode.verify(backend, checkmode.signature(what, checked, **args))
    with translated(backend, what):
        yield


@contextlib.contextmanager
def translated(backend: Backend, what: str) -> Iterator[None]:
    """The library's errors for hangs and lost peers during ``what`` (a collective, or a step that waits for
    the other ranks, such as a shutdown's barrier) as :class:`CollectiveTimeout` and :class:`PeerLost`."""
    try:
        yield
    except CollectiveTimeout as exc:
        if exc.collective is not None:
            raise
        raise collective_timeout(what, backend.rank, int(backend.config.timeout.total_seconds()), exc) from exc
    except UnifiedDistError:
        raise
    except Exception as exc:
        meaning = backend.translate_error(exc, what)
        if meaning is None:
            raise
        raise meaning from exc


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
    validate(x, "all_reduce", op)  # before any rank communicates

    def reduce_one(t: torch.Tensor) -> torch.Tensor:
        work = _private_copy(backend, t)
        if work.dtype == torch.bool:
            work = work.to(torch.int64)
        if op == "mean" and not (work.is_floating_point() or work.is_complex()):
            work = work.to(torch.float64)
        out = from_wire(backend.all_reduce_(to_wire(work), "sum" if op == "mean" else op), work.dtype)
        if op == "mean":
            return out / backend.world_size
        return out.to(torch.bool) if t.dtype == torch.bool and op != "sum" else out

    with guarded(backend, "all_reduce", x, op=op):
        return nested.map_tensors(reduce_one, x)


def all_gather(backend: Backend, x: Any, what: str = "all_gather") -> Any:
    """Concatenate every rank's tensors along dim 0 in rank order (0-d tensors become one row).

    Dim 0 may differ between ranks; the other dims and the dtype must match, else every rank
    raises a :class:`CollectiveError` naming each rank's shape.
    """
    validate(x, what)
    with guarded(backend, what, x):
        return nested.map_tensors(lambda t: _gather_one(backend, t), x)


def _uneven(backend: Backend) -> UnevenGather:
    """The group's gatherer over :meth:`Backend.all_gather_equal` and :meth:`Backend.broadcast_`."""
    gatherer = _GATHERERS.get(backend)
    if gatherer is None:
        gatherer = _GATHERERS[backend] = UnevenGather(backend.all_gather_equal, backend.broadcast_, backend.rank)
    return gatherer


def _native_uneven(backend: Backend, tensor: torch.Tensor) -> torch.Tensor:
    """The backend's own uneven gather; its shape mismatch becomes the message naming every rank's shape."""
    try:
        return backend.all_gather_uneven(tensor)
    except ShapeMismatch:
        pass
    raise shape_mismatch_error(backend.all_gather_equal, tensor)  # every rank failed: all exchange headers


def _packed(t: torch.Tensor) -> bool:
    """Whether ``t``'s strides are exactly row-major (``is_contiguous`` forgives any stride on a dim of
    size 1, which a byte view of the memory does not)."""
    step = 1
    for size, stride in zip(reversed(t.shape), reversed(t.stride())):
        if stride != step:
            return False
        step *= size
    return True


def _gather_one(backend: Backend, t: torch.Tensor) -> torch.Tensor:
    # the values of a lazy conj()/neg view travel, not its memory; gathering copies, the input stays untouched
    work = t.detach().to(backend.device).resolve_conj().resolve_neg()
    if not _packed(work):
        work = work.clone(memory_format=torch.contiguous_format)
    if work.dim() == 0:
        work = work.reshape(1)
    if backend.world_size == 1:
        return work.clone()
    wire = to_wire(work)
    out = _native_uneven(backend, wire) if backend.gathers_uneven else _uneven(backend)(wire)
    return from_wire(out, work.dtype)


def _gather_parts(backend: Backend, tensor: torch.Tensor) -> List[torch.Tensor]:
    """Every rank's ``tensor`` (1-d or more; dim 0 may differ) in rank order."""
    if not backend.gathers_uneven:
        return _uneven(backend).parts(tensor)
    lengths = backend.all_gather_equal(torch.tensor([tensor.shape[0]], dtype=torch.int64))
    return list(torch.split(_native_uneven(backend, tensor), lengths.reshape(-1).tolist()))


def broadcast(backend: Backend, obj: Any, src: int = 0, what: str = "broadcast") -> Any:
    """Rank ``src``'s value on every rank: a tensor (same shape/dtype on all ranks) or any picklable object."""
    if not 0 <= src < backend.world_size:
        raise CollectiveError(f"{what} src={src} is not a rank; use 0 .. {backend.world_size - 1}")
    is_tensor = isinstance(obj, torch.Tensor)
    if is_tensor:
        validate(obj, what)
    with guarded(backend, what, obj if is_tensor else None, src=src, tensor=is_tensor):
        if is_tensor:
            return from_wire(backend.broadcast_(to_wire(_private_copy(backend, obj)), src), obj.dtype)
        return backend.broadcast_object(obj, src)


def all_gather_object(backend: Backend, obj: Any) -> List[Any]:
    """Every rank's picklable ``obj``, in rank order (payloads may differ in size)."""
    import pickle

    with guarded(backend, "all_gather_object"):
        if backend.world_size == 1:
            return [pickle.loads(pickle.dumps(obj))]
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(backend.device)
        return [pickle.loads(part.cpu().numpy().tobytes()) for part in _gather_parts(backend, payload)]
