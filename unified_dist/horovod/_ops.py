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
- operations pair **by name**, as Horovod's: a named operation is queued and runs once every member
  of its process set asked for that name, in one order agreed by all (:mod:`._negotiation`), so
  ranks may issue named operations in different orders; unnamed ones pair in call order. A second
  operation under a name still queued is a ``ValueError``; :func:`join` answers the others'
  allreduces with zeros, ``DistributedOptimizer``'s gradient reductions included (:func:`gradient_step`).
  Operations that cannot be paired raise on every rank, never mix; grouped requests pair only with
  grouped requests of the same count.
- tensors that are not contiguous travel as contiguous copies (in-place results are copied back).
- ``allgather`` takes a different first dimension per rank (the negotiation's rows carry each
  rank's shape; a mismatch in any other dimension or in dtype is an error on every rank, naming
  each rank's shape).
- Process sets map to torch sub-groups (:class:`ProcessSet`).
"""
from __future__ import annotations

import functools
import gc
import inspect
import itertools
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..errors import UnifiedDistError
from . import _negotiation as _neg
from ._alarm import Alarm
from ._names import _OP_NAMES, Adasum, Average, HorovodInternalError, Max, Min, Product, Sum


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
        self._control: Any = None  # the group of its negotiation and of every negotiated transfer

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
        self.controllers: Dict[int, Any] = {}  # process set id -> its negotiation (_negotiation.Controller)
        self.session = ""  # rank 0's token for this init, agreed by all: names the alarm's keys (_alarm.Alarm)


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
    ps._control = dist.new_group(ps.ranks, timeout=_world.timeout) if _world.distributed else None
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
    _world.controllers.pop(pid, None)
    for group in (process_set._group, process_set._control):
        if group is not None:
            dist.destroy_process_group(group)
    process_set._group = process_set._control = None
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
    """The transfers of one ``*_async`` call and what turns their buffers into its result; a named
    operation is ``queued`` until the ranks agree to run it (:mod:`._negotiation`)."""

    def __init__(self, works: Sequence[Any], finish: Optional[Callable[[], Any]], name: Optional[str],
                 combine: Optional[Callable[[List[Any]], Any]] = None, controller: Any = None) -> None:
        self.works = [w for w in works if w is not None]
        self.finish = finish
        self.name = name
        self.combine = combine
        self.controller = controller
        self.queued = finish is None
        self.error: Optional[BaseException] = None
        self.polled_since: Optional[float] = None  # when poll() first found it queued

    def start(self, started: Sequence[Tuple[Any, Callable[[], Any]]]) -> None:
        """The agreed operation's transfers started (called by the negotiation)."""
        self.works, self.finish = _started(started, self.combine)
        self._ran()

    def fail(self, error: BaseException) -> None:
        """The agreed operation was refused on every rank: :func:`synchronize` raises ``error``."""
        self.error = error
        self._ran()

    def _ran(self) -> None:
        self.queued = False
        if self.name is not None and _in_flight.get(self.name) is self:
            del _in_flight[self.name]  # Horovod frees a name once its operation ran


_handles: Dict[int, _Pending] = {}
_in_flight: Dict[str, _Pending] = {}  # the name of each queued (not yet run) named operation
_counter = itertools.count(1)


def _claim(name: Optional[str]) -> None:
    """Refuse a second operation under the name of one still queued, before anything is sent (Horovod's
    ``ValueError``; the other ranks have not started it, so nothing is left half-done)."""
    if name is not None and name in _in_flight:
        raise ValueError(f"an operation named {name!r} is still in flight: synchronize it first, or give this "
                         "one another name")


def _handle(works: Sequence[Any], finish: Callable[[], Any], name: Optional[str] = None,
            controller: Any = None) -> int:
    number = next(_counter)
    _handles[number] = _Pending(works, finish, name, controller=controller)
    return number


def _one(results: List[Any]) -> Any:
    return results[0]


def _started(started: Sequence[Tuple[Any, Callable[[], Any]]],
             combine: Callable[[List[Any]], Any]) -> Tuple[List[Any], Callable[[], Any]]:
    """The transfers of started parts, and the finisher that combines their results."""
    return [w for w, _ in started if w is not None], lambda: combine([f() for _, f in started])


_request = threading.local()  # depth: inside a public operation; sent: its request reached the negotiation


def _refused_before_sending(unnamed: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a public operation: an exception it raises on this rank before its request reached the
    negotiation (an argument error: splits invalid on this rank only, a tensor that is not one) is told to the
    other members of its process set in the request's tick (``REFUSED``, :mod:`._negotiation`), so they raise
    too instead of pairing their operation with this rank's next one; this rank then raises its own error.
    Only unnamed requests tick (``unnamed``: the operation runs unnamed whatever its ``name``, as the
    differentiable ones of :mod:`._collectives` do); only the outermost decorated call acts."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if getattr(_request, "depth", 0):
                return fn(*args, **kwargs)
            _request.depth, _request.sent = 1, False
            try:
                return fn(*args, **kwargs)
            except HorovodInternalError:
                raise
            except Exception:
                if not _request.sent:
                    bound = signature.bind(*args, **kwargs)
                    bound.apply_defaults()
                    if unnamed or bound.arguments.get("name") is None:
                        _tell_refusal(bound.arguments.get("process_set", global_process_set))
                raise
            finally:
                _request.depth = 0
        return call
    return wrap


def _tell_refusal(ps: Any) -> None:
    """This rank's tick for an unnamed request it refused (see :func:`_refused_before_sending`); what the tick
    raises here is dropped: the caller raises its own error."""
    try:
        if not isinstance(ps, ProcessSet) or not _communicates(ps):
            return
        _controller(ps).run_unnamed(_neg.Part(_neg.REFUSED, 0, None, lambda rows, active: (None, lambda: None)))
    except Exception:  # noqa: S110 - the others raise from the same rows; this rank raises its own error
        pass


def _submit(parts: Sequence[_neg.Part], name: Optional[str], ps: ProcessSet,
            combine: Callable[[List[Any]], Any] = _one) -> int:
    """Run ``parts`` as one operation: at once on a one-member set; unnamed, each part ticks now (in call
    order); named, queued until every member asked for ``name`` (it then runs in the agreed order)."""
    for part in parts:  # what a row cannot carry is refused here, before sending: the others hear of it (REFUSED)
        if part.tensor is not None and part.tensor.dim() > _neg.MAX_DIMS:
            raise ValueError(f"unified_dist.horovod's collectives take at most {_neg.MAX_DIMS} dimensions, got "
                             f"{part.tensor.dim()}: reshape the tensor first")
    _request.sent = True  # from here an error is the negotiation's (every member's), or after the request left
    _claim(name)
    if not _communicates(ps):
        return _handle(*_started([part.issue(None, None) for part in parts], combine))
    controller = _controller(ps)
    for i, part in enumerate(parts):  # each row carries its request's count: grouped requests must match
        part.left, part.count = len(parts) - i, len(parts)
    if name is None:
        started = [controller.run_unnamed(part) for part in parts]
        return _handle(*_started(started, combine), controller=controller)
    pending = _Pending([], None, name, combine, controller)
    controller.queue[_neg.key_of(name)] = _neg.Request(name, parts, pending)
    _in_flight[name] = pending
    number = next(_counter)
    _handles[number] = pending
    return number


def poll(handle: int) -> bool:
    """Whether the operation of ``handle`` finished (then :func:`synchronize` does not block). A named
    operation is not started before this rank synchronizes it or issues another operation, so ``poll``
    answers ``False`` until then; a program that only polls a queued one for longer than the session's
    collective timeout gets :class:`HorovodInternalError` saying so, instead of waiting forever."""
    pending = _handles.get(handle)
    if pending is None:
        return True
    if pending.queued:
        now = time.monotonic()
        pending.polled_since = pending.polled_since or now
        limit = _world.timeout.total_seconds() if _world.timeout is not None else float("inf")
        if now - pending.polled_since > limit:
            raise HorovodInternalError(
                f"hvd.poll() has answered False for {limit:.0f} s for the named operation {pending.name!r}: it "
                "starts when this rank synchronizes it or issues another Horovod operation; call "
                "hvd.synchronize(handle)")
        return False
    return all(w.is_completed() for w in pending.works)


def synchronize(handle: int) -> Any:
    """Wait for ``handle``'s operation and return its result (``None`` for an unknown handle). A named
    operation first waits until every rank asked for its name (the ranks run the agreed ones meanwhile)."""
    pending = _handles.get(handle)
    if pending is None:
        return None
    try:
        if pending.queued:
            pending.controller.wait(pending)
    finally:
        if not pending.queued:
            _handles.pop(handle, None)
    if pending.error is not None:
        raise pending.error
    try:
        for work in pending.works:
            work.wait()
    except RuntimeError as exc:
        if pending.controller is None:  # the hot path's gradient reductions: the step's tick tells the set
            raise HorovodInternalError(exc) from exc
        doing = f"waiting for {pending.name!r}" if pending.name else "waiting for an unnamed operation's transfer"
        raise pending.controller.lost(exc, lambda: doing) from exc
    return pending.finish()


def reset() -> None:
    """Forget every handle and queued operation (``init``/``shutdown``)."""
    _handles.clear()
    _in_flight.clear()
    _world.controllers.clear()


def _group_device(group: Any) -> torch.device:
    backend = dist.get_backend(group)
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _controller(ps: ProcessSet) -> _neg.Controller:
    """``ps``'s negotiation on this member (made on first use; ``ps._control`` is its group)."""
    controller = _world.controllers.get(ps.process_set_id)
    if controller is None:
        group = ps._control
        alarm = Alarm(f"{_world.session}/{ps.process_set_id}", ps.ranks, _world.rank, lambda: _close_control(ps))
        controller = _neg.Controller(group, ps.ranks, ps.ranks.index(_world.rank), _group_device(group),
                                     lambda row: _answer_with_zeros(row, ps._control),
                                     lambda rows, active: _answer_step_with_zeros(rows, active, ps), alarm)
        _world.controllers[ps.process_set_id] = controller
    return controller


def _close_control(ps: ProcessSet) -> None:
    """Destroy ``ps``'s negotiation group on this member once its set is out of step (:mod:`._alarm`), so its
    connections close: first the finished transfers this member's handles still hold on it are settled (their
    result kept, or their error) and let go, since each holds the group; then nothing here refers to it."""
    controller = _world.controllers.get(ps.process_set_id)
    for pending in list(_handles.values()):
        if controller is None or pending.controller is not controller or not pending.works:
            continue
        if all(work.is_completed() for work in pending.works):
            try:
                for work in pending.works:
                    work.wait()
            except RuntimeError as exc:
                pending.error = HorovodInternalError(str(exc).strip().splitlines()[0] if str(exc).strip() else exc)
            pending.works = []
    group, ps._control = ps._control, None
    if group is not None:
        dist.destroy_process_group(group)
        del group
        gc.collect()  # a reference cycle may still hold the group; its connections close when it goes


def join(process_set: ProcessSet = global_process_set) -> int:
    """Horovod's ``join``: this rank is done; until every member joined it answers the others'
    allreduces with zeros (any other collective raises on them). Returns the global rank that joined last."""
    _members(process_set)
    if not _communicates(process_set):
        return _world.rank
    return _controller(process_set).join()


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


def _reduce_wire_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.int32 if dtype in (torch.bool, torch.int16) else dtype  # gloo: no int16 sums


def _check_tensor(tensor: Any, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"hvd.{what} takes a torch.Tensor, got {type(tensor).__name__}")


def _answer_with_zeros(row: List[int], group: Any) -> None:
    """A joined member's share of the allreduce ``row`` describes: zeros (Horovod's join)."""
    dtype = _reduce_wire_dtype(_neg.dtype(row))
    zeros = torch.zeros(_neg.shape(row), dtype=dtype, device=_group_device(group))
    dist.all_reduce(zeros, op=getattr(dist.ReduceOp, _TORCH_OP[_neg.extra(row)]), group=group)


def _answer_step_with_zeros(rows: List[List[int]], active: List[int], ps: ProcessSet) -> None:
    """A joined member's share of a ``DistributedOptimizer`` step the others run (:func:`gradient_step`):
    the first of them sends the step's wire specs, then zeros for each gradient on the set's own group."""
    box: List[Any] = [None, None]
    dist.broadcast_object_list(box, src=ps.ranks[active[0]], group=ps._control)
    specs, op = box
    device = _group_device(ps._group)
    works = [dist.all_reduce(torch.zeros(shape, dtype=_neg.DTYPES[code], device=device),
                             op=getattr(dist.ReduceOp, _TORCH_OP[op]), group=ps._group, async_op=True)
             for code, *shape in specs]
    for work in works:
        work.wait()


def _reduce(tensor: torch.Tensor, op: int, prescale_factor: float, postscale_factor: float, size: int,
            group: Any) -> Tuple[Any, Callable[[], torch.Tensor]]:
    """Reduce ``tensor`` in place over ``group`` (``None``: alone): the transfer and its finisher."""
    summing = op in (Average, Sum)
    if summing:
        scale_(tensor, prescale_factor)
    work = None
    wire = tensor
    if group is not _ALONE:
        wire = tensor.to(_reduce_wire_dtype(tensor.dtype)).contiguous()  # a copy for gloo, unless it is one
        work = dist.all_reduce(wire, op=getattr(dist.ReduceOp, _TORCH_OP[op]), group=group, async_op=True)

    def finish() -> torch.Tensor:
        if wire is not tensor:
            tensor.copy_(wire)
        if summing:
            scale_(tensor, postscale_factor / size if op == Average else postscale_factor)
        return tensor
    return work, finish


_ALONE = object()  # _reduce's group for a one-member set


def _allreduce_part(tensor: torch.Tensor, op: int, prescale_factor: float, postscale_factor: float,
                    process_set: ProcessSet) -> _neg.Part:
    """Reduce ``tensor`` in place across ``process_set`` (its result is ``tensor``)."""
    _check_tensor(tensor, "allreduce")
    _, size, _ = _members(process_set)

    def issue(rows: Any, active: Any) -> Tuple[Any, Callable[[], torch.Tensor]]:
        group = _ALONE if rows is None else process_set._control
        return _reduce(tensor, op, prescale_factor, postscale_factor, size, group)
    return _neg.Part(_neg.ALLREDUCE, op, tensor, issue)


@_refused_before_sending()
def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                     op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start reducing ``tensor`` in place across ``process_set``; a handle whose result is ``tensor``."""
    part = _allreduce_part(tensor, resolve_op(op, average), prescale_factor, postscale_factor, process_set)
    return _submit([part], name, process_set)


def gradient_allreduce_async_(tensor: torch.Tensor, op: int, prescale_factor: float, postscale_factor: float,
                              process_set: ProcessSet) -> Tuple[int, Optional[Tuple[int, ...]]]:
    """:func:`allreduce_async_` for ``DistributedOptimizer``'s gradients: the hot path. Every rank issues
    them in one fixed order, so they skip the negotiation and travel on the set's own group (never the
    negotiation group); :func:`gradient_step` then agrees on the step. Returns the handle and the wire's
    spec for :func:`gradient_step` (``None``: negotiated like any unnamed allreduce, which
    ``ud.init(debug=True)`` asks for: each reduction then compares shapes across ranks first)."""
    group, size, _ = _members(process_set)
    if _communicates(process_set) and _world.check:
        return _submit([_allreduce_part(tensor, op, prescale_factor, postscale_factor, process_set)], None,
                       process_set), None
    alone = not _communicates(process_set)
    work, finish = _reduce(tensor, op, prescale_factor, postscale_factor, size, _ALONE if alone else group)
    return _handle([work], finish), (_neg.CODES.get(_reduce_wire_dtype(tensor.dtype), -2),) + tuple(tensor.shape)


def gradient_step(specs: Sequence[Tuple[int, ...]], op: int, process_set: ProcessSet) -> None:
    """One tick per ``DistributedOptimizer`` step, after its gradient reductions started (``specs``: theirs,
    in issue order): raises on every member unless all reduce the same gradients, and lets a member in
    :func:`join` answer them with zeros on the set's own group (the first member still stepping sends it
    the specs), as Horovod's join answers every allreduce."""
    if not specs or not _communicates(process_set):
        return
    group = process_set._control

    def issue(rows: Any, active: Any) -> Tuple[Any, Callable[[], None]]:
        if len(active) < len(rows):  # a member has joined: it learns what to answer
            dist.broadcast_object_list([list(specs), op], src=process_set.ranks[active[0]], group=group)
        return None, lambda: None
    part = _neg.Part(_neg.STEP, op, None, issue, sign=hash(tuple(specs)) & (2 ** 63 - 1))
    part.count = len(specs)
    _controller(process_set).run_unnamed(part)


