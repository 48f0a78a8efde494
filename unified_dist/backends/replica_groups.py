"""Data parallelism across replica groups that survives a group's failure, through torchft's ``Manager``.

A job of ``N`` replica groups is ``N`` ordinary torch worlds (each a ``torchrun`` of ``G`` processes, or
one plain process) that know one another only through torchft's lighthouse. Inside a group everything
is as without fault tolerance (DDP, FSDP2 or HSDP over the group's own default process group). Across
groups, each optimizer step is one torchft step:

- the step's quorum runs before the training loader fetches the step's batch (a step without a
  prepared loader's batch is refused at ``ud.backward``): the groups alive now, and any group that
  (re)joined, which is healed from a live peer first (the state :meth:`ReplicaGroups.heal_with`
  registered, sent over torchft's checkpoint transport: no file), so it draws the peer's next batch,
  computes it on the peer's weights and takes part in the step;
- the gradients, already averaged inside the group, are averaged over the groups that took part
  (:meth:`ReplicaGroups.average`: one torchft all-reduce per dtype, gloo, divided by the participants), and so
  are the floating-point buffers (BatchNorm's statistics), still inside the step;
- the optimizer steps only if the step commits (:meth:`ReplicaGroups.commit`: torchft's
  ``should_commit``, false when a group failed during the step; that group then updates nothing).

Nothing runs across groups between two steps: an evaluation pass of a prepared loader holds no quorum and is
sharded over the group's own ranks (each group evaluates the whole split; ``unified_dist.session``). A
:class:`StepWatchdog` times each step's own work, from its quorum to its commit, apart from the waits for the
other groups, which torchft's own timeouts bound. A group started again commits nothing before it holds the
job's state (:meth:`ReplicaGroups._refuse_to_train_without_the_jobs_state`), and the job's first step waits
for every group (:meth:`ReplicaGroups._wait_for_every_group_at_the_jobs_start`).

Launcher contract (``unified-dist launch --replica-groups N`` sets it; docs/fault-tolerance.md for
several hosts): ``TORCHFT_LIGHTHOUSE`` (the lighthouse's address), ``REPLICA_GROUP_ID`` (0 .. N-1) and
``NUM_REPLICA_GROUPS`` (N) in every process of every group. torchft is imported only then.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

from ..errors import LaunchError, UnifiedDistError

if TYPE_CHECKING:  # torch is imported where it is used: the launcher reads this module's names without it
    import torch

LIGHTHOUSE_VAR = "TORCHFT_LIGHTHOUSE"
GROUP_VAR = "REPLICA_GROUP_ID"
GROUPS_VAR = "NUM_REPLICA_GROUPS"
MAX_UNCOMMITTED = 10
"""Steps in a row that may fail to commit before the group stops with one line (a fault that heals does
not last that long; a mismatch between groups, such as gradients for different parameters, would loop)."""
QUORUM_TIMEOUT = datetime.timedelta(seconds=60)
"""The least a step's quorum waits (torchft's default): longer than the lighthouse's join timeout."""
START_POLL_S = 0.5
"""How often a group on its first start asks again for the job's first quorum while some group is missing from it
(:meth:`ReplicaGroups._wait_for_every_group_at_the_jobs_start`)."""
RESTARTS_VAR = "REPLICA_GROUP_RESTARTS"
"""Set by ``unified-dist launch --replica-groups`` to how many times this group was started again: a group
started again must be healed from a live peer at its first step (else it would train from scratch)."""


@dataclass(frozen=True)
class ReplicaLayout:
    """Which replica group this process belongs to, of how many, and where their lighthouse is."""

    group: int
    groups: int
    lighthouse: str
    restarts: int = 0


