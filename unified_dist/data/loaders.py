"""Sharded data loading whose order does not depend on the world size.

The same sampler is used under every backend, so that the data order -- and therefore the
losses -- are the same under torchrun, accelerate launch, horovodrun and plain python.

Layout. Each epoch has one *global order* of the dataset (a permutation seeded by
``seed + epoch`` when the loader shuffles, the sampler's own order otherwise), identical on every
rank and for every world size. It is cut into *global batches* of ``B = batch_size * world_size``
consecutive positions; rank ``r`` takes the ``r``-th contiguous slice of each. Hence

* the union of step ``s``'s per-rank batches is exactly positions ``[s*B, (s+1)*B)`` -- the
  single-process batch ``s`` with batch size ``B``, or ``world_size`` consecutive micro-batches
  of a single process accumulating gradients;
* ``all_gather`` of per-rank results (concatenated in rank order) is in global order;
* a last global batch of ``m < B`` samples (``drop_last=False``) is split as evenly as it goes,
  still contiguously: the first ``m % world_size`` ranks take one sample more. No sample is
  repeated, so no gradient counts one twice: ``ud.backward`` weights each rank's mean loss by
  its share of the step's real samples (see :mod:`unified_dist.training.accumulation`). Only when
  ``m < world_size`` do the last ranks get one padding sample each (the batch's first), which
  ``ud.backward`` weights by zero and which sits at the end of the gathered rows, where
  ``gather_for_metrics`` drops it.

Progress is counted in global samples, so a loader's ``state_dict`` resumes mid-epoch under
another world size as long as the global batch is the same.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from .. import nested
from ..errors import UnifiedDistError


def plan_global_batches(num_samples: int, global_batch: int, start: int, drop_last: bool) -> List[int]:
    """Sizes ``m`` of the global batches of one epoch that begins at sample position ``start``."""
    sizes, pos = [], start
    while pos < num_samples:
        m = min(global_batch, num_samples - pos)
        if m < global_batch and drop_last:
            break
        sizes.append(m)
        pos += m
    return sizes


def shard(m: int, world_size: int, rank: int) -> Tuple[int, int]:
    """(count, offset) of ``rank``'s contiguous slice of a global batch of ``m`` samples."""
    base, extra = divmod(m, world_size)
    return base + (1 if rank < extra else 0), rank * base + min(rank, extra)


class ShardedBatchSampler:
    """Yields this rank's index batches for one epoch (set :attr:`epoch`/:attr:`start` first)."""

    def __init__(self, order_fn: Callable[[int], Sequence[int]], num_samples: int, batch_size: int,
                 rank: int, world_size: int, drop_last: bool) -> None:
        self.order_fn = order_fn
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.drop_last = drop_last
        self.epoch = 0
        self.start = 0

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def __iter__(self) -> Iterator[List[int]]:
        order = list(self.order_fn(self.epoch))
        n = len(order)
        pos = self.start
        for m in plan_global_batches(n, self.global_batch, self.start, self.drop_last):
            count, offset = shard(m, self.world_size, self.rank)
            yield [order[p] for p in range(pos + offset, pos + offset + count)] if count else [order[pos]]
            pos += m

    def __len__(self) -> int:
        return len(plan_global_batches(self.num_samples, self.global_batch, self.start, self.drop_last))


@dataclass
class BatchInfo:
    """What the loader knows about the batch it just yielded."""

    real: int  # samples in this global batch that are not padding
    padded: int  # rows an all_gather of per-sample results has (real, plus one per rank without any)
    is_last: bool  # the epoch's last batch
    mine: int = 0  # this rank's real samples in it (0: its one row is padding)
    counts: Optional[List[int]] = None  # each data-parallel rank's real samples in it, in rank order

    @property
    def even(self) -> bool:
        """Whether every rank holds the same number of real samples (then no rank's weight differs)."""
        return self.counts is None or len(set(self.counts)) == 1

    def kept_rows(self) -> Optional[List[int]]:
        """Positions of the real rows in an all_gather of per-sample rows (``None``: all of them); a rank
        without a real sample gives one padding row."""
        if self.counts is None or self.real == self.padded:
            return None
        rows, start = [], 0
        for count in self.counts:
            rows.extend(range(start, start + count))
            start += max(count, 1)
        return rows


_END = object()