@_refused_before_sending()
def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
                    op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> int:
    """As :func:`allreduce_async_` into a new tensor: the input is not modified."""
    _check_tensor(tensor, "allreduce_async")
    return allreduce_async_(tensor.detach().clone(), average, name, op, prescale_factor, postscale_factor,
                            process_set)


@_refused_before_sending()
def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place across ``process_set`` (``Average`` by default); returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


@_refused_before_sending()
def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                             postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """Start reducing every tensor of ``tensors`` in place; one handle whose result is the list."""
    resolved = resolve_op(op, average)
    parts = [_allreduce_part(t, resolved, prescale_factor, postscale_factor, process_set) for t in tensors]
    return _submit(parts, name, process_set, list)


@_refused_before_sending()
def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Optional[int] = None, prescale_factor: float = 1.0,
                            postscale_factor: float = 1.0, process_set: ProcessSet = global_process_set) -> int:
    """As :func:`grouped_allreduce_async_` into new tensors: the inputs are not modified."""
    return grouped_allreduce_async_([t.detach().clone() for t in tensors], average, name, op, prescale_factor,
                                    postscale_factor, process_set)


@_refused_before_sending()
def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None, name: Optional[str] = None,
                       op: Optional[int] = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> List[torch.Tensor]:
    """Reduce every tensor of ``tensors`` in place; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


# ---------------------------------------------------------------------- allgather
def _allgather_part(tensor: torch.Tensor, process_set: ProcessSet) -> _neg.Part:
    """Concatenate every member's ``tensor`` along dim 0 (dim 0 may differ; the rows carry the lengths)."""
    _check_tensor(tensor, "allgather")
    _members(process_set)
    work = tensor.detach().reshape(1) if tensor.dim() == 0 else tensor.detach()

    def issue(rows: Any, active: Any) -> Tuple[Any, Callable[[], torch.Tensor]]:
        if rows is None:
            out = work.clone()
            return None, lambda: out
        lengths = [_neg.shape(r)[0] for r in rows]
        padded = torch.zeros((max(lengths),) + tuple(work.shape[1:]), dtype=work.dtype, device=work.device)
        padded[:work.shape[0]] = work
        wire = _movable(padded)
        parts = [torch.empty_like(wire) for _ in rows]
        handle = dist.all_gather(parts, wire, group=process_set._control, async_op=True)

        def finish() -> torch.Tensor:
            return torch.cat([p[:n] for p, n in zip(parts, lengths)]).view(work.dtype)
        return handle, finish
    return _neg.Part(_neg.ALLGATHER, 0, work, issue)


