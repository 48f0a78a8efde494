"""How every member of a process set learns at once that one member's share of an agreed transfer failed.

Once the ranks agreed to run an operation (:mod:`._negotiation`), each starts its share of the transfer. If
that fails on one member (its output cannot be allocated, a local error inside the collective), the others
are left blocked in their share: gloo waits for the missing one until the collective timeout (600 s by
default). Real Horovod 0.28.1 does no better: with the same failure (an alltoall whose output rank 1 cannot
allocate, under ``horovodrun -np 2 --gloo``) rank 1 raised ``HorovodInternalError`` at once, rank 0 only at
gloo's own timeout (30 s, ``HOROVOD_GLOO_TIMEOUT_SECONDS``), and every later operation on both raised
"Horovod has been shut down".

So the failing member, before it raises, (1) writes one line saying what failed where into the job's
key-value store (the one every torch process group of the job shares), under a key of its own for this
session and process set, then (2) destroys its side of the set's negotiation group, which closes its
connections. A member blocked in one of that group's transfers or ticks then gets gloo's "Connection closed
by peer" at once, reads the line, raises it as ``HorovodInternalError``, and closes its own side in turn (so
a member blocked on *it* hears too). A member that was not blocked hears it at its next operation on the set.

Why every later operation on the set is refused rather than the ranks put back in step: the others' shares
were half sent when the failure happened, and a transfer cannot be taken back on one side of a gloo
connection; Horovod itself shuts down after such an error. The job restarts (or ``hvd.elastic`` resets).
The hot path's group (``DistributedOptimizer``'s gradients) is left open: each step ticks on the
negotiation group, which is refused.

Tested on gloo (the CPU group). Not tried on NCCL (no two GPUs here): a closed communicator may not stop
the others' kernels, which would then wait for the collective timeout, and raise this module's line then.
"""
from __future__ import annotations

import traceback
from typing import Any, Callable, Optional, Sequence


def forget_frames(exc: Optional[BaseException]) -> None:
    """Clear the local variables of the frames ``exc`` (and the exceptions it chains) hold: they may hold the
    negotiation group, which must be released now for its connections to close."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        traceback.clear_frames(exc.__traceback__)
        exc = exc.__cause__ or exc.__context__


class Alarm:
    """One member's side of the alarm of one process set: ``sound`` it when this member's share of an agreed
    transfer failed, ask what the others ``heard`` when a transfer or tick failed here, ``close`` this
    member's side of the negotiation group (``close_group``, given by the operations, drops every reference
    they hold to it)."""

    def __init__(self, prefix: str, ranks: Sequence[int], rank: int, close_group: Callable[[], None],
                 store: Optional[Callable[[], Any]] = None) -> None:
        self.prefix, self.ranks, self.rank, self.close_group = prefix, list(ranks), rank, close_group
        self._store = store or _default_store

    def _key(self, rank: int) -> str:
        return f"unified_dist/horovod/failed/{self.prefix}/{rank}"

    def sound(self, message: str) -> None:
        """Tell the other members ``message`` (one line), then close this member's side of the group."""
        try:
            self._store().set(self._key(self.rank), message.encode())
        except Exception:  # noqa: S110 - no store (a lone process): the others still see the connection close
            pass
        self.close()

    def heard(self) -> Optional[str]:
        """What the other members that failed said (joined by ``; ``), or ``None``: no member sounded."""
        try:
            store = self._store()
            said = [store.get(self._key(r)).decode() for r in self.ranks
                    if r != self.rank and store.check([self._key(r)])]
        except Exception:  # the store is gone too: nothing was heard
            return None
        return "; ".join(said) or None

    def close(self) -> None:
        """Destroy this member's side of the negotiation group, so its connections close now."""
        self.close_group()


def _default_store() -> Any:
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()
