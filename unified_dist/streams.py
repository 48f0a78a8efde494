"""Sharded loading of streams (``IterableDataset``) with the promise of map-style loaders.

A prepared stream loader cuts the stream into *global batches* of ``B = batch_size x (data-parallel
world size)`` and gives rank ``r`` the ``r``-th slice of each, exactly as :mod:`unified_dist.data` does
for map-style datasets: step ``s`` of N ranks is one process's step ``s``, each example comes once per
epoch, a ragged last global batch is split as evenly as it goes (``ud.backward`` weights it exactly;
ranks without a sample get one padding row weighted 0, dropped by ``gather_for_metrics``), and every
rank ends the epoch at the same step, whatever the stream's length.

Two ways to read, chosen per pass (see :func:`choose_split`):

* **whole stream** (the default): every data-parallel rank reads the whole stream and keeps its
  slice. Every rank then knows every global batch's size and where the stream ends without
  communicating, the order is one process's at any world size, and a resume works at any world
  size. The price: each rank reads (and the dataset decodes) the whole stream. The stream must be
  the same on every rank: every :data:`EXCHANGE_STEPS` steps the fingerprints of the next
  ``EXCHANGE_STEPS`` + lookahead global batches are compared across ranks (one tiny ``all_gather``)
  before any of them is taken, so a stream that differs, late or by ending earlier on one rank, is
  refused on every rank at the same step. A ``datasets`` stream already split by
  ``split_dataset_by_node`` is refused (it would be split again).
* **split**: when the dataset splits itself -- a ``datasets.IterableDataset`` whose ``n_shards`` is a
  multiple of the data-parallel world size (``datasets.distributed.split_dataset_by_node``), or any
  dataset with ``n_shards`` and ``shard(num_shards, index)`` -- rank ``r`` reads only its shards. Step
  ``s`` then holds rank 0's ``s``-th local batch, then rank 1's, ...: the order depends on the world
  size. The ranks exchange how many examples each holds for the next steps in one ``all_gather``
  every :data:`EXCHANGE_STEPS` steps; the epoch ends when every rank's shards are used up, and a
  rank whose shards ran out earlier gets padding rows (weight 0) until then.

``num_workers > 0``: each worker reads the rank's stream as one process would (a dataset's own
``get_worker_info`` splitting is bypassed) and keeps every ``num_workers``-th batch; the loader
takes the workers' batches in turn, so the order does not depend on ``num_workers`` and nothing is
duplicated.

Shuffling: :func:`stream` wraps a dataset with a shuffle buffer seeded by ``seed_everything``'s
seed + epoch (``datasets``' own ``shuffle(seed, buffer_size)`` for a ``datasets.IterableDataset``, which
also shuffles its shards), the same on every rank.

Resume: ``state_dict`` records the epoch and the examples consumed (in split mode, per rank); a new
pass re-reads the epoch's stream and skips them, so a resume is exact (a ``datasets`` state_dict is
not used: it belongs to one reader process and drops the shuffle buffer on resume). The whole-stream
state resumes at any world size; a split state only at the world size that wrote it.

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

from .data import BatchInfo, Epochs, LoaderStack, shard, worker_options
from .errors import UnifiedDistError

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
    """Whether a pass reads only this rank's shards (see the module docstring)."""
    if split is False or not _splittable(dataset) or world_size == 1:
        return False  # one process reads every shard: the whole stream
    if dataset.n_shards % world_size == 0:
        return True
    if split is True:
        raise UnifiedDistError(
            f"ud.stream(split=True): the dataset has {dataset.n_shards} shards, which {world_size} data-parallel ranks "
            "cannot share evenly; use a number of ranks that divides it, reshard the data, or split='auto'")
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
    skip: int = 0  # whole stream: global examples; split: this rank's examples


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
        plan, dataset = self.plan, self.dataset
        if plan.split:
            if _hf_iterable(dataset):
                from datasets.distributed import split_dataset_by_node

                if self.shuffle_buffer:  # shuffle first, with one seed: every rank drops the same shard order
                    dataset = dataset.shuffle(seed=plan.seed, buffer_size=self.shuffle_buffer)
                dataset = split_dataset_by_node(dataset, plan.rank, plan.world_size)
                examples = _ordered(dataset, 0, plan.seed, plan.epoch)
            else:
                examples = _ordered(dataset.shard(num_shards=plan.world_size, index=plan.rank),
                                    self.shuffle_buffer, plan.seed, plan.epoch)
        else:
            examples = _ordered(dataset, self.shuffle_buffer, plan.seed, plan.epoch)
        examples = iter(examples)
        first = next(examples, _END)
        if first is not _END:
            examples = itertools.chain([first], examples)
        return first, itertools.islice(examples, plan.skip, None)

    def __iter__(self) -> Iterator[Tuple[Any, Dict[str, Any]]]:
        worker, workers = _one_process()
        return self._split(worker, workers) if self.plan.split else self._whole(worker, workers)

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

    def _split(self, worker: int, workers: int) -> Iterator[Tuple[Any, Dict[str, Any]]]:
        # a rank whose shards run out gives padding rows until the others' end: its shards' first example,
        # taken before a resume's skip (a rank resumed after its shards ran out reads nothing else)
        first, examples = self._examples()
        padding = None if first is _END else self.collate_fn([first])
        yielded = False
        for i in itertools.count():
            batch = list(itertools.islice(examples, self.batch_size))
            if not batch:
                break
            if i % workers == worker:
                yield self.collate_fn(batch), {"index": i, "mine": len(batch), "padding": None if yielded else padding}
                yielded = True
        if not yielded:  # no batch from this worker: it still hands over the padding (after every real batch)
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
            consumed = self._resumed_split(resume, world)
            plan.skip = consumed[rank]
            self._state = {"mode": "split", "world_size": world, "consumed": consumed}
        else:
            plan.skip = self._resumed_whole(resume)
            self._state = {"mode": "whole", "consumed": plan.skip}
        self._reader.plan = plan
        yield from self._pass(self._split_pass(rank, world) if split else self._whole_pass(rank, world))

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

    def _split_pass(self, rank: int, world: int) -> Iterator[Any]:
        source = iter(self._loader)
        mine: Deque[Any] = collections.deque()
        steps: List[List[int]] = []  # per known step: each rank's real examples
        padding: Optional[Any] = None
        ever = [done > 0 for done in self._state["consumed"]]  # which ranks have had an example in this epoch
        exhausted = False

        def next_batch() -> Optional[Tuple[Any, Dict[str, Any]]]:
            nonlocal padding
            for batch, meta in source:
                if meta["padding"] is not None and padding is None:
                    padding = meta["padding"]
                if meta["index"] is not None:
                    return batch, meta
            return None

        chunk = max(EXCHANGE_STEPS, self._lookahead + 1)
        s = 0
        while True:
            if len(steps) < s + self._lookahead + 1 and (not steps or any(steps[-1])):
                counts = []
                for _ in range(chunk):
                    item = None if exhausted else next_batch()
                    if item is None:
                        exhausted = True
                        counts.append(0)
                        continue
                    batch, meta = item
                    mine.append(batch)
                    counts.append(meta["mine"])
                table = self._gather_ints(counts)  # [rank][step]
                steps.extend([table[r][j] for r in range(world)] for j in range(chunk))
            counts = steps[s]
            m = sum(counts)
            if m == 0 or (self.drop_last and m < self.batch_size * world):
                return
            ever = [e or c > 0 for e, c in zip(ever, counts)]
            if not all(ever):
                empty = [r for r, e in enumerate(ever) if not e]
                raise UnifiedDistError(
                    f"rank {', '.join(map(str, empty))} got no examples from its shards of the stream while others "
                    f"did ({self.dataset.n_shards} shards over {world} ranks): reshard the data into more, even "
                    "shards, or read it whole with ud.stream(dataset, split=False)")
            following = steps[s + 1] if s + 1 < len(steps) else [0]
            last = sum(following) == 0 or (self.drop_last and sum(following) < self.batch_size * world)
            self._window = [sum(c) for c in steps[s:s + self._lookahead + 1]]
            self.batch_info = BatchInfo(real=m, padded=sum(max(c, 1) for c in counts), is_last=last,
                                        mine=counts[rank], counts=counts)
            self._state["consumed"] = [done + c for done, c in zip(self._state["consumed"], counts)]
            s += 1
            yield mine.popleft() if counts[rank] else padding

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> Dict[str, Any]:
        """Where the stream stands: the epoch and the examples consumed in it (per rank when split)."""
        counted, epoch, resume = self._position()
        if counted:
            return {"epoch": self._epoch, "seed": self.seed, "stream": dict(self._state)}
        if resume is not None:
            return {"epoch": epoch, "seed": self.seed, "stream": dict(resume)}
        return {"epoch": epoch, "seed": self.seed, "stream": {"mode": "whole", "consumed": 0}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Make the next iteration continue where ``state`` was taken."""
        if "stream" not in state:
            raise UnifiedDistError(
                "this loader state was saved by a map-style loader; a prepared stream resumes only from a stream "
                "loader's state_dict()")
        self.seed = int(state.get("seed", self.seed))
        self._restart_at(int(state["epoch"]), dict(state["stream"]))

    def _resumed_whole(self, resume: Optional[Dict[str, Any]]) -> int:
        if resume is None:
            return 0
        if resume.get("mode") != "whole":
            raise UnifiedDistError(
                f"the loader state was saved while {resume.get('world_size')} ranks read their own shards of the "
                "stream, and this job reads it whole; resume with that many ranks, or save with "
                "ud.stream(dataset, split=False) to resume at any world size")
        return int(resume["consumed"])

    def _resumed_split(self, resume: Optional[Dict[str, Any]], world: int) -> List[int]:
        if resume is None:
            return [0] * world
        if resume.get("mode") != "split" or int(resume["world_size"]) != world:
            saved = f"{resume['world_size']} ranks reading their own shards" if resume.get("mode") == "split" \
                else "the stream read whole"
            raise UnifiedDistError(
                f"the loader state was saved with {saved}, and this job's {world} ranks read their own shards: a "
                "split stream resumes only at the world size that saved it; resume with that many ranks, or use "
                "ud.stream(dataset, split=False) (every rank reads the whole stream) to resume at any world size")
        return [int(c) for c in resume["consumed"]]
