"""Horovod's collectives (``horovod.torch.mpi_ops`` of 0.28.1) over torch.distributed.

The contract of each function is Horovod's; what differs is how it is carried:

- reduce ops are Horovod's integers (``Average`` 0, ``Sum`` 1, ``Adasum`` 2, ``Min`` 3, ``Max`` 4,
  ``Product`` 5), so a script may hand ours to real Horovod and back. ``Average`` is the sum divided
  by the process set's size (gloo has no average); ``prescale_factor``/``postscale_factor`` scale
  before and after the sum of ``Sum`` and ``Average``; integer tensors are scaled in float64 and
  truncated back, as Horovod's CPU kernels do.
- ``*_async`` returns an integer handle; :func:`poll` says whether its transfers finished,
  :func:`synchronize` waits, finishes (scaling, unpadding) and returns the result (``None`` for an
  unknown handle, as Horovod).
- ``allgather`` takes a different first dimension per rank: every rank first sends its shape and
  dtype in one small gather (a mismatch in any other dimension or in dtype is an error on every
  rank, naming each rank's shape), then its rows padded to the longest.
- ``name`` is accepted and not needed: torch.distributed matches collectives by call order, so
  every rank must issue them in the same order (Horovod negotiates by name instead).
- Process sets map to torch sub-groups (:class:`ProcessSet`).
"""
from __future__ import annotations

import itertools
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import UnifiedDistError

Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "Average", Sum: "Sum", Adasum: "Adasum", Min: "Min", Max: "Max", Product: "Product"}


class HorovodInternalError(UnifiedDistError):
    """A collective failed (Horovod's name for it, a RuntimeError as there; raised where Horovod raises it)."""


class NotOffHorovod(UnifiedDistError, NotImplementedError):
    """A Horovod feature that only Horovod's own engine provides; the message names the alternative."""


# ---------------------------------------------------------------------- process sets
class ProcessSet:
    """The ranks a collective runs over (Horovod's ``ProcessSet``): build one from a list of global
    ranks and register it with :func:`add_process_set` (every rank calls it) or ``init(process_sets=...)``.

    ``size()``/``rank()`` answer ``None`` until it is registered; ``rank()`` is the index in the set
    (collectives still take global ranks, e.g. ``root_rank``)."""

    process_set_id: Optional[int] = None
    ranks: Optional[List[int]] = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Any) -> None:
        if not isinstance(ranks_or_comm, (list, tuple, range, set)):
            raise NotOffHorovod("ProcessSet from an MPI communicator needs Horovod built with MPI; give the "
                                "list of global ranks instead: ProcessSet([0, 1])")
        ranks = sorted(ranks_or_comm)
        if any(not isinstance(r, int) for r in ranks):
            raise ValueError("ProcessSet should be initialized with a list of process ranks")
        self.ranks = ranks
        self._group: Any = None  # the torch sub-group (None: the default group)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set, or ``None`` when not registered."""
        return None if self.process_set_id is None else len(self.ranks or [])

    def rank(self) -> Optional[int]:
        """This process's index in the set, or ``None`` when not registered."""
        if self.process_set_id is None:
            return None
        return self.ranks.index(_world.rank) if _world.rank in self.ranks else -1

    def included(self) -> Optional[bool]:
        """Whether this process belongs to the set (``None`` before ranks are known)."""
        return None if self.ranks is None else _world.rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm=None)"


class _World:
    """What :func:`unified_dist.horovod.init` learnt: rank and size (the session's), the process sets."""

    def __init__(self) -> None:
        self.rank = 0
        self.size = 1
        self.sets: Dict[int, ProcessSet] = {}
        self.next_id = 1
        self.distributed = False  # a torch default group runs the collectives
        self.timeout: Any = None  # the session's collective timeout, also for the process sets' groups
        self.check = False  # ud.init(debug=True): gradient allreduces also compare shapes across ranks


