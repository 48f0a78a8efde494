"""Checkpoints written while training goes on: the process's one background writer.

An ``async_save=True`` save (:mod:`unified_dist.saving`) first *stages* the state (every tensor
copied off the live ones, so the next optimizer step cannot change what is written), then hands the
write to :data:`WRITER`, which runs it in one thread and returns. The write itself is the same as a
blocking save's: a temporary file (or ``<dir>.partial-<id>``) renamed into place, so a process killed
mid-write leaves the previous checkpoint whole.

Contract:

- At most one write is in flight per process, so per job (async saves are collective: every rank
  makes them in the same order): :meth:`Writer.submit` first waits for the previous one.
- An async save is *unsettled* from its call until the next **settling point**, which every rank
  reaches at the same moment: the next async or collective save (``ud.save`` of a sharded model or
  of ``ud.RNG``, ``ud.save_sharded``), ``ud.barrier()``, ``ud.should_stop()`` when it returns True,
  ``ud.requeue()``, ``ud.shutdown()``. There every rank waits for its own write, then the ranks
  exchange how their writes ended (one small all-gather, made only when a save is unsettled, so an
  optimizer step never pays for it), and every rank raises the same one-line
  :class:`~unified_dist.errors.CheckpointError` naming the path when any rank's write failed
  (:meth:`Writer.settle`).
- A rank that reads what it is still writing waits for it first (:meth:`Writer.wait`): ``ud.load`` of
  that path, ``ud.latest_checkpoint`` of its directory.
- At interpreter exit the write in flight finishes (the thread is not a daemon); a failure is then
  one line on standard error and the exit status 1 (:func:`report_at_exit`). A stop signal that ends
  the process (one the program does not ask about) first waits for the write too
  (:mod:`unified_dist.training.preemption`).

Importing this module imports only the standard library and :mod:`unified_dist.errors` (torch only
when a sharded write needs its process group).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..errors import CheckpointError, summary


@dataclass
class Job:
    """One background write: ``target`` (a file or a directory), its thread, how it ended."""

    target: str
    thread: Optional[threading.Thread] = None
    error: Optional[str] = None  # the one-line reason, when the write failed
    done: threading.Event = field(default_factory=threading.Event)

    def run(self, work: Callable[[], None]) -> None:
        try:
            work()
        except BaseException as exc:  # noqa: BLE001 - every failure is reported at the next settling point
            self.error = summary(exc)
        finally:
            self.done.set()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()


class Writer:
    """The process's background writes (see the module docstring)."""

    def __init__(self) -> None:
        self.job: Optional[Job] = None  # the latest write (finished or not)
        self.unsettled = False  # an async save was made since the last settling point
        self._group: Any = None  # the gloo group of background sharded writes (see side_group)
        self._buffers: List[Any] = []  # the CPU copies of the last full save's tensors (see staging)
        self._reserving: Optional[threading.Thread] = None  # allocating buffers ahead of a first save (reserve)

    @property
    def in_flight(self) -> bool:
        """Whether a write is still running."""
        return self.job is not None and not self.job.done.is_set()

    def submit(self, target: str, work: Optional[Callable[[], None]]) -> None:
        """Wait for the write in flight, then run ``work`` in a new thread (``None``: this rank writes
        nothing, but the save is still unsettled here, as on the ranks that write)."""
        self.wait()
        job = Job(target)
        self.job, self.unsettled = job, True
        if work is None:
            job.done.set()
            return
        job.thread = threading.Thread(target=job.run, args=(work,), name=f"unified_dist save {target}", daemon=False)
        job.thread.start()

    def wait(self, target: Optional[str] = None) -> Optional[str]:
        """Wait for the write in flight (only if it writes ``target`` or under it, when given); its
        failure's one line, or ``None``."""
        job = self.job
        if job is None or (target is not None and not _covers(target, job.target)):
            return None
        job.wait()
        return job.error

    def settle(self, exchange: Callable[[Optional[str]], List[Optional[str]]]) -> None:
        """A settling point: when a save is unsettled, wait for this rank's write, learn every rank's
        outcome through ``exchange`` (a collective: each rank's one-line error or ``None``, in rank
        order) and raise :class:`CheckpointError` on every rank if any failed. Nothing when settled."""
        if not self.unsettled:
            return
        mine = self.wait()
        target = self.job.target if self.job else "?"
        self.unsettled = False
        outcomes = exchange(mine)
        failed = [(rank, error) for rank, error in enumerate(outcomes) if error]
        if failed:
            rank, error = failed[0]
            raise CheckpointError(f"saving {target} in the background failed on rank {rank}: {error}; the "
                                  "previous checkpoint there is intact: free space or fix the path, then save again")

    def staging(self) -> Callable[[Any], Any]:
        """A function that copies each tensor it is given into a CPU buffer kept from the previous save
        (or made ahead by :meth:`reserve`) when one of the same shape and dtype is there: the copy then
        takes no fresh pages (the kernel's provision of new memory, what made a run's first save block
        several times as long as the later ones). Call it only once the previous write
        ended (its buffers are then free): :meth:`submit` and :meth:`settle` make sure of that before a
        save stages; a reservation still running is waited for here."""
        import torch

        self._join_reservation()
        kept: Dict[Any, List[Any]] = {}
        for buffer in self._buffers:
            kept.setdefault((tuple(buffer.shape), buffer.dtype), []).append(buffer)
        for spare in kept.values():
            spare.reverse()  # pop() takes them in the order they were kept
        fresh: List[Any] = []

        def copy(t: Any) -> Any:
            t = t.detach()
            spare = kept.get((tuple(t.shape), t.dtype))
            buffer = spare.pop() if spare else torch.empty(t.shape, dtype=t.dtype, device="cpu")  # contiguous
            fresh.append(buffer)
            return buffer.copy_(t)
        self._buffers = fresh
        return copy

    def reserve(self, specs: List[Any]) -> None:
        """Make, in a thread of its own, a CPU buffer for each ``(shape, dtype)`` of ``specs`` and touch
        every page of it, so the next save's :meth:`staging` copies into memory the process already has
        (``ud.reserve_async_save``). Replaces the buffers kept so far; a save made before it ends waits for
        it. Nothing while a write is in flight: it reads the kept buffers, which the next save reuses."""
        import torch

        self._join_reservation()
        if self.in_flight:
            return

        def make() -> None:
            self._buffers = [torch.empty(shape, dtype=dtype, device="cpu").zero_() for shape, dtype in specs]
        self._reserving = threading.Thread(target=make, name="unified_dist reserve", daemon=True)
        self._reserving.start()

    def _join_reservation(self) -> None:
        thread, self._reserving = self._reserving, None
        if thread is not None:
            thread.join()

    def side_group(self, timeout: Any) -> Any:
        """A gloo process group of every rank, for the collectives of background sharded writes (made on
        first use: a collective; every rank makes its async sharded saves in the same order), so the
        writing thread never shares a group with the training's collectives (nor needs an NCCL one).
        ``None`` without a torch process group (Horovod, one process)."""
        import torch.distributed as dist

        if not dist.is_initialized():
            return None
        if self._group is None:
            self._group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def forget(self) -> None:
        """Drop the record of the last write (settled, so finished) and the side group (``ud.shutdown``)."""
        self._join_reservation()
        self.job, self.unsettled, self._buffers = None, False, []
        group, self._group = self._group, None
        if group is not None:
            import contextlib

            import torch.distributed as dist

            with contextlib.suppress(Exception):  # the default group's teardown may have taken it already
                if dist.is_initialized():
                    dist.destroy_process_group(group)


def _covers(target: str, written: str) -> bool:
    """Whether reading ``target`` must wait for a write of ``written``: the same path, or a directory
    that ``written`` lies in."""
    import os

    a, b = os.path.abspath(target), os.path.abspath(written)
    return a == b or b.startswith(a.rstrip(os.sep) + os.sep)


WRITER = Writer()
"""The process's one writer."""


def report_at_exit() -> bool:
    """At interpreter exit: wait for the write in flight; ``True`` (after one line on standard error)
    when it failed and no settling point reported it."""
    import sys

    job = WRITER.job
    if job is None:
        return False
    error = WRITER.wait()
    if error is None or not WRITER.unsettled:
        return False
    sys.stderr.write(f"unified_dist: saving {job.target} in the background failed: {error}; "
                     "the previous checkpoint there is intact\n")
    sys.stderr.flush()
    return True


def flush_quietly() -> None:
    """Wait for the write in flight, whatever its outcome (before a signal ends the process)."""
    WRITER.wait()


__all__ = ["Job", "Writer", "WRITER", "report_at_exit", "flush_quietly"]
