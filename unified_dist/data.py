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
  its share of the step's real samples (see :mod:`unified_dist.training`). Only when
  ``m < world_size`` do the last ranks get one padding sample each (the batch's first), which
  ``ud.backward`` weights by zero and which sits at the end of the gathered rows, where
  ``gather_for_metrics`` drops it.

Progress is counted in global samples, so a loader's ``state_dict`` resumes mid-epoch under
another world size as long as the global batch is the same.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, RandomSampler, SequentialSampler

from . import nested
from .errors import UnifiedDistError


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


class LoaderStack:
    """The prepared loaders being iterated right now, innermost last (eval inside train)."""

    def __init__(self) -> None:
        self._active: List["PreparedDataLoader"] = []

    def push(self, loader: "PreparedDataLoader") -> None:
        self._active.append(loader)

    def remove(self, loader: "PreparedDataLoader") -> None:
        if loader in self._active:
            self._active.remove(loader)

    @property
    def current(self) -> Optional["PreparedDataLoader"]:
        return self._active[-1] if self._active else None


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


class Epochs:
    """What every prepared loader does around a pass: counting epochs (each pass starts the next one unless
    told otherwise) and being the current loader of its :class:`LoaderStack` while the pass runs."""

    _epoch = 0  # the epoch being iterated (while _in_pass)
    _next_epoch = 0  # the epoch the next pass starts
    _in_pass = False
    _stack: LoaderStack
    device: torch.device
    batch_info: Optional[BatchInfo]

    def _pass(self, batches: Iterator[Any]) -> Iterator[Any]:
        """``batches`` moved to the device, with this loader current meanwhile; the pass ends (``epoch``
        moves on) only when all are out, so a pass left midway is resumed by ``state_dict``."""
        self._in_pass = True
        self._stack.push(self)  # type: ignore[arg-type]
        completed = False
        try:
            for batch in batches:
                yield _move(batch, self.device)
            completed = True
        finally:
            self._stack.remove(self)  # type: ignore[arg-type]
            self.batch_info = None
            if completed:
                self._in_pass = False

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or the one the next iteration starts."""
        return self._epoch if self._in_pass else self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration epoch ``epoch`` (only needed to jump; iterating advances it)."""
        self._next_epoch = epoch


class PreparedDataLoader(Epochs):
    """A ``DataLoader`` sharded across ranks (see the module docstring for the layout).

    Iterating it again starts the next epoch (with a new order when shuffling); no
    ``set_epoch`` call is needed. Batches arrive on the backend's device.
    ``state_dict``/``load_state_dict`` resume mid-epoch, counted in global samples.
    """

    def __init__(self, loader: DataLoader, topology: Callable[[], Tuple[int, int]], device: torch.device,
                 seed: int, stack: LoaderStack) -> None:
        if isinstance(loader.dataset, IterableDataset):  # pragma: no cover - prepare() routes streams elsewhere
            raise UnifiedDistError("a stream needs unified_dist.streams.PreparedStreamLoader")
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
        self._resume_from = 0
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
        # read at every pass: an elastic job (horovodrun --min-np) may have changed size
        self.batch_sampler.rank, self.batch_sampler.world_size = self._topology()
        self._epoch, self._next_epoch = self._next_epoch, self._next_epoch + 1
        start, self._resume_from = self._resume_from, 0
        self.batch_sampler.epoch, self.batch_sampler.start = self._epoch, start
        sizes = plan_global_batches(self._num_samples, self.batch_sampler.global_batch, start,
                                    self.batch_sampler.drop_last)
        rank, world = self.batch_sampler.rank, self.batch_sampler.world_size
        self._consumed, self._sizes = start, sizes
        yield from self._pass(self._batches(sizes, rank, world))

    def _batches(self, sizes: List[int], rank: int, world: int) -> Iterator[Any]:
        for i, (m, batch) in enumerate(zip(sizes, self._loader)):
            self._index = i
            counts = [shard(m, world, r)[0] for r in range(world)]
            self.batch_info = BatchInfo(real=m, padded=max(m, world), is_last=i == len(sizes) - 1,
                                        mine=counts[rank], counts=counts)
            self._consumed += m
            yield batch

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> Dict[str, int]:
        """Where the data stream stands: the epoch and the global samples consumed in it."""
        if self._in_pass:
            epoch, consumed = self._epoch, self._consumed
        else:  # between passes: where the next one starts (mid-epoch after a load_state_dict)
            epoch, consumed = self._next_epoch, self._resume_from
        return {"epoch": epoch, "samples_consumed": consumed, "num_samples": self._num_samples,
                "seed": self.seed}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Make the next iteration continue where ``state`` was taken (any world size)."""
        if "samples_consumed" not in state:
            raise UnifiedDistError(
                "this loader state was saved by a prepared stream (an IterableDataset); a map-style loader resumes "
                "only from a map-style loader's state_dict()")
        if int(state.get("num_samples", self._num_samples)) != self._num_samples:
            raise UnifiedDistError(
                f"loader state is for a dataset of {state['num_samples']} samples, this one has "
                f"{self._num_samples}; resume with the same data")
        self.seed = int(state.get("seed", self.seed))
        self._in_pass = False
        self._next_epoch = int(state["epoch"])
        self._resume_from = int(state["samples_consumed"])
        if not plan_global_batches(self._num_samples, self.batch_sampler.global_batch,
                                   self._resume_from, self.batch_sampler.drop_last):
            self._next_epoch, self._resume_from = self._next_epoch + 1, 0  # that epoch was finished