class LoaderStack:
    """The prepared loaders being iterated right now, innermost last (eval inside train)."""

    def __init__(self) -> None:
        self._active: List["PreparedDataLoader"] = []
        self.before_batch: Optional[Callable[[], None]] = None
        """Called before a prepared map-style loader fetches each batch (``None``: nothing). Replica groups
        start their step's quorum there, so a group healed from a peer draws the peer's next batch
        (:meth:`PreparedDataLoader.jump_to`) and computes it on the peer's weights."""
        self.pass_topology: Optional[Callable[["PreparedDataLoader"], Optional[Tuple[int, int]]]] = None
        """Called as a pass of a prepared map-style loader begins: the (rank, world size) to shard that pass
        over instead of the loader's own topology (``None``: nothing to change). Replica groups shard an
        evaluation pass over the group's own ranks, so each group evaluates the whole split."""
        self.pass_ended: Optional[Callable[["PreparedDataLoader"], None]] = None
        """Called when a pass of a prepared map-style loader ends, run to its end or left midway. Replica groups
        stop timing a step whose quorum a training loop held and then left."""

    def push(self, loader: "PreparedDataLoader") -> None:
        self._active.append(loader)

    def remove(self, loader: "PreparedDataLoader") -> None:
        if loader in self._active:
            self._active.remove(loader)

    @property
    def current(self) -> Optional["PreparedDataLoader"]:
        """The innermost prepared loader being iterated (``None`` outside every prepared loop)."""
        return self._active[-1] if self._active else None

    @property
    def current_batch(self) -> Optional[BatchInfo]:
        """The batch that loader handed out last: its real and padded rows, each rank's share, whether
        it ends the pass. ``None`` outside a prepared loop (and before its first batch). The one way
        the accumulation windows, ``ud.backward``'s weights and ``gather_for_metrics`` read it."""
        loader = self.current
        return loader.batch_info if loader is not None else None

    def note_training(self) -> None:
        """A training step ran (``ud.backward``, a prepared optimizer's step): the current loader's pass has
        been trained on, so it is no peek (see :class:`Epochs`)."""
        if self._active:
            self._active[-1].note_training()


def _move(batch: Any, device: torch.device) -> Any:
    """``batch`` with every tensor, and every leaf with a ``.to`` (``BatchEncoding``), on ``device``."""
    if device.type == "cpu":
        return batch
    return nested.map_leaves(
        lambda leaf: leaf.to(device, non_blocking=True) if isinstance(leaf, torch.Tensor) or hasattr(leaf, "to")
        else leaf, batch)


def worker_options(loader: DataLoader, seed: int) -> Dict[str, Any]:
    """The user's ``DataLoader`` options about worker processes and memory, for the loader built in its place."""
    options: Dict[str, Any] = dict(
        num_workers=loader.num_workers, pin_memory=loader.pin_memory, timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
        # Starting an iterator draws a worker seed from `generator`; a private one keeps the
        # global RNG (dropout) untouched, so a resumed run draws the same numbers.
        generator=loader.generator if loader.generator is not None else torch.Generator().manual_seed(seed))
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    return options


PEEKS_BEFORE_WARNING = 3
"""Peeks given back in a row, of the same epoch, after which a loader warns (once) that its passes look
like peeks: a loop that trains on one batch per pass without ``ud.backward`` would repeat that batch."""


@dataclass
class PassRecord:
    """One pass over a prepared loader: what it started from and what it used (see :class:`Epochs`)."""

    epoch: int
    resume: Any  # where in its epoch it started (the loader's resume point; None: the epoch's start)
    handed: int = 0  # batches handed out
    trained: bool = False  # a training step ran while this loader was the current one

    @property
    def peek(self) -> bool:
        """Whether, abandoned now, the pass is a peek: at most one batch out and nothing trained on it."""
        return self.handed <= 1 and not self.trained