@_refused_before_sending()
def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """Start gathering ``tensor`` from every member along dim 0 (the input is not modified); a handle."""
    return _submit([_allgather_part(tensor, process_set)], name, process_set)


@_refused_before_sending()
def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> int:
    """:func:`allgather_async` of each tensor; one handle whose result is the list."""
    return _submit([_allgather_part(t, process_set) for t in tensors], name, process_set, list)


# ---------------------------------------------------------------------- broadcast
def _broadcast_part(tensor: torch.Tensor, root_rank: int, process_set: ProcessSet) -> _neg.Part:
    """Overwrite ``tensor`` with global rank ``root_rank``'s (its result is ``tensor``)."""
    _check_tensor(tensor, "broadcast")
    _members(process_set)
    if root_rank not in (process_set.ranks or []):
        raise ValueError(f"root_rank={root_rank} is not in {process_set}")

    def issue(rows: Any, active: Any) -> Tuple[Any, Callable[[], torch.Tensor]]:
        if rows is None:
            return None, lambda: tensor
        wire = tensor if tensor.is_contiguous() else tensor.contiguous()  # gloo moves contiguous tensors

        def finish() -> torch.Tensor:
            if wire is not tensor:
                with torch.no_grad():
                    tensor.copy_(wire)
            return tensor
        with torch.no_grad():
            work = dist.broadcast(_movable(wire), src=root_rank, group=process_set._control, async_op=True)
        return work, finish
    return _neg.Part(_neg.BROADCAST, root_rank, tensor, issue)