_world = _World()
global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _register(ps: ProcessSet) -> ProcessSet:
    """Give ``ps`` an id and a torch sub-group (a collective: every rank calls it, in the same order)."""
    if any(r < 0 or r >= _world.size for r in ps.ranks):
        raise ValueError(f"{ps} names ranks outside 0 .. {_world.size - 1}")
    if any(other.ranks == ps.ranks for other in _world.sets.values()) or ps.ranks == global_process_set.ranks:
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    ps._group = dist.new_group(ps.ranks, timeout=_world.timeout) if _world.distributed else None
    ps.process_set_id = _world.next_id
    _world.next_id += 1
    _world.sets[ps.process_set_id] = ps
    return ps


def add_process_set(process_set: Any) -> ProcessSet:
    """Register ``process_set`` (a :class:`ProcessSet` or a list of global ranks) on every rank; returns it."""
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    return _register(ps)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister ``process_set`` (every rank calls it); ``False`` for the global set or an unknown one."""
    pid = process_set.process_set_id
    if pid is None or pid == 0 or pid not in _world.sets:
        return False
    del _world.sets[pid]
    if process_set._group is not None:
        dist.destroy_process_group(process_set._group)
    process_set._group = None
    process_set._invalidate()
    return True


def _members(ps: ProcessSet) -> Tuple[Any, int, int]:
    """(torch group, size, index of this process) of ``ps``; refuses a set this process is not in."""
    if ps.process_set_id is None:
        raise ValueError(f"{ps} is not registered: call hvd.add_process_set(...) on every rank first")
    if not ps.included():
        raise ValueError(f"rank {_world.rank} is not in {ps}: only its ranks may call collectives on it")
    return ps._group, len(ps.ranks), ps.ranks.index(_world.rank)


def _communicates(ps: ProcessSet) -> bool:
    return _world.distributed and len(ps.ranks) > 1


# ---------------------------------------------------------------------- handles
class _Pending:
    """The transfers of one ``*_async`` call and what turns their buffers into its result."""

    def __init__(self, works: Sequence[Any], finish: Callable[[], Any], name: Optional[str]) -> None:
        self.works = [w for w in works if w is not None]
        self.finish = finish
        self.name = name


_handles: Dict[int, _Pending] = {}
_in_flight: Dict[str, int] = {}  # the name of each operation not yet synchronized -> its handle
_counter = itertools.count(1)


def _claim(name: Optional[str]) -> None:
    """Refuse a second operation under the name of one still in flight, before anything is sent (Horovod's
    ``ValueError``; the other ranks have not started it, so nothing is left half-done)."""
    if name is not None and name in _in_flight:
        raise ValueError(f"an operation named {name!r} is still in flight (handle {_in_flight[name]}): "
                         "synchronize it first, or give this one another name")


def _handle(works: Sequence[Any], finish: Callable[[], Any], name: Optional[str] = None) -> int:
    number = next(_counter)
    _handles[number] = _Pending(works, finish, name)
    if name is not None:
        _in_flight[name] = number
    return number


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` finished (then :func:`synchronize` does not block)."""
    pending = _handles.get(handle)
    return pending is None or all(w.is_completed() for w in pending.works)


def synchronize(handle: int) -> Any:
    """Wait for ``handle``'s operation and return its result (``None`` for an unknown handle)."""
    pending = _handles.pop(handle, None)
    if pending is None:
        return None
    if pending.name is not None:
        _in_flight.pop(pending.name, None)
    try:
        for work in pending.works:
            work.wait()
    except RuntimeError as exc:
        raise HorovodInternalError(exc) from exc
    return pending.finish()


def reset() -> None:
    """Forget every handle (``init``/``shutdown``)."""
    _handles.clear()
    _in_flight.clear()