def layout_from(environ: Mapping[str, str]) -> Optional[ReplicaLayout]:
    """The replica layout the launcher's variables give (``None``: no ``TORCHFT_LIGHTHOUSE``, so no
    fault tolerance). Raises :class:`LaunchError` in one line for a half-set or malformed layout."""
    lighthouse = environ.get(LIGHTHOUSE_VAR, "").strip()
    if not lighthouse:
        return None
    raw = {name: environ.get(name, "").strip() for name in (GROUP_VAR, GROUPS_VAR)}
    if not all(raw.values()) or not all(v.isdigit() for v in raw.values()):
        raise LaunchError(
            f"{LIGHTHOUSE_VAR}={lighthouse} asks for replica groups, but {GROUP_VAR}={raw[GROUP_VAR]!r} and "
            f"{GROUPS_VAR}={raw[GROUPS_VAR]!r} are not both whole numbers: set them in every process of every "
            "group (unified-dist launch --replica-groups N does)")
    group, groups = int(raw[GROUP_VAR]), int(raw[GROUPS_VAR])
    if not 0 <= group < groups:
        raise LaunchError(f"{GROUP_VAR}={group} is outside 0..{groups - 1} for {GROUPS_VAR}={groups}")
    restarts = environ.get(RESTARTS_VAR, "0").strip()
    return ReplicaLayout(group, groups, lighthouse, int(restarts) if restarts.isdigit() else 0)


def _flat_by_dtype(tensors: Iterable[torch.Tensor]) -> Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]]:
    buckets: Dict[Tuple[torch.dtype, torch.device], List[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.dtype, t.device), []).append(t)
    return buckets


RESTARTED_PREFIX = "unified_dist_restarted_group_"


def replica_id(layout: ReplicaLayout) -> str:
    """The name a group gives torchft: whether it was started again is in it, so the others' quorums tell a
    job's start (a group on its first start) from restarted groups that met nobody with the job's state. It
    ends with the group's index, from which torchft derives its ranks."""
    return f"{RESTARTED_PREFIX if layout.restarts else 'unified_dist_group_'}{layout.group}"


def first_start(torchft_replica_id: str) -> bool:
    """Whether a quorum's member (torchft's ``name:uuid``) is a group on its first start."""
    return not torchft_replica_id.startswith(RESTARTED_PREFIX)


