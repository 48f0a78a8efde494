"""Horovod's pairing of operations by name, over torch.distributed (the controller of :mod:`._ops`).

Horovod pairs the ranks' operations by *name*: each rank queues its requests and the coordinator runs
an operation once every rank has asked for it, in one order for all. torch.distributed pairs collectives
by *call order* instead, so two ranks issuing ``a`` then ``b`` and ``b`` then ``a`` would add ``a`` to
``b``. This module makes the order agreed, Horovod's way, and never mixes.

The contract:

- Every operation of :mod:`._ops` goes through a **tick** (one small all-gather of fixed-size int64
  rows on the process set's negotiation group), except ``DistributedOptimizer``'s gradient reductions,
  which every rank issues in one fixed order (the hot path: no tick, on the set's own group); their
  step makes one tick (``STEP``: their count and a signature of their shapes) once they started. An unnamed
  operation ticks when it is issued (the tick is also its shape check, so it costs what the check cost
  before); a named one is queued, and ticks when this rank synchronizes it (or issues any other
  operation, or joins).
- In a tick every member sends the operation it is blocked on (kind, root or reduce op, dtype, shape,
  device type, its place in its request and the request's count of tensors), or ``WAIT`` (it
  synchronizes a queued named operation), or ``JOIN``, plus the names of its queued named operations
  (the first :data:`SLOTS`, and how many it has: when the rows' names share none and some did not fit,
  the members compare their whole queues). From the same rows every member derives the same plan:

  1. the named operations queued on every member that has not joined run, in the order of the first
     such member's queue; each is an exchange of rows (its shapes, checked) then its data;
  2. then, if every member that has not joined is issuing an unnamed operation, that one runs;
  3. a member waiting for a named operation returns once it ran; members in :func:`join` return once
     every member joined, with the global rank that joined last.

- A joined member answers the others' allreduces with zeros (``Average`` still divides by the set's
  size, as Horovod), and a ``STEP``'s gradient reductions too (the first member still stepping sends it
  their shapes); any other collective while a member is joined raises :class:`HorovodInternalError`
  on the members that issued it (Horovod's error too), and the joined member goes on waiting.
- Rows that disagree (kind, dtype, shape, device type, root, reduce op, the number of tensors of a
  grouped request) raise :class:`HorovodInternalError` on every member, naming each member's request.
- An unnamed operation that one member refuses before sending anything (its own argument error: splits
  that are invalid there only, a tensor that is not one) still takes its tick, as ``REFUSED``: the members
  that issued the operation raise too, instead of pairing it with that member's next operation (Horovod
  pairs them: a silent shift by one operation); where every member refused, nothing runs and each raises
  its own error.
- A transfer that fails on one member after the rows agreed would leave the others waiting for its share
  until the collective timeout: that member raises, tells the others what failed and closes its side of the
  negotiation group (:mod:`._alarm`), so each of them raises too, at once, naming that member and its request;
  every later operation of the set is then refused on every member in one line (``Controller.broken``), as
  Horovod shuts down after such an error (the half-sent shares cannot be taken back).
- A tick in which nothing can run is a deadlock under Horovod's semantics too (no member can change what
  it is blocked on): every member raises one line naming each member's operation and queued names.

Data of ticked operations travels on the negotiation group as well, so it can never pair with a
gradient reduction of the hot path, whatever the ranks' timing.
"""
from __future__ import annotations

import hashlib
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ._alarm import forget_frames
from ._names import _OP_NAMES, HorovodInternalError

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER, BARRIER, WAIT, JOIN, STEP, REFUSED = range(1, 11)
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast", ALLTOALL: "alltoall",
              REDUCESCATTER: "reducescatter", BARRIER: "barrier", WAIT: "waiting for a named operation",
              JOIN: "join", STEP: "DistributedOptimizer step",
              REFUSED: "an unnamed operation it refused before sending it (an argument error raised on that rank)"}
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16,
          torch.bfloat16, torch.float32, torch.float64, torch.complex64, torch.complex128]
CODES = {dtype: i for i, dtype in enumerate(DTYPES)}
DEVICES = ["cpu", "cuda", "xpu", "mps", "hpu", "meta"]
MAX_DIMS = 16
SLOTS = 64
"""How many queued names one row carries (the oldest first); later ones wait for a later tick."""

