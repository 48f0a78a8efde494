"""Sharded loading of streams (``IterableDataset``) with the promise of map-style loaders.

A prepared stream loader cuts the stream into *global batches* of ``B = batch_size x (data-parallel
world size)`` and gives rank ``r`` the ``r``-th slice of each, exactly as :mod:`unified_dist.data.loaders` does
for map-style datasets: step ``s`` of N ranks is one process's step ``s``, each example comes once per
epoch, a ragged last global batch is split as evenly as it goes (``ud.backward`` weights it exactly;
ranks without a sample get one padding row weighted 0, dropped by ``gather_for_metrics``), and every
rank ends the epoch at the same step, whatever the stream's length.

Two ways to read, chosen per pass (see :func:`choose_split`):

* **whole stream** (a dataset without shards, ``split=False``, or the fallback): every data-parallel
  rank reads the whole stream and keeps its slice. Every rank then knows every global batch's size and
  where the stream ends without communicating, the order is one process's at any world size, and a
  resume works at any world size. The price: each rank reads (and the dataset decodes) the whole stream.
  The stream must be the same on every rank: every :data:`EXCHANGE_STEPS` steps the fingerprints of the
  next ``EXCHANGE_STEPS`` + lookahead global batches are compared across ranks (one tiny ``all_gather``)
  before any of them is taken, so a stream that differs, late or by ending earlier on one rank, is
  refused on every rank at the same step. A ``datasets`` stream already split by
  ``split_dataset_by_node`` is refused (it would be split again).
* **shards** (split): when the dataset splits itself -- it has ``n_shards`` and ``shard(num_shards, index)``
  (a ``datasets.IterableDataset`` has both; for ``load_dataset(..., streaming=True)`` a shard is a file)
  and the data-parallel world size divides ``n_shards`` -- the epoch follows one *canonical order* that
  does not depend on the world size (see :func:`canonical_slot`): slot ``p`` is example ``p // n`` of
  shard ``p % n`` (``n`` shards, each read on its own, so what a dataset packs or tokenises per shard
  does not depend on the world size either), empty once that shard has ended; step ``t`` holds the
  examples of slots ``t*B .. (t+1)*B - 1``. Rank ``r`` owns the slots ``p = r (mod N)``, i.e. the shards
  ``r, r + N, ...``, and reads only those. One process (N = 1) reads all shards in that order, so 1, 2,
  4, ... ranks train on the same global batches. A step whose slots are all empty is skipped (by every
  world size alike); a rank with no example in a step gets a padding row (weight 0). The ranks exchange
  how many examples each holds for the next steps in one ``all_gather`` every :data:`EXCHANGE_STEPS`
  steps; the epoch ends when every shard is used up. A world size that does not divide ``n_shards``
  falls back to the whole stream (in the dataset's own order) with a one-line warning.

``num_workers > 0``: each worker reads the rank's stream as one process would (a dataset's own
``get_worker_info`` splitting is bypassed) and keeps every ``num_workers``-th batch; the loader
takes the workers' batches in turn, so the order does not depend on ``num_workers`` and nothing is
duplicated.

Shuffling: :func:`stream` wraps a dataset with a shuffle buffer seeded by ``seed_everything``'s
seed + epoch (``datasets``' own ``shuffle(seed, buffer_size)`` for a ``datasets.IterableDataset``, which
also shuffles its shards), the same on every rank. Read by shards, the shards' order is a permutation
seeded by the seed and the epoch, and each shard has its own buffer of ``ceil(shuffle_buffer / n)``
examples seeded by the seed, the epoch and the shard: neither depends on the world size.

Resume: ``state_dict`` records the epoch and the examples consumed (read by shards: the slots of the
canonical order); a new pass re-reads the epoch's stream and skips them, so a resume is exact (a
``datasets`` state_dict is not used: it belongs to one reader process and drops the shuffle buffer on
resume). Either state resumes at any world size that reads the same way.

``len()``: the number of this rank's batches per epoch when the dataset has ``__len__`` and the
stream is read whole; otherwise a ``TypeError`` (tqdm then shows counts without a total).
"""
from __future__ import annotations