# ---------------------------------------------------------------------- allreduce
def resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    """Horovod's ``op``/deprecated ``average`` pair as one op (``Average`` when neither is given)."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        resolved = op
    elif average is not None:
        resolved = Average if average else Sum
    else:
        resolved = Average
    if resolved == Adasum:
        raise NotOffHorovod("op=hvd.Adasum is Horovod's own reduction algorithm and runs only on Horovod "
                            "(horovodrun); use op=hvd.Average")
    if resolved not in _OP_NAMES:
        raise ValueError(f"unknown reduce op {op!r}; use hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return resolved


_TORCH_OP = {Average: "SUM", Sum: "SUM", Min: "MIN", Max: "MAX", Product: "PRODUCT"}


def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """Multiply ``tensor`` by ``factor`` in place; integers in float64, truncated back."""
    if factor == 1.0:
        return tensor
    if tensor.is_floating_point() or tensor.is_complex():
        if tensor.dtype == torch.float16 and tensor.device.type == "cpu":
            return tensor.copy_(tensor.float() * factor)
        return tensor.mul_(factor)
    return tensor.copy_((tensor.double() * factor).trunc().to(tensor.dtype))


def _movable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s bytes in a dtype gloo moves (it refuses int16: those travel as float16, bit for bit)."""
    return tensor.view(torch.float16) if tensor.dtype == torch.int16 else tensor


def _check_tensor(tensor: Any, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"hvd.{what} takes a torch.Tensor, got {type(tensor).__name__}")