# one row: kind, extra (root or reduce op), dtype code, ndim, shape[MAX_DIMS], parts (tensors of the
# request still to come, this one included), count (tensors of the whole request), device type code,
# signature (a DistributedOptimizer step's gradients), joined-at tick, joined-at microseconds, queued
# (names this member has queued, all of them), number of names carried, then the names' keys
_KIND, _EXTRA, _DTYPE, _NDIM, _SHAPE = 0, 1, 2, 3, 4
_PARTS, _COUNT, _DEVICE, _SIGN = 4 + MAX_DIMS, 5 + MAX_DIMS, 6 + MAX_DIMS, 7 + MAX_DIMS
_JOINED_TICK, _JOINED_US, _QUEUED, _NNAMES = 8 + MAX_DIMS, 9 + MAX_DIMS, 10 + MAX_DIMS, 11 + MAX_DIMS
HEAD = 12 + MAX_DIMS
WIDTH = HEAD + SLOTS
_SHAPED = (ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, REDUCESCATTER)
_JOIN_ANSWERS = (ALLREDUCE, BARRIER, STEP)  # what a joined member answers; anything else raises on the others

Rows = List[List[int]]


def key_of(name: str) -> int:
    """A name's 63-bit key in the rows (blake2b; a collision among one set's in-flight names is ~2^-50)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") >> 1


def _error(message: str) -> Exception:
    return HorovodInternalError(message)


class Part:
    """One tensor's collective: what its row says, and ``issue(rows, active)`` that checks nothing more
    and starts the data transfer on the negotiation group (``rows=None``: a one-member set, no transfer);
    returns ``(work or None, finish)``."""

    def __init__(self, kind: int, extra: int, tensor: Optional[torch.Tensor],
                 issue: Callable[[Optional[Rows], Optional[List[int]]], Tuple[Any, Callable[[], Any]]],
                 sign: int = 0) -> None:
        self.kind, self.extra, self.tensor, self.issue, self.sign = kind, extra, tensor, issue, sign
        self.left = self.count = 1  # this tensor's place in its request: tensors still to come, of how many


class Request:
    """A queued named operation: its parts, and the handle record it completes."""

    def __init__(self, name: str, parts: Sequence[Part], pending: Any) -> None:
        self.name, self.key, self.parts, self.pending = name, key_of(name), list(parts), pending


def make_row(kind: int, extra: int = 0, tensor: Optional[torch.Tensor] = None, parts: int = 1,
             keys: Sequence[int] = (), joined: Tuple[int, int] = (-1, -1), count: Optional[int] = None,
             sign: int = 0) -> List[int]:
    """One member's row; ``keys`` are all its queued names, of which it carries the first :data:`SLOTS`
    (and how many there are: the controller compares whole queues when that matters)."""
    row = [0] * WIDTH
    row[_KIND], row[_EXTRA], row[_PARTS], row[_SIGN] = kind, int(extra), parts, sign
    row[_COUNT] = parts if count is None else count
    row[_JOINED_TICK], row[_JOINED_US] = joined
    if tensor is not None:
        if tensor.dim() > MAX_DIMS:
            raise ValueError(f"collectives take at most {MAX_DIMS} dimensions, got {tensor.dim()}")
        row[_DTYPE], row[_NDIM] = CODES.get(tensor.dtype, -2), tensor.dim()
        row[_SHAPE:_SHAPE + tensor.dim()] = list(tensor.shape)
        device = tensor.device.type
        row[_DEVICE] = DEVICES.index(device) if device in DEVICES else len(DEVICES) + sum(map(ord, device))
    row[_QUEUED] = len(keys)
    keys = list(keys)[:SLOTS]
    row[_NNAMES] = len(keys)
    row[HEAD:HEAD + len(keys)] = keys
    return row


def kind(row: List[int]) -> int:
    return row[_KIND]


def shape(row: List[int]) -> Tuple[int, ...]:
    return tuple(row[_SHAPE:_SHAPE + row[_NDIM]])


def dtype(row: List[int]) -> Optional[torch.dtype]:
    return DTYPES[row[_DTYPE]] if 0 <= row[_DTYPE] < len(DTYPES) else None


def extra(row: List[int]) -> int:
    return row[_EXTRA]


def keys(row: List[int]) -> List[int]:
    return row[HEAD:HEAD + row[_NNAMES]]


def device_of(row: List[int]) -> str:
    code = row[_DEVICE]
    return DEVICES[code] if 0 <= code < len(DEVICES) else f"device {code}"


def describe(row: List[int], devices: bool = False) -> str:
    """``allreduce float32[3, 4] op Sum`` (``devices``: ``... on cuda``), or for a grouped request
    ``grouped allreduce of 3 tensors, tensor 1: float32[3] op Sum`` — one member's operation, for messages."""
    k = row[_KIND]
    if k == STEP:
        return (f"{KIND_NAMES[k]} reducing {row[_COUNT]} gradients op {_OP_NAMES.get(row[_EXTRA], row[_EXTRA])} "
                f"(shapes and dtypes {row[_SIGN]:x})")
    if k not in _SHAPED:
        return KIND_NAMES.get(k, f"kind {k}")
    dt = str(dtype(row)).replace("torch.", "") if dtype(row) is not None else "unsupported dtype"
    said = f"{dt}{list(shape(row))}"
    if k in (ALLREDUCE, REDUCESCATTER):
        said = f"{said} op {_OP_NAMES.get(row[_EXTRA], row[_EXTRA])}"
    elif k == BROADCAST:
        said = f"{said} root {row[_EXTRA]}"
    if devices:
        said = f"{said} on {device_of(row)}"
    if row[_COUNT] > 1:
        return f"grouped {KIND_NAMES[k]} of {row[_COUNT]} tensors, tensor {row[_COUNT] - row[_PARTS] + 1}: {said}"
    return f"{KIND_NAMES[k]} {said}"