import collections
import hashlib
import itertools
import random
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, Deque, Dict, Iterator, List, Optional, Tuple

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..errors import UnifiedDistError, warn_once
from .loaders import BatchInfo, Epochs, LoaderStack, shard, worker_options

EXCHANGE_STEPS = 8
"""Split mode: steps whose per-rank counts one ``all_gather`` exchanges (more when accumulating); whole stream:
steps between two comparisons of the global batches' fingerprints. Each rank holds that many of its batches
read ahead (plus the accumulation's lookahead): more steps per exchange would cost memory for large batches."""

SPLIT_CHOICES = ("auto", True, False)


# ---------------------------------------------------------------------- the user's options
class Stream(IterableDataset):
    """A dataset with streaming options for ``ud.prepare`` (made by :func:`stream`).

    Iterated directly (outside ``prepare``) it yields the dataset's examples, buffer-shuffled with
    :attr:`seed` + :attr:`epoch` when ``shuffle_buffer > 0``.
    """

    def __init__(self, dataset: Any, shuffle_buffer: int = 0, split: Any = "auto") -> None:
        if isinstance(dataset, Stream):
            dataset = dataset.dataset
        if not _iterable(dataset):
            raise UnifiedDistError(f"ud.stream() expects an iterable dataset, got {type(dataset).__name__}")
        if isinstance(shuffle_buffer, bool) or not isinstance(shuffle_buffer, int) or shuffle_buffer < 0:
            raise UnifiedDistError(
                f"ud.stream(shuffle_buffer={shuffle_buffer!r}): give a number of examples >= 0 (0: no shuffling)")
        if split not in SPLIT_CHOICES or isinstance(split, int) and not isinstance(split, bool):
            raise UnifiedDistError(f"ud.stream(split={split!r}): give 'auto', True or False")
        if split is True and not _splittable(dataset):
            raise UnifiedDistError(
                f"ud.stream(split=True) got a {type(dataset).__name__} that cannot split itself: it needs n_shards "
                "and shard(num_shards, index) (a datasets.IterableDataset has both); use split='auto'")
        self.dataset = dataset
        self.shuffle_buffer = shuffle_buffer
        self.split = split
        self.seed = 0
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        return iter(_ordered(self.dataset, self.shuffle_buffer, self.seed, self.epoch))


def stream(dataset: Any, *, shuffle_buffer: int = 0, split: Any = "auto") -> Stream:
    """``dataset`` (any ``IterableDataset``) with streaming options for ``ud.prepare``.

    ``shuffle_buffer``: examples held in a shuffle buffer (0: the stream's order); the buffer is seeded
    by ``ud.seed_everything``'s seed + the epoch, the same on every rank. ``split``: ``"auto"`` reads only
    this rank's shards when the dataset can split itself into a multiple of the data-parallel world
    size; ``False`` always reads the whole stream on every rank (one process's order at any world size,
    resumable at any world size); ``True`` requires splitting.
    """
    return Stream(dataset, shuffle_buffer=shuffle_buffer, split=split)