@_refused_before_sending()
def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> int:
    """Start overwriting ``tensor`` in place with rank ``root_rank``'s value; a handle."""
    target = tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor
    return _submit([_broadcast_part(target, root_rank, process_set)], name, process_set)


@_refused_before_sending()
def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> int:
    """As :func:`broadcast_async_` into a new tensor: the input is not modified."""
    _check_tensor(tensor, "broadcast_async")
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


@_refused_before_sending()
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
    if isinstance(splits, torch.Tensor) and (splits.dim() != 1 or splits.dtype != torch.int32):
        # Horovod's check, made before the values are read: every rank that passes such a tensor raises,
        # whatever it holds (a float torch.empty's garbage can read as valid counts on one rank only)
        raise ValueError(f"alltoall expects splits as a 1-D tensor of 32-bit integers (Horovod's too); got "
                         f"{str(splits.dtype).replace('torch.', '')}{list(splits.shape)}")
    values = [int(v) for v in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(values) != size or any(v < 0 for v in values) or sum(values) != tensor.shape[0]:
        raise ValueError(f"alltoall splits {values} must be {size} non-negative counts summing to dim 0 "
                         f"({tensor.shape[0]})")
    return values


@_refused_before_sending()
def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> int:
    """Start sending ``splits[i]`` rows of ``tensor`` (equal parts without ``splits``) to member ``i``;
    the result is ``(rows received in member order, int32 counts received from each)``."""
    _check_tensor(tensor, "alltoall")
    _, size, _ = _members(process_set)
    send = _splits_of(tensor, splits, size)

    def issue(rows: Any, active: Any) -> Tuple[Any, Callable[[], Tuple[torch.Tensor, torch.Tensor]]]:
        if rows is None:
            out = tensor.detach().clone()
            return None, lambda: (out, torch.tensor(send, dtype=torch.int32))
        group = process_set._control
        counts = torch.tensor(send, dtype=torch.int64, device=_group_device(group))
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=group)
        recv = received.cpu().tolist()
        source = tensor.detach().contiguous()
        width = 1
        for n in source.shape[1:]:
            width *= n
        flat = source.reshape(source.shape[0], width) if source.dim() > 0 else source.reshape(1, 1)  # 0 rows too
        out = _movable(flat.new_empty((sum(recv), flat.shape[1])))
        work = dist.all_to_all_single(out, _movable(flat), output_split_sizes=recv, input_split_sizes=send,
                                      group=group, async_op=True)

        def finish() -> Tuple[torch.Tensor, torch.Tensor]:
            rows_out = out.view(source.dtype).reshape((sum(recv),) + tuple(source.shape[1:]))
            return rows_out, torch.tensor(recv, dtype=torch.int32)
        return work, finish
    return _submit([_neg.Part(_neg.ALLTOALL, 0, tensor, issue)], name, process_set)