def problem(rows: Rows, active: List[int], ranks: Sequence[int]) -> Optional[str]:
    """Why the members' rows cannot run as one operation (``None`` when they can). A pure function of
    the rows, so every member (the joined ones too) reaches the same verdict."""
    first = rows[active[0]]
    k = first[_KIND]
    joined = [ranks[i] for i in range(len(rows)) if i not in active]
    refused = [ranks[i] for i in active if rows[i][_KIND] == REFUSED]
    if refused and len(refused) < len(active):
        others = "; ".join(f"rank {ranks[i]}: {describe(rows[i])}" for i in active if rows[i][_KIND] != REFUSED)
        return (f"rank(s) {refused} raised an argument error in the unnamed operation the others issued ({others}): "
                "every rank raises, so that none pairs it with another operation; see the error on those ranks")
    if joined and k not in _JOIN_ANSWERS:
        return (f"hvd.{KIND_NAMES[k]} cannot run while rank(s) {joined} have called hvd.join() (only allreduce "
                "and barrier can, as in Horovod): finish it before join, or reduce instead")
    def comparable(row: List[int]) -> Tuple[int, ...]:
        same = (row[_KIND], row[_EXTRA], row[_DTYPE], row[_PARTS], row[_COUNT], row[_DEVICE], row[_SIGN])
        if row[_KIND] in (ALLGATHER, ALLTOALL):  # the first dimension may differ
            return same + (row[_NDIM],) + shape(row)[1:]
        return same + shape(row)
    if len({comparable(rows[i]) for i in active}) != 1 or (k in _SHAPED and first[_DTYPE] < 0):
        devices = len({rows[i][_DEVICE] for i in active}) > 1
        per_rank = "; ".join(f"rank {ranks[i]}: {describe(rows[i], devices)}" for i in active)
        return ("Mismatched operations, tensor counts, shapes, dtypes, devices, roots or reduce ops across ranks: "
                f"{per_rank}")
    return None


def gather_rows(row: List[int], group: Any, size: int, device: torch.device) -> Rows:
    """Every member's ``row`` in set order: one all-gather of int64 on ``group`` (on ``device``)."""
    mine = torch.tensor(row, dtype=torch.int64, device=device)
    out = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(out, mine, group=group)
    return [t.tolist() for t in out]