def _iterable(dataset: Any) -> bool:
    return isinstance(dataset, IterableDataset) or (
        hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__"))


def _hf_iterable(dataset: Any) -> bool:
    datasets = sys.modules.get("datasets")
    return datasets is not None and isinstance(dataset, datasets.IterableDataset)


def _splittable(dataset: Any) -> bool:
    return isinstance(getattr(dataset, "n_shards", None), int) and callable(getattr(dataset, "shard", None))


def refuse_split_by_node(dataset: Any) -> None:
    """Refuse a ``datasets`` stream that ``split_dataset_by_node`` already split: prepare() would split it
    again, and each rank would silently read only a part of its part."""
    node = getattr(dataset, "_distributed", None) if _hf_iterable(dataset) else None
    if node is not None:
        raise UnifiedDistError(
            f"prepare() got a datasets stream already split by split_dataset_by_node (rank {node.rank} of "
            f"{node.world_size}), which prepare() would split again, losing data; drop the split_dataset_by_node "
            "call and pass the whole stream: prepare() gives each rank its part")


def choose_split(dataset: Any, split: Any, world_size: int) -> bool:
    """Whether a pass reads the dataset by shards in their canonical order, each rank only its own (see the
    module docstring); ``split="auto"`` says in one warning when a sharded dataset cannot."""
    if split is False or not _splittable(dataset):
        return False
    if dataset.n_shards == 1 and split is not True:
        return False  # one shard: its canonical order is the whole stream's, read whole at every world size
    if dataset.n_shards % world_size == 0:
        return True
    if split is True:
        raise UnifiedDistError(
            f"ud.stream(split=True): the dataset has {dataset.n_shards} shards, which {world_size} data-parallel ranks "
            "cannot share evenly; use a number of ranks that divides it, reshard the data, or split='auto'")
    if dataset.n_shards > 1:
        warn_once(f"the stream's {dataset.n_shards} shards do not split evenly over {world_size} data-parallel ranks: "
                  "every rank reads the whole stream, in the dataset's own order (not the shard-interleaved order "
                  "of a world size that divides the shards); use such a world size or reshard the data")
    return False


# ---------------------------------------------------------------------- the examples' order
def _buffer_shuffled(examples: Iterator[Any], size: int, rng: random.Random) -> Iterator[Any]:
    buffer: List[Any] = []
    for example in examples:
        if len(buffer) < size:
            buffer.append(example)
            continue
        i = rng.randrange(size)
        yield buffer[i]
        buffer[i] = example
    rng.shuffle(buffer)
    yield from buffer


def _ordered(dataset: Any, shuffle_buffer: int, seed: int, epoch: int) -> Iterator[Any]:
    """The examples of one epoch, in the order every rank reading this dataset sees."""
    if shuffle_buffer and _hf_iterable(dataset):
        dataset = dataset.shuffle(seed=seed, buffer_size=shuffle_buffer)
    if hasattr(dataset, "set_epoch"):
        dataset.set_epoch(epoch)
    if shuffle_buffer and not _hf_iterable(dataset):
        return _buffer_shuffled(iter(dataset), shuffle_buffer, random.Random(seed * 1_000_003 + epoch))
    return iter(dataset)


def canonical_slot(p: int, n_shards: int) -> Tuple[int, int]:
    """Slot ``p`` of an epoch read by shards: (the shard's place in the epoch's shard order, the example's
    index in that shard). Shards interleave one example at a time; the world size plays no part."""
    return p % n_shards, p // n_shards


def _shard_order(n_shards: int, shuffled: bool, seed: int, epoch: int) -> List[int]:
    """The dataset's shard indices in the epoch's order: as numbered, or permuted by ``seed`` and ``epoch``."""
    order = list(range(n_shards))
    if shuffled:
        random.Random(f"shards/{seed}/{epoch}").shuffle(order)
    return order


def _shard_examples(dataset: Any, index: int, shuffle_buffer: int, seed: int, epoch: int) -> Iterator[Any]:
    """Shard ``index`` of ``dataset`` alone, with its own seeded share of the shuffle buffer."""
    n = dataset.n_shards
    part = dataset.shard(num_shards=n, index=index)
    if hasattr(part, "set_epoch"):
        part.set_epoch(epoch)
    examples = iter(part)
    if shuffle_buffer:
        examples = _buffer_shuffled(examples, -(-shuffle_buffer // n), random.Random(f"{seed}/{epoch}/{index}"))
    return examples


def fingerprint(example: Any) -> int:
    """A 63-bit digest of ``example``'s content (tensors, arrays, numbers, strings and containers of them),
    equal on every rank for equal content; objects of other types count by their type name only."""
    digest = hashlib.blake2b(digest_size=8)
    _feed(digest, example)
    return struct.unpack("<q", digest.digest())[0] & (2**63 - 1)


def _feed(digest: Any, x: Any) -> None:
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        digest.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    elif isinstance(x, (str, bytes, int, float, bool, type(None))):
        digest.update(repr(x).encode())
    elif isinstance(x, dict) or hasattr(x, "keys") and hasattr(x, "__getitem__"):
        for key in sorted(x.keys(), key=repr):
            digest.update(repr(key).encode())
            _feed(digest, x[key])
    elif isinstance(x, (list, tuple)):
        digest.update(f"L{len(x)}".encode())
        for item in x:
            _feed(digest, item)
    elif hasattr(x, "tobytes"):
        digest.update(x.tobytes())
    else:
        digest.update(type(x).__name__.encode())


# ---------------------------------------------------------------------- what runs in the workers
@dataclass
class _Pass:
    """What one pass of the reader needs (set before the DataLoader's iterator is made)."""

    epoch: int = 0
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    split: bool = False
    skip: int = 0  # whole stream: global examples; by shards: slots of the canonical order


_END = object()


def _identity(x: Any) -> Any:
    return x


def _one_process() -> Tuple[int, int]:
    """(worker id, workers) of this DataLoader worker; the dataset below is then told it is alone, so it
    yields its whole stream and this reader splits it between workers itself."""
    from torch.utils.data._utils import worker

    info = worker._worker_info
    if info is None:
        return 0, 1
    worker._worker_info = None  # this process only reads for this reader: let the dataset see one process
    return info.id, info.num_workers


class _Reader(IterableDataset):
    """Yields ``(batch, meta)`` for this rank: collated batches and what the loader needs to know."""

    def __init__(self, dataset: Any, shuffle_buffer: int, collate_fn: Callable, batch_size: int,
                 drop_last: bool) -> None:
        self.dataset = dataset
        self.shuffle_buffer = shuffle_buffer
        self.collate_fn = collate_fn
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.plan = _Pass()

    def _examples(self) -> Tuple[Any, Iterator[Any]]:
        """The pass's first example (before the resume's skip; :data:`_END` for an empty stream), and the
        examples from the resume point on."""
        plan = self.plan
        examples = _ordered(self.dataset, self.shuffle_buffer, plan.seed, plan.epoch)
        examples = iter(examples)
        first = next(examples, _END)
        if first is not _END:
            examples = itertools.chain([first], examples)
        return first, itertools.islice(examples, plan.skip, None)

    def __iter__(self) -> Iterator[Tuple[Any, Dict[str, Any]]]:
        worker, workers = _one_process()
        return self._shards(worker, workers) if self.plan.split else self._whole(worker, workers)

    def _whole(self, worker: int, workers: int) -> Iterator[Tuple[Any, Dict[str, Any]]]:
        plan, size = self.plan, self.batch_size * self.plan.world_size
        _, examples = self._examples()
        current = list(itertools.islice(examples, size))
        i = 0
        while current and not (self.drop_last and len(current) < size):
            following = list(itertools.islice(examples, size))
            if i % workers == worker:
                m = len(current)
                count, offset = shard(m, plan.world_size, plan.rank)
                mine = current[offset:offset + count] if count else current[:1]
                meta = {"index": i, "real": m, "mine": count,
                        "last": not following or (self.drop_last and len(following) < size),
                        "fingerprint": fingerprint(current)}
                yield self.collate_fn(mine), meta
            current, i = following, i + 1

    def _open_shards(self) -> Tuple[Dict[int, Iterator[Any]], Dict[int, Any], Any]:
        """This rank's shards (by their place in the epoch's shard order), resumed past the plan's slots: each
        one's iterator, its next example (:data:`_END` when used up), and the padding row (the first example of
        the rank's first non-empty shard, taken before the resume's skip; ``None`` when its shards are empty)."""
        plan, n = self.plan, self.dataset.n_shards
        order = _shard_order(n, bool(self.shuffle_buffer), plan.seed, plan.epoch)
        iterators, heads, padding = {}, {}, None
        for place in range(plan.rank, n, plan.world_size):
            examples = _shard_examples(self.dataset, order[place], self.shuffle_buffer, plan.seed, plan.epoch)
            first = next(examples, _END)
            if first is not _END:
                padding = self.collate_fn([first]) if padding is None else padding
                examples = itertools.chain([first], examples)
            skip = plan.skip // n + (1 if place < plan.skip % n else 0)  # this shard's slots before plan.skip
            iterators[place] = itertools.islice(examples, skip, None)
            heads[place] = next(iterators[place], _END)
        return iterators, heads, padding

    def _shards(self, worker: int, workers: int) -> Iterator[Tuple[Any, Dict[str, Any]]]:
        """One item per step while this rank's shards have examples left: its examples in its slots of the step
        (``None`` and ``mine=0`` when they are all empty). A rank owns the slots ``p = rank (mod world)``."""
        plan = self.plan
        iterators, heads, padding = self._open_shards()
        slot = plan.skip + (plan.rank - plan.skip) % plan.world_size  # this rank's first slot from plan.skip on
        yielded = False
        for i in itertools.count():
            if all(head is _END for head in heads.values()):
                break
            batch = []
            for _ in range(self.batch_size):
                place, _index = canonical_slot(slot, self.dataset.n_shards)
                slot += plan.world_size
                if heads[place] is not _END:
                    batch.append(heads[place])
                    heads[place] = next(iterators[place], _END)
            if i % workers == worker:
                yield (self.collate_fn(batch) if batch else None), {
                    "index": i, "mine": len(batch), "padding": None if yielded else padding}
                yielded = True
        if not yielded:  # no step from this worker: it still hands over the padding (after every real step)
            yield None, {"index": None, "mine": 0, "padding": padding}


# ---------------------------------------------------------------------- the prepared loader
class PreparedStreamLoader(Epochs):
    """A ``DataLoader`` over an ``IterableDataset``, sharded across the data-parallel ranks (see the
    module docstring). Iterating it again starts the next epoch; batches arrive on the backend's device;
    ``state_dict``/``load_state_dict`` resume mid-epoch."""

    def __init__(self, loader: DataLoader, topology: Callable[[], Tuple[int, int]], device: torch.device,
                 seed: int, stack: LoaderStack, gather_ints: Callable[[List[int]], List[List[int]]],
                 lookahead: int) -> None:
        if loader.batch_size is None:
            raise UnifiedDistError(
                "prepare() needs a DataLoader built with batch_size=...; a stream batched by the dataset itself "
                "cannot be cut into global batches (yield single examples and give the DataLoader a batch_size)")
        options = loader.dataset if isinstance(loader.dataset, Stream) else Stream(loader.dataset)
        refuse_split_by_node(options.dataset)
        self.dataset = options.dataset
        self.options = options
        self.batch_size = loader.batch_size
        self.drop_last = loader.drop_last
        self.seed = seed
        self.device = device
        self._stack = stack
        self._topology = topology
        self._gather_ints = gather_ints
        self._lookahead = max(1, lookahead)
        self._reader = _Reader(self.dataset, options.shuffle_buffer, loader.collate_fn, loader.batch_size,
                               loader.drop_last)
        # the reader's pass (epoch, skip) travels to the workers when they start: at every pass
        self._loader = DataLoader(self._reader, batch_size=None, collate_fn=_identity, **worker_options(loader, seed))
        self._next_epoch = 0
        self._epoch = 0
        self._in_pass = False
        self._resume: Optional[Dict[str, Any]] = None
        self._state: Dict[str, Any] = {}
        self.batch_info: Optional[BatchInfo] = None
        self._window: List[int] = []

    def __len__(self) -> int:
        """This rank's batches per epoch, when the dataset has a length and the stream is read whole."""
        rank, world = self._topology()
        try:
            n = len(self.dataset)
        except TypeError:
            raise TypeError("this prepared stream's length is unknown (its dataset has no __len__): count steps "
                            "as they come, or give a scheduler its step count yourself") from None
        if choose_split(self.dataset, self.options.split, world):
            raise TypeError("a stream split by shards has no fixed number of steps per rank until it is read")
        size = self.batch_size * world
        return n // size if self.drop_last else -(-n // size)

    def window_samples(self, micro_batches: int) -> int:
        """Real samples in the current batch and the next ``micro_batches - 1`` of this epoch."""
        return sum(self._window[:micro_batches])

    # ------------------------------------------------------------------ a pass
    def __iter__(self) -> Iterator[Any]:
        rank, world = self._topology()
        split = choose_split(self.dataset, self.options.split, world)
        resume = self._begin_pass()
        plan = _Pass(epoch=self._epoch, seed=self.seed, rank=rank, world_size=world, split=split)
        if split:
            plan.skip = self._resumed_shards(resume)
            samples = resume.get("samples") if plan.skip else 0  # None: a state saved before examples were counted
            self._state = {"mode": "shards", "n_shards": self.dataset.n_shards, "slots": plan.skip, "samples": samples}
        else:
            plan.skip = self._resumed_whole(resume)
            self._state = {"mode": "whole", "consumed": plan.skip}
        self._reader.plan = plan
        yield from self._pass(self._shards_pass(rank, world) if split else self._whole_pass(rank, world))

    def _whole_pass(self, rank: int, world: int) -> Iterator[Any]:
        source = iter(self._loader)
        ahead: Deque[Tuple[Any, Dict[str, Any]]] = collections.deque()
        span = EXCHANGE_STEPS + self._lookahead  # what a rank decides the next EXCHANGE_STEPS steps by
        ends = False  # the last comparison saw where the stream ends

        def fill(n: int) -> None:
            while len(ahead) < n:
                item = next(source, None)
                if item is None:
                    return
                ahead.append(item)

        for s in itertools.count():
            if s % EXCHANGE_STEPS == 0 and not ends:
                fill(span)
                ends = len(ahead) < span
                if world > 1:  # every rank must read the same stream: compare the next global batches
                    self._compare(s, span, [meta["fingerprint"] for _, meta in ahead])
            if not ahead:
                return
            batch, meta = ahead.popleft()
            fill(self._lookahead)
            m = meta["real"]
            counts = [shard(m, world, r)[0] for r in range(world)]
            self._window = [m] + [later["real"] for _, later in ahead]
            self.batch_info = BatchInfo(real=m, padded=max(m, world), is_last=meta["last"], mine=meta["mine"],
                                        counts=counts)
            self._state["consumed"] += m
            yield batch

    def _compare(self, s: int, span: int, prints: List[int]) -> None:
        """Refuse, on every rank at once, a stream whose global batches ``s .. s+span-1`` differ between ranks
        (``prints``: this rank's fingerprints of those it has; fewer than ``span`` where its stream ends)."""
        table = self._gather_ints([len(prints), fingerprint(prints)])
        if len({tuple(row) for row in table}) == 1:
            return
        held = [row[0] for row in table]
        where = (f"it ends after {s + min(held)} global batches on rank {held.index(min(held))} and goes on on rank "
                 f"{held.index(max(held))}" if len(set(held)) > 1 else
                 f"global batches {s}-{s + span - 1} have fingerprints {[row[1] for row in table]}")
        raise UnifiedDistError(
            f"the stream differs between ranks ({where}): prepare() reads the whole stream on every rank and keeps "
            "each rank's slice, so the dataset must yield the same examples in the same order on every rank; don't "
            "shard or filter it by rank yourself, seed its randomness alike on every rank (or use "
            "ud.stream(..., shuffle_buffer=N))")

    def _exchanged_steps(self, source: Iterator[Any], mine: Deque[Any], reading: Dict[str, Any]) -> List[List[int]]:
        """The next steps' values of every rank (one ``all_gather``): 0 once a rank's shards are used up, else 1 +
        its examples in the step; this rank's batches go to ``mine``. ``reading["padded"]``: which ranks have a
        padding row (an example somewhere in their shards)."""
        chunk = max(EXCHANGE_STEPS, self._lookahead + 1)
        values = []
        for _ in range(chunk):
            item = None
            for batch, meta in ([] if reading["done"] else source):
                if meta["padding"] is not None and reading["padding"] is None:
                    reading["padding"] = meta["padding"]
                if meta["index"] is not None:
                    item = (batch, meta)
                    break
            if item is None:
                reading["done"] = True
                values.append(0)
                continue
            if item[1]["mine"]:
                mine.append(item[0])
            values.append(1 + item[1]["mine"])
        table = self._gather_ints(values + [int(reading["padding"] is not None)])  # [rank][step], then padded
        reading["padded"] = [row[-1] for row in table]
        return [[table[r][j] for r in range(len(table))] for j in range(chunk)]

    def _shards_pass(self, rank: int, world: int) -> Iterator[Any]:
        source = iter(self._loader)
        mine: Deque[Any] = collections.deque()
        steps: List[List[int]] = []  # per known step: each rank's value (see _exchanged_steps)
        reading: Dict[str, Any] = {"done": False, "padding": None, "padded": [1] * world}
        size = self.batch_size * world
        s = 0
        while True:
            while len(steps) < s + self._lookahead + 1 and (not steps or any(steps[-1])):
                steps.extend(self._exchanged_steps(source, mine, reading))
            if not any(steps[s]):
                return
            counts = [max(v - 1, 0) for v in steps[s]]
            m = sum(counts)
            s += 1
            if self.drop_last and m < size:
                return
            self._state["slots"] += size
            if self._state["samples"] is not None:
                self._state["samples"] += m
            if m == 0:  # every slot of the step is empty, at every world size: no step
                continue
            self._refuse_unpadded(counts, reading["padded"], world)
            following = [max(v - 1, 0) for v in steps[s]] if s < len(steps) else [0]
            last = not any(steps[s]) if s < len(steps) else True
            last = last or (self.drop_last and sum(following) < size)
            self._window = [sum(max(v - 1, 0) for v in later) for later in steps[s - 1:s + self._lookahead]]
            self._window = [w for w in self._window if w] or [m]
            self.batch_info = BatchInfo(real=m, padded=sum(max(c, 1) for c in counts), is_last=last,
                                        mine=counts[rank], counts=counts)
            yield mine.popleft() if counts[rank] else reading["padding"]

    def _refuse_unpadded(self, counts: List[int], padded: List[int], world: int) -> None:
        empty = [r for r, (c, p) in enumerate(zip(counts, padded)) if not c and not p]
        if empty:  # every rank holds the same table: every rank refuses at this step
            raise UnifiedDistError(
                f"rank {', '.join(map(str, empty))} got no examples from its shards of the stream while others "
                f"did ({self.dataset.n_shards} shards over {world} ranks): reshard the data into more, even "
                "shards, or read it whole with ud.stream(dataset, split=False)")

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> Dict[str, Any]:
        """Where the stream stands, in the map-style loader's shape: ``epoch``, ``seed`` and
        ``samples_consumed`` (the examples consumed in the epoch, over all ranks; ``None`` after resuming a
        by-shards state saved before unified_dist counted them), plus ``stream``, the position this
        loader resumes from (read by shards: the slots of the canonical order, and the examples)."""
        counted, epoch, resume = self._position()
        if counted:
            epoch, stream = self._epoch, dict(self._state)
        elif resume is not None:
            stream = dict(resume)
        else:
            stream = {"mode": "whole", "consumed": 0}
        total = stream.get("samples") if stream.get("mode") == "shards" else stream.get("consumed", 0)
        return {"epoch": epoch, "seed": self.seed, "samples_consumed": total, "stream": stream}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Make the next iteration continue where ``state`` was taken."""
        if "stream" not in state:
            raise UnifiedDistError(
                "this loader state was saved by a map-style loader; a prepared stream resumes only from a stream "
                "loader's state_dict()")
        self.seed = int(state.get("seed", self.seed))
        self._restart_at(int(state["epoch"]), dict(state["stream"]))

    def _resumed_whole(self, resume: Optional[Dict[str, Any]]) -> int:
        if resume is None or _fresh(resume):
            return 0
        if resume.get("mode") != "whole":
            raise UnifiedDistError(
                f"the loader state was saved while the ranks read the stream's {resume.get('n_shards')} shards in "
                "their canonical order, and this job reads it whole (its world size does not divide the shards): "
                "resume with a world size that divides them, or save with ud.stream(dataset, split=False)")
        return int(resume["consumed"])

    def _resumed_shards(self, resume: Optional[Dict[str, Any]]) -> int:
        """The slots of the canonical order a saved state consumed (any world size dividing the shards)."""
        n = self.dataset.n_shards
        if resume is None or _fresh(resume):
            return 0
        if resume.get("mode") != "shards" or int(resume["n_shards"]) != n:
            saved = f"a stream of {resume['n_shards']} shards" if resume.get("mode") == "shards" \
                else "the stream read whole" if resume.get("mode") == "whole" else "an older split state"
            raise UnifiedDistError(
                f"the loader state was saved with {saved}, and this job reads the {n} shards in their canonical "
                "order: resume with the same data and split setting as the save (ud.stream(dataset, split=False) "
                "reads whole at any world size)")
        return int(resume["slots"])


def _fresh(state: Dict[str, Any]) -> bool:
    """A state that consumed nothing this epoch (an epoch's end, or an unused loader): resumes in any mode."""
    return not state.get("consumed") and not state.get("slots")