class _QuorumsSeen:
    """torchft's ``ManagerClient``, keeping its latest quorum's answer (:attr:`latest`: who took part, at which
    step); every other call goes through unchanged."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self.latest: Any = None

    def _quorum(self, *args: Any, **kwargs: Any) -> Any:
        self.latest = self._client._quorum(*args, **kwargs)
        return self.latest

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class StepWatchdog:
    """Times a group's own work in each step, from its quorum to its commit, and calls ``leave`` once that
    outlasts ``timeout_s``.

    Waiting for the other groups is not the group's own work (:meth:`paused`): the cross-group all-reduces,
    the quorum and any copy to or from a restarted group, and ``should_commit`` are bounded by torchft's own
    timeouts. So a healthy group whose all-reduce waits for a peer that is still healing (the peer's copy has
    torchft's timeout) has not used its step's time, and fails only that step (not committed) rather than
    leaving; the two budgets are separate. Nothing is timed outside a step (:meth:`disarm` at the commit,
    :meth:`stop` at ``ud.shutdown``): after its last step a program may evaluate and save for as long as it needs.
    """

    def __init__(self, timeout_s: float, leave: Callable[[], None]) -> None:
        self.timeout_s = timeout_s
        self._leave = leave
        self._deadline: Optional[float] = None  # when the step's own time runs out (None: nothing timed now)
        self._left: Optional[float] = None  # paused: the step's own time left
        self._stopped = False

    def start(self) -> None:
        threading.Thread(target=self._watch, name="unified_dist-replica-watchdog", daemon=True).start()

    def arm(self) -> None:
        if not self._stopped:
            self._deadline, self._left = time.monotonic() + self.timeout_s, None

    def disarm(self) -> None:
        self._deadline = self._left = None

    @property
    def armed(self) -> bool:
        return self._deadline is not None or self._left is not None

    def stop(self) -> None:
        self._stopped = True
        self.disarm()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        deadline = self._deadline
        if deadline is None:
            yield
            return
        self._left, self._deadline = deadline - time.monotonic(), None
        try:
            yield
        finally:
            if self._left is not None and not self._stopped:
                self._deadline, self._left = time.monotonic() + self._left, None

    def overdue(self) -> bool:
        deadline = self._deadline
        return deadline is not None and time.monotonic() > deadline

    def _watch(self) -> None:
        while not self._stopped:
            time.sleep(min(1.0, self.timeout_s / 4))
            if self.overdue():
                self._leave()
                return


class ReplicaGroups:
    """This process's side of the replica groups: torchft's ``Manager`` over a reconfigurable gloo group.

    ``rank`` and ``world_size`` are the process's place inside its own group; rank ``r`` of one group
    exchanges gradients and healing state with rank ``r`` of the others (the groups' layouts match).
    """

    def __init__(self, layout: ReplicaLayout, rank: int, world_size: int, timeout: datetime.timedelta) -> None:
        if not os.environ.get("RUST_LOG"):  # torchft's Rust side logs every quorum at INFO otherwise
            os.environ["RUST_LOG"] = "warn"
        from torchft import Manager, ProcessGroupGloo

        self.layout = layout
        self.rank = rank
        self._load: Optional[Callable[[Any, bool], None]] = None
        self._save: Optional[Callable[[], Any]] = None
        self._open = False  # the quorum of the step now running has been held
        self._uncommitted = 0  # steps in a row that did not commit
        self._last_participants = layout.groups
        self.healed_at: Optional[int] = None  # the step at which this group was healed from a peer
        self.short_steps: List[Tuple[int, int]] = []  # (step, participating groups) of each step with fewer
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None, min_replica_size=1,
            use_async_quorum=False, replica_id=replica_id(layout), lighthouse_addr=layout.lighthouse,
            rank=rank,
            world_size=world_size, timeout=timeout, connect_timeout=timeout,
            # the lighthouse waits up to its join timeout for a group that is alive but late (a hang): the
            # quorum must outwait it, else the groups that are on time give up first
            quorum_timeout=max(timeout, QUORUM_TIMEOUT))
        self.manager.register_state_dict_fn("unified_dist", self._load_state, self._state)
        self._quorums = _QuorumsSeen(self.manager._client)  # the latest quorum's answer: who, at which step
        self.manager._client = self._quorums
        self._timeout_s = timeout.total_seconds()
        self._may_commit = layout.restarts == 0  # a restarted group: only once it holds the job's state
        self._started = layout.restarts > 0  # a group on its first start: once the job's start is behind it
        self._quorum_timeout_s = max(timeout, QUORUM_TIMEOUT).total_seconds()
        self._watchdog = StepWatchdog(self._timeout_s, self._leave)
        self._watchdog.start()

    def _leave(self) -> None:
        """The watchdog's end for a group whose own work in a step outlasted the timeout: exit 1. torchft's
        heartbeat runs on its own thread, so a group whose training hangs still looks alive, and the others
        would wait for it at every quorum; once it exits, they go on without it and the launcher starts it
        again, healed from them."""
        print(f"unified_dist: replica group {self.layout.group} rank {self.rank}: step "
              f"{self.manager.current_step() + 1} has run for more than the timeout ({self._timeout_s:g} s): "
              "leaving so the other groups go on; the launcher starts this group again",
              file=sys.stderr, flush=True)
        os._exit(1)

    # ----------------------------------------------------------------- healing
    def heal_with(self, save: Callable[[], Any], load: Callable[[Any, bool], None]) -> None:
        """What a (re)joining group receives from a live peer: ``save()`` on the peer, ``load(state, rng)``
        here (``rng``: whether to take the peer's generators too)."""
        self._save, self._load = save, load

    def _state(self) -> Any:
        return self._save() if self._save is not None else {}

    def _load_state(self, state: Any) -> None:
        self.healed_at = self.manager.current_step()
        # at step 0 every group takes group 0's start (torchft's init_sync): not its generators, which would undo
        # per-rank seeds across groups, and no line
        if self._load is not None:
            self._load(state, self.healed_at > 0)
        if self.rank == 0 and self.healed_at > 0:
            print(f"unified_dist: replica group {self.layout.group} healed from a live peer at step {self.healed_at}"
                  " (no checkpoint read)", file=sys.stderr, flush=True)

    # ----------------------------------------------------------------- one step
    def begin_step(self) -> None:
        """Start this step's quorum, once per step (idempotent until :meth:`commit`), and time the group's own
        work in the step from here (:class:`StepWatchdog`)."""
        if not self._open:
            self.manager.start_quorum()  # a copy to or from a restarted group happens in here: not timed
            if not self._started:
                self._wait_for_every_group_at_the_jobs_start()
            if not self._may_commit:
                self._refuse_to_train_without_the_jobs_state()
            self._open = True
            self._watchdog.arm()
        elif not self._watchdog.armed:  # the loop came back to a step it left (pause_step)
            self._watchdog.arm()

    def pause_step(self) -> None:
        """The training loop left its loader with this step's quorum held (a ``break`` right after a fetch):
        what the program does now (an evaluation, a save) is not the step's own work and is not timed; a fetch
        from the training loader times the step again."""
        self._watchdog.disarm()

    def _wait_for_every_group_at_the_jobs_start(self) -> None:
        """A group on its first start takes no step before a quorum has held every group, or one at a step above 0
        (the job had started: torchft heals this group from it).

        The lighthouse gives a quorum to the groups that send it heartbeats, and a group that has not started
        yet sends none: without this wait, a group that starts first trains alone, and one that starts after it
        finished trains the whole job again from scratch, each ending with status 0 and a model of its own. So the
        quorum is asked for again every :data:`START_POLL_S` (the lighthouse gives no quorum to half or fewer of
        the groups sending heartbeats, so a late group's first request waits for the next one) for at least the
        quorum's timeout, then the group stops in one line. The number of tries is fixed, so every rank of the
        group makes the same ones."""
        tries = math.ceil(self._quorum_timeout_s / START_POLL_S)
        for tried in range(tries + 1):
            quorum = self._quorums.latest
            if quorum is None or quorum.max_step > 0 or len(quorum.replica_ids) >= self.layout.groups:
                self._started = True
                return
            if tried < tries:
                time.sleep(START_POLL_S)
                self.manager.start_quorum()
        met = ", ".join(sorted(r.split(":")[0] for r in quorum.replica_ids)) or "none"
        raise UnifiedDistError(
            f"replica group {self.layout.group}: the job's first step needs all {self.layout.groups} replica groups, "
            f"but after {self._quorum_timeout_s:g} s its quorum held {len(quorum.replica_ids)} ({met}): start every "
            f"group against the lighthouse {self.layout.lighthouse} within that time (unified-dist launch "
            f"--replica-groups N starts them together), or set {GROUPS_VAR} to the groups you start")

    def _holds_the_jobs_state(self) -> bool:
        """Whether this restarted group may train now: it took a live group's state at a step > 0, or the
        latest quorum is the job's start (step 0) with a group on its first start in it. Two restarted groups
        that meet at step 0 (each took the other's fresh start, or nobody's) hold nothing of the job."""
        if self.healed_at:
            return True
        quorum = self._quorums.latest
        return quorum is not None and quorum.max_step == 0 and any(first_start(r) for r in quorum.replica_ids)

    def _refuse_to_train_without_the_jobs_state(self) -> None:
        """A group started again must not commit a step before it holds the job's state
        (:meth:`_holds_the_jobs_state`): at its first quorum it stops in one line rather than train from scratch.

        It need not wait for a live group that is busy between two steps (a long evaluation or save): the
        lighthouse issues no quorum to half or fewer of the groups that send heartbeats, so with two groups the
        restarted one's first quorum waits for the live one's next step (up to the quorum's timeout)."""
        if self._holds_the_jobs_state():
            self._may_commit = True
            return
        quorum = self._quorums.latest
        met = "no other group" if quorum is None or len(quorum.replica_ids) < 2 else \
            "only groups that were started again themselves, at step 0"
        raise UnifiedDistError(
            f"replica group {self.layout.group} was started again ({RESTARTS_VAR}={self.layout.restarts}) but found "
            f"no live replica group to heal from (it met {met}): it would train from scratch; restart the job from "
            "its last checkpoint (ud.save) instead")

    @property
    def opened(self) -> bool:
        """Whether this step's quorum has been held (by a prepared loader's fetch)."""
        return self._open

    def average(self, tensors: Iterable[torch.Tensor]) -> bool:
        """Average ``tensors`` in place over the groups taking part in this step (one all-reduce per dtype; a
        DTensor's local shard: the groups' layouts match). Where the all-reduce failed (a group was lost during
        it), ``tensors`` are left as they were and the result is ``False``; the step will then not commit."""
        self.begin_step()
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
        works = []
        with self._watchdog.paused():  # waiting for the other groups: torchft's timeout bounds it, not the step's
            for group in _flat_by_dtype(local).values():
                flat = _flatten_dense_tensors(group)
                works.append((self.manager.allreduce(flat), flat, group))
            for work, _, _ in works:
                work.wait()
        if self.manager.errored() is not None:  # torchft zeroes what a failed all-reduce held
            return False
        for _, flat, group in works:
            for t, averaged in zip(group, _unflatten_dense_tensors(flat, group)):
                t.copy_(averaged)
        return True

    def commit(self) -> bool:
        """Whether this step's update may be applied (every group that took part got the same average).
        Ends the step: the next :meth:`begin_step` starts the next quorum."""
        self.begin_step()
        self._open = False
        self._watchdog.disarm()  # the step's own work is done; should_commit has torchft's timeout
        ok = self.manager.should_commit()
        self._uncommitted = 0 if ok else self._uncommitted + 1
        if self._uncommitted >= MAX_UNCOMMITTED:
            raise UnifiedDistError(
                f"replica group {self.layout.group}: {self._uncommitted} steps in a row did not commit (the last "
                f"error: {self.manager.errored()!r}); every group must give gradients for the same parameters at "
                "every step, and the groups must reach one another over gloo")
        participants = self.participants
        if participants < self.layout.groups:
            self.short_steps.append((self.manager.current_step(), participants))
        if participants != self._last_participants and self.rank == 0:
            print(f"unified_dist: replica group {self.layout.group}: step {self.manager.current_step()} ran with "
                  f"{participants} of {self.layout.groups} groups", file=sys.stderr, flush=True)
        self._last_participants = participants
        return ok

    @property
    def participants(self) -> int:
        """Replica groups that took part in the latest quorum (all of them before the first: torchft
        answers 0 then)."""
        return int(self.manager.num_participants()) or self.layout.groups

    def disarm(self) -> None:
        """No step is timed any more (``ud.shutdown``, the interpreter's exit): what the program does after
        its last step (an evaluation, a save) may take as long as it needs."""
        self._watchdog.stop()

    def shutdown(self) -> None:
        self.disarm()
        self.manager.shutdown(wait=False)


def refuse_layout(environ: Mapping[str, str], config: Any, backend: str, launcher: str) -> Optional[str]:
    """Why this job cannot run with the replica groups its variables ask for, in one line (``None``: it can,
    or none are asked for). Raises :class:`LaunchError` for malformed variables (:func:`layout_from`)."""
    layout = layout_from(environ)
    if layout is None:
        return None
    if backend != "torch":
        return (f"replica groups ({LIGHTHOUSE_VAR} is set) run on the torch backend: {launcher} runs the "
                f"{backend} backend, which torchft cannot make fault tolerant; start each group with torchrun, "
                "srun, mpirun or python (unified-dist launch --replica-groups N does)")
    what = None
    if config.sharding.tp > 1:
        what = f"tp={config.sharding.tp} (tensor parallelism)"
    elif config.mixed_precision == "fp16":
        what = "mixed_precision='fp16' (a loss scaler per group)"
    elif config.gradient_compression:
        what = f"gradient_compression={config.gradient_compression!r}"
    elif config.sync_batchnorm:
        what = "sync_batchnorm=True (batch statistics across groups)"
    if what is None:
        return None
    return (f"{what} is not supported with replica groups ({GROUP_VAR}={layout.group} of {layout.groups}): "
            "use DDP, FSDP2 or HSDP inside each group, bf16 or no mixed precision, or run without "
            f"{LIGHTHOUSE_VAR}")


def refuse_objects(objs: Iterable[Any], optimizers_so_far: int) -> Optional[str]:
    """Why ``ud.prepare(*objs)`` cannot run with replica groups, in one line (``None``: it can)."""
    import torch

    objs = list(objs)
    optimizers = optimizers_so_far + sum(isinstance(o, torch.optim.Optimizer) for o in objs)
    if optimizers > 1:
        return (f"replica groups commit one optimizer step per quorum, and this job prepares {optimizers} "
                "optimizers: put every parameter group in one optimizer")
    for obj in objs:
        if isinstance(obj, torch.utils.data.DataLoader) and isinstance(obj.dataset, torch.utils.data.IterableDataset):
            return ("a prepared stream (a DataLoader over an IterableDataset) cannot be handed to a replica group "
                    "that rejoins: use a map-style dataset with replica groups")
    return None