class Controller:
    """The negotiation of one process set on this member: its queue of named requests and its ticks.

    ``answer(row)`` issues a joined member's share of an allreduce described by ``row`` (zeros) on
    ``group``; ``answer_step(rows, active)`` its share of a ``DistributedOptimizer`` step's gradient
    reductions; ``ranks`` are the set's global ranks; ``index`` is this member's position in them.

    Once a transfer failed on a member after the ranks agreed to run it (or a tick failed), the members
    are out of step: that member sounds ``alarm`` (:class:`._alarm.Alarm`: the others raise at once, naming
    it), and every later operation is refused, in one line naming the first failure."""

    def __init__(self, group: Any, ranks: Sequence[int], index: int, device: torch.device,
                 answer: Callable[[List[int]], None],
                 answer_step: Optional[Callable[[Rows, List[int]], None]] = None, alarm: Any = None) -> None:
        self.group, self.ranks, self.index, self.device, self.answer = group, list(ranks), index, device, answer
        self.answer_step, self.alarm = answer_step, alarm
        self.queue: Dict[int, Request] = {}
        self.ticks = 0
        self.joined: Tuple[int, int] = (-1, -1)
        self.broken: Optional[str] = None  # why the members are out of step (every later operation refused)

    # ------------------------------------------------------------------ exchanges
    def exchange(self, row: List[int], doing: Callable[[], str]) -> Rows:
        """All members' rows (one all-gather); a failure (a member gone, the timeout) is one line saying
        what this member was ``doing()`` (only formatted then)."""
        self._refuse_if_broken()  # its group may be closed: never let an exchange fall back to the default group
        try:
            rows = gather_rows(row, self.group, len(self.ranks), self.device)
        except RuntimeError as exc:
            raise self.lost(exc, doing) from exc
        self.ticks += 1
        return rows

    def lost(self, exc: BaseException, doing: Callable[[], str]) -> Exception:
        """The error to raise where this member's communication on the set failed (``exc``) while it was
        ``doing()``: the failure another member told (:meth:`_issue`), or else the others stopped answering
        (gone, or the timeout). The set is out of step from now on; this member closes its side too, so a
        member still blocked on it hears at once."""
        heard = self.alarm.heard() if self.alarm is not None else None
        me = self.ranks[self.index]
        if heard:
            self.broken = heard
            said = (f"{heard}; rank {me} was {doing()}: its share cannot complete, every rank raises, and every "
                    "later operation on this process set is refused; restart the job")
        else:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.broken = f"rank {me} was {doing()} when the other ranks stopped answering ({first})"
            said = f"{self.broken}; every rank must issue the same Horovod operations"
        self._close()
        return _error(said)

    def _close(self) -> None:
        self.group = None
        if self.alarm is not None:
            self.alarm.close()

    def gather_objects(self, obj: Any) -> List[Any]:
        """Every member's ``obj`` (pickled; only on the rare paths: a deadlock's message, long queues)."""
        out: List[Any] = [None] * len(self.ranks)
        self._refuse_if_broken()
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as exc:
            raise self.lost(exc, lambda: "comparing queued names") from exc
        return out

    def _queued_keys(self) -> List[int]:
        return list(self.queue)

    def _refuse_if_broken(self) -> None:
        if self.broken is not None:
            raise _error(f"an earlier Horovod operation left this process set's ranks out of step ({self.broken}): "
                         "every later operation on it is refused; restart the job")

    def _issue(self, part: Part, rows: Rows, active: List[int], what: str) -> Tuple[Any, Callable[[], Any]]:
        """Start ``part``'s transfer, which the other members are starting too. If it fails here, their
        shares cannot complete: this member sounds the alarm (they raise at once, naming this member and
        ``what``) and the set is out of step from now on (refused, one line)."""
        try:
            return part.issue(rows, active)
        except Exception as exc:
            heard = self.alarm.heard() if self.alarm is not None else None
            if heard:  # its exchange failed because another member failed first
                raise self.lost(exc, lambda: f"starting {what}") from exc
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            self.broken = f"{what} failed on rank {self.ranks[self.index]}: {type(exc).__name__}: {first}"
            forget_frames(exc)  # its frames may hold the group, which must go for its connections to close
            if self.alarm is not None:
                self.alarm.sound(self.broken)
            self.group = None
            raise _error(f"{self.broken}; the other ranks raise too, and every later operation on this process "
                         "set is refused; restart the job") from exc

    # ------------------------------------------------------------------ the loop
    def run_unnamed(self, part: Part) -> Tuple[Any, Callable[[], Any]]:
        """Tick until every member that has not joined issues ``part``'s operation, then start it."""
        self._refuse_if_broken()
        return self._drive(part=part)

    def wait(self, pending: Any) -> None:
        """Tick until the queued named operation of ``pending`` ran."""
        self._refuse_if_broken()
        self._drive(pending=pending)

    def join(self) -> int:
        """Tick as a joined member until every member joined; the global rank that joined last."""
        self._refuse_if_broken()
        self.joined = (self.ticks, int(time.time() * 1e6))
        try:
            return self._drive()
        finally:
            self.joined = (-1, -1)

    def _drive(self, part: Optional[Part] = None, pending: Any = None) -> Any:
        while True:
            if part is not None:
                own = make_row(part.kind, part.extra, part.tensor, part.left, self._queued_keys(),
                               count=part.count, sign=part.sign)
                doing = lambda own=own: f"issuing an unnamed {describe(own)}"  # noqa: E731 - formatted on failure only
            elif pending is not None:
                own = make_row(WAIT, keys=self._queued_keys())
                doing = lambda: f"waiting for {pending.name!r}"  # noqa: E731
            else:
                own = make_row(JOIN, keys=self._queued_keys(), joined=self.joined)
                doing = lambda: "in hvd.join()"  # noqa: E731
            rows = self.exchange(own, doing)
            active = [i for i, r in enumerate(rows) if r[_KIND] != JOIN]
            if not active:  # everyone joined: the last to join, by tick then by clock
                last = max(range(len(rows)), key=lambda i: (rows[i][_JOINED_TICK], rows[i][_JOINED_US], i))
                return self.ranks[last]
            issuing = all(rows[i][_KIND] != WAIT for i in active)
            agreed = self._agreed(rows, active)
            if not agreed and not issuing and any(rows[i][_QUEUED] > rows[i][_NNAMES] for i in active):
                agreed = self._agreed_in_full(active)  # some names did not fit in the rows: compare them all
            for key in agreed:
                self._run_named(key)
            if pending is None or pending.queued:  # a failed named request broke the set: nothing more runs
                self._refuse_if_broken()
            if issuing:
                verdict = problem(rows, active, self.ranks)
                if part is not None:
                    if verdict is not None:
                        raise _error(verdict)
                    return self._issue(part, rows, active, f"an unnamed {describe(own)}")
                try:
                    if verdict is None and kind(rows[active[0]]) == ALLREDUCE:
                        self.answer(rows[active[0]])  # a joined member's zeros
                    if verdict is None and kind(rows[active[0]]) == STEP and self.answer_step is not None:
                        self.answer_step(rows, active)  # a joined member's zeros for each gradient
                except RuntimeError as exc:
                    raise self.lost(exc, doing) from exc
            if pending is not None and not pending.queued:
                return None
            if not agreed and not issuing:
                raise self._deadlock(rows, doing)

    def _agreed(self, rows: Rows, active: List[int]) -> List[int]:
        """The named requests queued on every member that has not joined, in the first one's order."""
        common = set(keys(rows[active[0]]))
        for i in active[1:]:
            common &= set(keys(rows[i]))
        return [k for k in keys(rows[active[0]]) if k in common]

    def _agreed_in_full(self, active: List[int]) -> List[int]:
        """:meth:`_agreed` over every member's whole queue (one gather of the key lists, every member)."""
        queues = self.gather_objects(self._queued_keys())
        common = set(queues[active[0]])
        for i in active[1:]:
            common &= set(queues[i])
        return [k for k in queues[active[0]] if k in common]

    def _run_named(self, key: int) -> None:
        """Run one agreed named request: one exchange and one transfer per tensor (a joined member that
        did not queue it answers an allreduce with zeros and skips the rest)."""
        request = self.queue.pop(key, None)
        if request is None:
            self._follow()
            return
        started = []
        try:
            for i, part in enumerate(request.parts):
                row = make_row(part.kind, part.extra, part.tensor, parts=len(request.parts) - i,
                               count=len(request.parts))
                rows = self.exchange(row, lambda: f"running {request.name!r}")
                active = [j for j, r in enumerate(rows) if r[_KIND] != JOIN]
                verdict = problem(rows, active, self.ranks)
                if verdict is not None:
                    raise _error(f"{request.name!r}: {verdict}")
                started.append(self._issue(part, rows, active, f"{request.name!r} ({describe(row)})"))
        except Exception as exc:  # raised where the user synchronizes it, as Horovod
            started.clear()  # their transfers hold the group, which a failure here must release
            request.pending.fail(exc)
            return
        request.pending.start(started)

    def _follow(self) -> None:
        """A joined member's share of a named request the others run."""
        while True:
            rows = self.exchange(make_row(JOIN, joined=self.joined), lambda: "in hvd.join()")
            active = [i for i, r in enumerate(rows) if r[_KIND] != JOIN]
            if not active or problem(rows, active, self.ranks) is not None:
                return
            first = rows[active[0]]
            if first[_KIND] == ALLREDUCE:
                try:
                    self.answer(first)
                except RuntimeError as exc:
                    raise self.lost(exc, lambda: "in hvd.join()") from exc
            if first[_PARTS] <= 1:
                return

    def _deadlock(self, rows: Rows, doing: Callable[[], str]) -> Exception:
        """Every member reaches this in the same tick: name each one's operation and queued names."""
        mine = f"rank {self.ranks[self.index]}: {doing()}; queued by name: " + (
            ", ".join(repr(r.name) for r in self.queue.values()) or "none")
        try:
            described = self.gather_objects(mine)
        except RuntimeError:
            described = [f"rank {self.ranks[i]}: {describe(r)}" for i, r in enumerate(rows)]
        return _error("the ranks' Horovod operations cannot be paired by name (Horovod would wait forever): "
                      + " | ".join(str(d) for d in described)
                      + "; issue the same named operations on every rank before synchronizing them")