def reducescatter_rows(length: int, size: int, index: int) -> Tuple[int, int]:
    """(start, count) of the rows member ``index`` keeps of a ``length``-row reduce-scatter: equal parts,
    the first ``length % size`` members one row more."""
    base, extra = divmod(length, size)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


def _reducescatter_part(tensor: torch.Tensor, op: int, process_set: ProcessSet, prescale_factor: float,
                        postscale_factor: float) -> _neg.Part:
    """Reduce ``tensor`` across members, each keeping its part of dim 0 (a new tensor)."""
    if op not in (Average, Sum):
        raise ValueError("reducescatter takes op=hvd.Average or hvd.Sum (Horovod's too)")
    _check_tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor of at least one dimension")
    _, size, index = _members(process_set)
    copy = tensor.detach().clone()

    def issue(rows: Any, active: Any) -> Tuple[Any, Callable[[], torch.Tensor]]:
        work, finish_all = _reduce(copy, op, prescale_factor, postscale_factor, size,
                                   _ALONE if rows is None else process_set._control)

        def finish() -> torch.Tensor:
            start, count = reducescatter_rows(tensor.shape[0], size, index)
            return finish_all()[start:start + count].clone()
        return work, finish
    return _neg.Part(_neg.REDUCESCATTER, op, tensor, issue)


@_refused_before_sending()
def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: int = Average,
                        process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> int:
    """Start a reduce-scatter of ``tensor`` (see :func:`_reducescatter_part`); a handle."""
    part = _reducescatter_part(tensor, resolve_op(op, None), process_set, prescale_factor, postscale_factor)
    return _submit([part], name, process_set)


@_refused_before_sending()
def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None, op: int = Average,
                                process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> int:
    """:func:`reducescatter_async` of each tensor; one handle whose result is the list."""
    resolved = resolve_op(op, None)
    parts = [_reducescatter_part(t, resolved, process_set, prescale_factor, postscale_factor) for t in tensors]
    return _submit(parts, name, process_set, list)


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return when every member of ``process_set`` has called it (joined members count as there)."""
    _members(process_set)
    synchronize(_submit([_neg.Part(_neg.BARRIER, 0, None, lambda rows, active: (None, lambda: None))], None,
                        process_set))