def allreduce_start_(tensor: torch.Tensor, op: int, prescale_factor: float, postscale_factor: float,
                     process_set: ProcessSet, check: bool = True) -> Tuple[Any, Callable[[], torch.Tensor]]:
    """Reduce ``tensor`` in place: the transfer started, and what finishes it (returns ``tensor``). With
    ``check`` (and always under ``ud.init(debug=True)``) the ranks first compare shape, dtype and op."""
    _check_tensor(tensor, "allreduce")
    group, size, _ = _members(process_set)
    summing = op in (Average, Sum)
    if summing:
        scale_(tensor, prescale_factor)
    work = None
    if _communicates(process_set):
        if check or _world.check:
            _agree("allreduce", tensor, group, size, op)
        wire = tensor.to(torch.int32) if tensor.dtype in (torch.bool, torch.int16) else tensor  # gloo: no int16
        work = dist.all_reduce(wire, op=getattr(dist.ReduceOp, _TORCH_OP[op]), group=group, async_op=True)
    else:
        wire = tensor

    def finish() -> torch.Tensor:
        if wire is not tensor:
            tensor.copy_(wire)
        if summing:
            scale_(tensor, postscale_factor / size if op == Average else postscale_factor)
        return tensor
    return work, finish


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` in place across ``process_set``; a handle whose result is ``tensor``."""
    _claim(name)
    work, finish = allreduce_start_(tensor, resolve_op(op, average), prescale_factor, postscale_factor, process_set)
    return _handle([work], finish, name)


def gradient_allreduce_async_(tensor: torch.Tensor, op: int, prescale_factor: float, postscale_factor: float,
                              process_set: ProcessSet) -> int:
    """:func:`allreduce_async_` for ``DistributedOptimizer``'s gradients, without the shape comparison
    (every rank's parameters have the same shapes; ``ud.init(debug=True)`` compares them anyway)."""
    work, finish = allreduce_start_(tensor, op, prescale_factor, postscale_factor, process_set, check=False)
    return _handle([work], finish)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """As :func:`allreduce_async_` into a new tensor: the input is not modified."""
    _check_tensor(tensor, "allreduce_async")
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor,
                            process_set)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place across ``process_set`` (``Average`` by default); returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing every tensor of ``tensors`` in place; one handle whose result is the list."""
    resolved = resolve_op(op, average)
    _claim(name)
    started = [allreduce_start_(t, resolved, prescale_factor, postscale_factor, process_set) for t in tensors]
    return _handle([w for w, _ in started], lambda: [finish() for _, finish in started], name)


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """As :func:`grouped_allreduce_async_` into new tensors: the inputs are not modified."""
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Reduce every tensor of ``tensors`` in place; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# ---------------------------------------------------------------------- allgather
_DTYPE_CODES = {dtype: i for i, dtype in enumerate(
    [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
     torch.float32, torch.float64, torch.complex64, torch.complex128])}
_MAX_DIMS = 16


def _shapes(tensor: torch.Tensor, group: Any, size: int, extra: int = 0) -> List[Tuple[int, ...]]:
    """Every member's (``extra``, dtype code, ndim, shape...) in set order: one small blocking gather."""
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(f"collectives take at most {_MAX_DIMS} dimensions, got {tensor.dim()}")
    header = torch.full((_MAX_DIMS + 3,), -1, dtype=torch.int64)
    header[0], header[1], header[2] = extra, _DTYPE_CODES.get(tensor.dtype, -2), tensor.dim()
    header[3:3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
    out = torch.empty(size * header.numel(), dtype=torch.int64)
    _gather_cpu(out, header, group)
    rows = out.view(size, -1).tolist()
    return [tuple(r[:3 + r[2]]) for r in rows]


def _agree(what: str, tensor: torch.Tensor, group: Any, size: int, extra: int = 0) -> None:
    """Raise :class:`HorovodInternalError` on every member unless all send the same dtype, shape and
    ``extra`` (a broadcast's root): what Horovod's negotiation refuses, instead of gloo mixing the bytes."""
    rows = _shapes(tensor, group, size, extra)
    if len(set(rows)) != 1:
        raise HorovodInternalError(f"Mismatched {what} tensor shapes, dtypes or root ranks across ranks: "
                                   f"(root, dtype code, ndim, shape...) per rank {rows}")


def _gather_cpu(out: torch.Tensor, header: torch.Tensor, group: Any) -> None:
    """A gather of small int64 headers (through the group's device)."""
    device = _group_device(group)
    parts = [torch.empty_like(header, device=device) for _ in range(out.numel() // header.numel())]
    dist.all_gather(parts, header.to(device), group=group)
    out.copy_(torch.cat([p.cpu() for p in parts]))


def _group_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def allgather_start(tensor: torch.Tensor, process_set: ProcessSet) -> Tuple[Any, Callable[[], torch.Tensor]]:
    """Concatenate every member's ``tensor`` along dim 0 (dim 0 may differ): transfer and finisher."""
    _check_tensor(tensor, "allgather")
    group, size, _ = _members(process_set)
    work = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()
    if not _communicates(process_set):
        out = work.clone()
        return None, lambda: out
    shapes = _shapes(work, group, size)
    if len({s[:3] + s[4:] for s in shapes}) != 1:
        raise HorovodInternalError(
            "Mismatched allgather tensor shapes or dtypes: every rank must send the same dtype and the same "
            f"dimensions after the first; got (root, dtype code, ndim, shape...) {shapes}")
    lengths = [s[3] for s in shapes]
    longest = max(lengths)
    padded = torch.zeros((longest,) + tuple(work.shape[1:]), dtype=work.dtype, device=work.device)
    padded[:work.shape[0]] = work
    wire = _movable(padded)
    parts = [torch.empty_like(wire) for _ in range(size)]
    handle = dist.all_gather(parts, wire, group=group, async_op=True)

    def finish() -> torch.Tensor:
        return torch.cat([p[:n] for p, n in zip(parts, lengths)]).view(work.dtype)
    return handle, finish


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start gathering ``tensor`` from every member along dim 0 (the input is not modified); a handle."""
    _claim(name)
    work, finish = allgather_start(tensor, process_set)
    return _handle([work], finish, name)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`allgather_async` of each tensor; one handle whose result is the list."""
    _claim(name)
    started = [allgather_start(t, process_set) for t in tensors]
    return _handle([w for w, _ in started], lambda: [finish() for _, finish in started], name)


# ---------------------------------------------------------------------- broadcast
def broadcast_start_(tensor: torch.Tensor, root_rank: int, process_set: ProcessSet) -> Tuple[Any, Callable]:
    """Overwrite ``tensor`` with global rank ``root_rank``'s: the transfer and its finisher."""
    _check_tensor(tensor, "broadcast")
    group, size, _ = _members(process_set)
    if root_rank not in (process_set.ranks or []):
        raise ValueError(f"root_rank={root_rank} is not in {process_set}")
    if not _communicates(process_set):
        return None, lambda: tensor
    _agree("broadcast", tensor, group, size, root_rank)
    wire = _movable(tensor)
    with torch.no_grad():
        work = dist.broadcast(wire, src=root_rank, group=group, async_op=True)
    return work, lambda: tensor


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` in place with rank ``root_rank``'s value; a handle."""
    _claim(name)
    work, finish = broadcast_start_(tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor, root_rank,
                                    process_set)
    return _handle([work], finish, name)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """As :func:`broadcast_async_` into a new tensor: the input is not modified."""
    _check_tensor(tensor, "broadcast_async")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite ``tensor`` in place with rank ``root_rank``'s value; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