class Epochs:
    """What every prepared loader does around a pass: counting epochs and being the current loader of its
    :class:`LoaderStack` while the pass runs.

    The epoch rule (docs/data-order.md, "Peeks and abandoned passes"). Each pass starts the next epoch,
    except after a *peek*: a pass abandoned after handing out at most one batch, with no training step
    (``ud.backward``, a prepared optimizer's ``step``) while this loader was the current one --
    ``next(iter(loader))``. A peek gives its epoch back: the next pass starts that epoch again, at the
    point the peek started from, and ``state_dict`` reads as if the peek never happened. Any other pass
    abandoned midway (a ``break`` after a training step or a second batch) used its epoch: the next pass
    starts the next epoch, with its own order, and ``state_dict`` holds where the abandoned pass stopped
    (a mid-epoch checkpoint resumes there). ``set_epoch`` and ``load_state_dict`` override both.
    """

    _epoch = 0  # the epoch being iterated (while _in_pass)
    _next_epoch = 0  # the epoch the next pass starts
    _resume: Any = None  # where the next pass starts within its epoch (the subclass's form; None: its start)
    _in_pass = False
    _open: Optional[PassRecord] = None  # the latest pass, until it ends or the epoch is set
    _peeks = 0  # peeks given back in a row
    _stack: LoaderStack
    device: torch.device
    batch_info: Optional[BatchInfo]

    def _begin_pass(self) -> Any:
        """Start a pass (a previous one still open is settled first: an iterator kept after a peek); returns
        the resume point it starts from, and the next pass then starts the next epoch."""
        self._give_back_a_peek()
        record = PassRecord(self._next_epoch, self._resume)
        self._open, self._in_pass = record, True
        self._epoch, self._next_epoch, self._resume = record.epoch, record.epoch + 1, None
        return record.resume

    def _pass(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` moved to the device, with this loader current meanwhile, counted in the pass's record;
        a pass left midway is settled by the epoch rule (the class doc)."""
        record = self._open
        self._stack.push(self)  # type: ignore[arg-type]
        completed = False
        try:
            for batch in batches:
                record.handed += 1
                yield _move(batch, self.device)
            completed = True
        finally:
            self._stack.remove(self)  # type: ignore[arg-type]
            if self._stack.pass_ended is not None:
                self._stack.pass_ended(self)  # type: ignore[arg-type]
            if record is self._open:  # not overtaken by a later pass, set_epoch or load_state_dict
                self.batch_info = None
                if completed:
                    self._in_pass, self._open, self._peeks = False, None, 0
                else:
                    self._give_back_a_peek()

    def _give_back_a_peek(self) -> None:
        """If the open pass was abandoned as a peek, make the next pass start where it started."""
        record = self._open
        if record is None:
            return
        if not record.peek:
            self._peeks = 0
            return
        self._open, self._in_pass = None, False
        self._next_epoch, self._resume = record.epoch, record.resume
        self._peeks += 1
        if self._peeks == PEEKS_BEFORE_WARNING:
            warnings.warn(
                f"unified_dist: a prepared loader started epoch {record.epoch} again {self._peeks} times in a row: "
                "each pass stopped after its first batch with no ud.backward() or prepared optimizer.step() on it, "
                "which makes it a peek (like next(iter(loader))) that does not use up the epoch; if you train on one "
                "batch per pass, call ud.backward(loss), or loader.set_epoch(epoch) before each pass", UserWarning,
                stacklevel=4)

    def note_training(self) -> None:
        """A training step ran on this loader's batch: its open pass is no peek (see the class doc)."""
        if self._open is not None:
            self._open.trained = True

    def _restart_at(self, epoch: int, resume: Any) -> None:
        """Make the next pass start ``epoch`` at ``resume`` (None: its start), whatever pass is open."""
        self._in_pass, self._open, self._peeks = False, None, 0
        self._next_epoch, self._resume = epoch, resume

    def _position(self) -> Tuple[bool, int, Any]:
        """For ``state_dict``: whether the open pass counts (it is no peek), and else the epoch and the resume
        point the next pass starts from -- an open peek reads as if it never happened."""
        record = self._open
        if self._in_pass and record is not None and record.peek:
            return False, record.epoch, record.resume
        return self._in_pass, self._next_epoch, self._resume

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or the one the next iteration starts."""
        return self._epoch if self._in_pass else self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (only needed to jump; iterating advances it). A resume
        point loaded by ``load_state_dict`` is kept."""
        self._next_epoch, self._open, self._peeks = epoch, None, 0


class PreparedDataLoader(Epochs):
    """A ``DataLoader`` sharded across ranks (see the module docstring for the layout).

    Iterating it again starts the next epoch (with a new order when shuffling); no
    ``set_epoch`` call is needed, and a peek (``next(iter(loader))``) does not use up an epoch (see
    :class:`Epochs`). Batches arrive on the backend's device.
    ``state_dict``/``load_state_dict`` resume mid-epoch, counted in global samples.
    """

    def __init__(self, loader: DataLoader, topology: Callable[[], Tuple[int, int]], device: torch.device,
                 seed: int, stack: LoaderStack) -> None:
        if isinstance(loader.dataset, IterableDataset):  # pragma: no cover - prepare() routes streams elsewhere
            raise UnifiedDistError("a stream needs unified_dist.data.streams.PreparedStreamLoader")
        if isinstance(loader.sampler, DistributedSampler):
            raise UnifiedDistError(
                "prepare() got a DataLoader whose sampler is already a DistributedSampler, so each rank would see "
                f"1/{loader.sampler.num_replicas} of its own shard; build the DataLoader without the sampler "
                "(shuffle=True or False) and let prepare() shard it, with no set_epoch calls")
        if loader.batch_size is None:
            raise UnifiedDistError(
                "prepare() needs a DataLoader built with batch_size=...; a custom batch_sampler "
                "cannot be sharded without changing its batches")
        self.dataset = loader.dataset
        self.batch_size = loader.batch_size
        self.shuffle = isinstance(loader.sampler, RandomSampler)
        self.seed = seed
        self.device = device
        self._stack = stack
        self._base_sampler = loader.sampler
        self._num_samples = len(loader.sampler) if not self.shuffle else len(self.dataset)
        self._topology = topology
        rank, world_size = topology()
        self.batch_sampler = ShardedBatchSampler(
            self._order, self._num_samples, loader.batch_size, rank, world_size, loader.drop_last)
        self._loader = DataLoader(self.dataset, batch_sampler=self.batch_sampler, collate_fn=loader.collate_fn,
                                  persistent_workers=loader.persistent_workers, **worker_options(loader, seed))
        self._next_epoch = 0
        self._resume: Optional[int] = None
        self._epoch = 0
        self._consumed = 0
        self._in_pass = False
        self.batch_info: Optional[BatchInfo] = None
        self._sizes: List[int] = []
        self._index = 0

    def window_samples(self, micro_batches: int) -> int:
        """Real samples in the current batch and the next ``micro_batches - 1`` of this epoch."""
        return sum(self._sizes[self._index:self._index + micro_batches])

    def _order(self, epoch: int) -> Sequence[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + epoch)
            return torch.randperm(self._num_samples, generator=generator).tolist()
        if isinstance(self._base_sampler, SequentialSampler):
            return range(self._num_samples)
        if hasattr(self._base_sampler, "set_epoch"):
            self._base_sampler.set_epoch(epoch)
        return list(self._base_sampler)

    def __len__(self) -> int:
        """Batches per rank in a whole epoch."""
        return len(plan_global_batches(self._num_samples, self.batch_sampler.global_batch, 0,
                                       self.batch_sampler.drop_last))

    def __iter__(self) -> Iterator[Any]:
        while True:
            # read at every pass: an elastic job (horovodrun --min-np) may have changed size
            topology = self._stack.pass_topology(self) if self._stack.pass_topology is not None else None
            self.batch_sampler.rank, self.batch_sampler.world_size = topology or self._topology()
            start = self._begin_pass() or 0
            self.batch_sampler.epoch, self.batch_sampler.start = self._epoch, start
            sizes = plan_global_batches(self._num_samples, self.batch_sampler.global_batch, start,
                                        self.batch_sampler.drop_last)
            rank, world = self.batch_sampler.rank, self.batch_sampler.world_size
            self._consumed, self._sizes = start, sizes
            yield from self._pass(self._batches(sizes, rank, world))
            if not self._jumped:
                return
            self._jumped = False  # jump_to: the same iteration goes on at the position it was given

    def _batches(self, sizes: List[int], rank: int, world: int) -> Iterator[Any]:
        fetched = iter(self._loader)
        for i, m in enumerate(sizes):
            if self._stack.before_batch is not None:
                self._stack.before_batch()
                if self._jumped:  # healed from a peer just now: go on at the peer's position
                    return
            batch = next(fetched, _END)
            if batch is _END:
                return
            self._index = i
            counts = [shard(m, world, r)[0] for r in range(world)]
            self.batch_info = BatchInfo(real=m, padded=max(m, world), is_last=i == len(sizes) - 1,
                                        mine=counts[rank], counts=counts)
            self._consumed += m
            yield batch

    _jumped = False  # jump_to ran during a pass: the iteration in progress continues at the new position

    def jump_to(self, state: Dict[str, int]) -> None:
        """:meth:`load_state_dict`, and an iteration in progress continues at that position with its next
        batch (a replica group healed from a peer mid-epoch: ``for batch in loader`` goes on where the
        peer's loader stands, in the peer's epoch)."""
        in_pass = self._in_pass
        self.load_state_dict(state)
        self._jumped = in_pass

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> Dict[str, int]:
        """Where the data stream stands: ``epoch``, ``seed`` and ``samples_consumed`` (the global samples
        consumed in the epoch; a prepared stream's state has the same three), plus ``num_samples``."""
        counted, epoch, resume = self._position()
        if counted:
            epoch, consumed = self._epoch, self._consumed
        else:  # between passes: where the next one starts (mid-epoch after a load_state_dict)
            consumed = resume or 0
        return {"epoch": epoch, "samples_consumed": consumed, "num_samples": self._num_samples,
                "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Make the next iteration continue where ``state`` was taken (any world size)."""
        if "stream" in state or "samples_consumed" not in state:
            raise UnifiedDistError(
                "this loader state was saved by a prepared stream (an IterableDataset); a map-style loader resumes "
                "only from a map-style loader's state_dict()")
        if int(state.get("num_samples", self._num_samples)) != self._num_samples:
            raise UnifiedDistError(
                f"loader state is for a dataset of {state['num_samples']} samples, this one has "
                f"{self._num_samples}; resume with the same data")
        self.seed = int(state.get("seed", self.seed))
        epoch, consumed = int(state["epoch"]), int(state["samples_consumed"])
        if not plan_global_batches(self._num_samples, self.batch_sampler.global_batch, consumed,
                                   self.batch_sampler.drop_last):
            epoch, consumed = epoch + 1, 0  # that epoch was finished
        self._restart_at(epoch, consumed)