# ---------------------------------------------------------------------- alltoall, reducescatter
def _splits_of(tensor: torch.Tensor, splits: Any, size: int) -> List[int]:
    if splits is None:
        if tensor.shape[0] % size:
            raise ValueError(f"alltoall without splits needs dim 0 ({tensor.shape[0]}) divisible by the "
                             f"process set's size ({size}); give splits=")
        return [tensor.shape[0] // size] * size
    values = [int(v) for v in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != size or any(v < 0 for v in values) or sum(values) != tensor.shape[0]:
        raise ValueError(f"alltoall splits {values} must be {size} non-negative counts summing to dim 0 "
                         f"({tensor.shape[0]})")
    return values


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[i]`` rows of ``tensor`` (equal parts without ``splits``) to member ``i``;
    the result is ``(rows received in member order, int32 counts received from each)``."""
    _check_tensor(tensor, "alltoall")
    _claim(name)
    group, size, _ = _members(process_set)
    send = _splits_of(tensor, splits, size)
    if not _communicates(process_set):
        out = tensor.detach().clone()
        return _handle([], lambda: (out, torch.tensor(send, dtype=torch.int32)))
    _agree("alltoall", tensor[:0], group, size)  # dtype and every dimension after the first
    counts = torch.tensor(send, dtype=torch.int64, device=_group_device(group))
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    recv = received.cpu().tolist()
    source = tensor.detach().contiguous()
    flat = source.reshape(source.shape[0], -1) if source.dim() > 0 else source.reshape(1, 1)
    out = _movable(flat.new_empty((sum(recv), flat.shape[1])))
    work = dist.all_to_all_single(out, _movable(flat), output_split_sizes=recv, input_split_sizes=send, group=group,
                                  async_op=True)

    def finish() -> Tuple[torch.Tensor, torch.Tensor]:
        rows = out.view(source.dtype).reshape((sum(recv),) + tuple(source.shape[1:]))
        return rows, torch.tensor(recv, dtype=torch.int32)
    return _handle([work], finish, name)


def reducescatter_rows(length: int, size: int, index: int) -> Tuple[int, int]:
    """(start, count) of the rows member ``index`` keeps of a ``length``-row reduce-scatter: equal parts,
    the first ``length % size`` members one row more."""
    base, extra = divmod(length, size)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def reducescatter_start(tensor: torch.Tensor, op: int, process_set: ProcessSet, prescale_factor: float,
                        postscale_factor: float) -> Tuple[Any, Callable[[], torch.Tensor]]:
    """Reduce ``tensor`` across members, each keeping its part of dim 0 (a new tensor)."""
    if op not in (Average, Sum):
        raise ValueError("reducescatter takes op=hvd.Average or hvd.Sum (Horovod's too)")
    _check_tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    _, size, index = _members(process_set)
    work, finish_all = allreduce_start_(tensor.detach().clone(), op, prescale_factor, postscale_factor, process_set)

    def finish() -> torch.Tensor:
        start, count = reducescatter_rows(tensor.shape[0], size, index)
        return finish_all()[start:start + count].clone()
    return work, finish


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start a reduce-scatter of ``tensor`` (see :func:`reducescatter_start`); a handle."""
    _claim(name)
    work, finish = reducescatter_start(tensor, resolve_op(op, None), process_set, prescale_factor, postscale_factor)
    return _handle([work], finish, name)


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """:func:`reducescatter_async` of each tensor; one handle whose result is the list."""
    resolved = resolve_op(op, None)
    _claim(name)
    started = [reducescatter_start(t, resolved, process_set, prescale_factor, postscale_factor) for t in tensors]
    return _handle([w for w, _ in started], lambda: [finish() for _, finish in started], name)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return when every member of ``process_set`` has called it."""
    group, _, _ = _members(process_set)
    if _communicates(process_set):
        dist.barrier(group=group)
