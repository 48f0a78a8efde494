"""Prepared streams (unified_dist/data/streams.py) in one process: each data-parallel rank is a thread with its
own loader, the ranks exchange counts through a barrier, as ``Session._gather_ints`` does over a real group.
Expected values are plain Python arithmetic over the rows. tests/launchers/test_streams_under_launchers.py checks
the same promises inside real launchers."""
from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

import unified_dist as ud
from unified_dist.data.loaders import LoaderStack
from unified_dist.data.streams import EXCHANGE_STEPS, PreparedStreamLoader, _Reader, choose_split, fingerprint


class Rows(IterableDataset):
    """Rows ``0..n-1`` (or the given list), one example per row."""

    def __init__(self, rows):
        self.rows = list(range(rows)) if isinstance(rows, int) else list(rows)

    def __iter__(self):
        return iter(self.rows)


class SizedRows(Rows):
    def __len__(self):
        return len(self.rows)


class Shards(IterableDataset):
    """A dataset that splits itself: ``n_shards`` lists, read one after the other."""

    def __init__(self, parts):
        self.parts = [list(p) for p in parts]

    @property
    def n_shards(self):
        return len(self.parts)

    def shard(self, num_shards, index):
        return Shards(self.parts[index::num_shards])

    def __iter__(self):
        for part in self.parts:
            yield from part


class Exchange:
    """``gather_ints`` for ``world`` threads: every thread's list, in rank order."""

    def __init__(self, world: int):
        self.world = world
        self.values: Dict[int, List[int]] = {}
        self.barrier = threading.Barrier(world)
        self.calls = 0

    def for_rank(self, rank: int) -> Callable[[List[int]], List[List[int]]]:
        def gather(values):
            self.values[rank] = list(values)
            self.barrier.wait(timeout=30)
            out = [self.values[r] for r in range(self.world)]
            if rank == 0:
                self.calls += 1
            self.barrier.wait(timeout=30)
            return out
        return gather


def loader_for(dataset, rank, world, exchange, batch_size=4, seed=0, lookahead=1, **kwargs) -> PreparedStreamLoader:
    return PreparedStreamLoader(DataLoader(dataset, batch_size=batch_size, **kwargs), lambda: (rank, world),
                                torch.device("cpu"), seed, LoaderStack(), exchange.for_rank(rank), lookahead)


def run_ranks(world: int, body: Callable[[int, Exchange], Any]) -> List[Any]:
    """``body(rank, exchange)`` on ``world`` threads; their results (or exceptions) in rank order."""
    exchange = Exchange(world)
    results: List[Any] = [None] * world

    def target(rank):
        try:
            results[rank] = body(rank, exchange)
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            results[rank] = exc  # (no barrier.abort(): it could break a peer still leaving the last wait)

    threads = [threading.Thread(target=target, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def epoch_of(loader, limit=None) -> List[dict]:
    """Each step's batch and what the loader said about it (an AssertionError past ``limit`` steps)."""
    steps = []
    for batch in loader:
        assert limit is None or len(steps) < limit, f"the epoch goes on past {limit} steps"
        info = loader.batch_info
        steps.append({"rows": batch.tolist(), "real": info.real, "mine": info.mine, "counts": info.counts,
                      "last": info.is_last, "kept": info.kept_rows(), "window": loader.window_samples(2)})
    return steps


def contiguous_slices(m, world):
    """The documented split of a global batch of m rows: the first m % world ranks take one more."""
    base, extra = divmod(m, world)
    sizes = [base + (r < extra) for r in range(world)]
    starts = [sum(sizes[:r]) for r in range(world)]
    return sizes, starts


# ---------------------------------------------------------------------- the whole stream on every rank
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("n", [0, 1, 2, 23, 24])
def test_whole_stream_gives_each_rank_its_slice_of_every_global_batch(world, n):
    per_rank = 4
    global_batch = per_rank * world
    epochs = run_ranks(world, lambda r, ex: epoch_of(loader_for(Rows(n), r, world, ex, batch_size=per_rank)))
    expected_steps = -(-n // global_batch)
    for r, steps in enumerate(epochs):
        assert not isinstance(steps, BaseException), steps
        assert len(steps) == expected_steps, (r, steps)  # every rank ends at the same step
        for s, step in enumerate(steps):
            batch = list(range(s * global_batch, min(n, (s + 1) * global_batch)))
            sizes, starts = contiguous_slices(len(batch), world)
            mine = batch[starts[r]:starts[r] + sizes[r]] or batch[:1]  # a rank without a row gets a padding row
            assert step["rows"] == mine
            assert (step["real"], step["mine"], step["counts"]) == (len(batch), sizes[r], sizes)
            assert step["last"] == (s == expected_steps - 1)
            following = min(n, (s + 2) * global_batch) - min(n, (s + 1) * global_batch)
            assert step["window"] == len(batch) + following
            if len(batch) < world:
                assert step["kept"] == list(range(len(batch)))  # the padding rows sit at the end


def test_whole_stream_drop_last_ends_before_the_ragged_batch():
    epochs = run_ranks(2, lambda r, ex: epoch_of(loader_for(Rows(21), r, 2, ex, batch_size=4, drop_last=True)))
    assert [s["rows"] for s in epochs[0]] == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert [s["rows"] for s in epochs[1]] == [[4, 5, 6, 7], [12, 13, 14, 15]]
    assert [s["last"] for s in epochs[0]] == [False, True]


def test_a_stream_that_differs_between_ranks_is_refused_on_every_rank():
    def body(rank, ex):
        return epoch_of(loader_for(Rows(range(rank, 40, 2)), rank, 2, ex))  # sharded by rank by hand

    results = run_ranks(2, body)
    for exc in results:
        assert isinstance(exc, ud.UnifiedDistError) and "the stream differs between ranks" in str(exc), exc


def test_an_empty_stream_on_one_rank_only_is_refused_on_both():
    results = run_ranks(2, lambda r, ex: epoch_of(loader_for(Rows(0 if r else 5), r, 2, ex)))
    assert all(isinstance(e, ud.UnifiedDistError) for e in results), results


def steps_until_refused(loader):
    """(batches this rank got, the error that ended the pass or None)."""
    got = []
    try:
        for batch in loader:
            got.append(batch.tolist())
    except ud.UnifiedDistError as exc:
        return len(got), str(exc)
    return len(got), None


def test_a_stream_that_diverges_late_is_refused_before_a_diverged_batch():
    """Issue 46: rank 1 drops row 90 (global batch 11 of 8 rows): the comparison of batches 8-16, made before
    step 8, refuses it on both ranks; nothing past step 7 was trained on."""
    rows = {0: list(range(100)), 1: [i for i in range(100) if i != 90]}
    results = run_ranks(2, lambda r, ex: steps_until_refused(loader_for(Rows(rows[r]), r, 2, ex)))
    for steps, error in results:
        assert steps == EXCHANGE_STEPS and error is not None and "\n" not in error, results
        assert error.startswith("the stream differs between ranks (global batches 8-16 have fingerprints ["), error


def test_a_stream_that_ends_earlier_on_one_rank_is_refused_not_a_hang():
    rows = {0: list(range(100)), 1: list(range(72))}  # rank 1's stream: 9 global batches of 8, rank 0's: 13
    results = run_ranks(2, lambda r, ex: steps_until_refused(loader_for(Rows(rows[r]), r, 2, ex)))
    for steps, error in results:
        assert steps == EXCHANGE_STEPS and error is not None, results
        assert error.startswith("the stream differs between ranks (it ends after 9 global batches on rank 1 "
                                "and goes on on rank 0): "), error


def test_whole_stream_compares_once_per_exchange_steps():
    results = run_ranks(2, lambda r, ex: (epoch_of(loader_for(Rows(200), r, 2, ex, batch_size=2)), ex))
    steps, exchange = results[0]
    assert len(steps) == 50 and exchange.calls == -(-50 // EXCHANGE_STEPS)  # 7 tiny all_gathers, not 50


def test_workers_split_batches_without_duplicates_in_the_stream_order():
    """The reader in worker w of W keeps every W-th global batch; interleaved they are the stream."""
    reader = _Reader(Rows(37), 0, lambda rows: rows, 2, False)
    reader.plan.world_size, reader.plan.rank = 2, 1
    per_worker = [list(reader._whole(w, 3)) for w in range(3)]
    indices = sorted(meta["index"] for part in per_worker for _, meta in part)
    assert indices == list(range(10))  # ceil(37 / 4) global batches, each once
    rows = [batch for _, batch in sorted((meta["index"], b) for part in per_worker for b, meta in part)]
    assert rows == [[4 * i + 2, 4 * i + 3] for i in range(9)] + [[36]]  # rank 1's slice of each; last: 1 row


@pytest.mark.distributed  # DataLoader worker processes
def test_num_workers_give_the_same_batches_as_the_main_process():
    ex = Exchange(1)
    plain = epoch_of(loader_for(Rows(30), 0, 1, ex))
    with_workers = epoch_of(loader_for(Rows(30), 0, 1, ex, num_workers=2))
    assert [s["rows"] for s in with_workers] == [s["rows"] for s in plain] == [
        list(range(i, min(30, i + 4))) for i in range(0, 30, 4)]


class WorkerAware(IterableDataset):
    """Splits itself by ``get_worker_info`` the way torch's docs suggest: under prepare() it must be read
    whole in each worker (the reader splits), or rows would be lost."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        rows = range(20)
        return iter(rows if info is None else rows[info.id::info.num_workers])


@pytest.mark.distributed  # DataLoader worker processes
def test_a_dataset_splitting_by_worker_itself_loses_nothing():
    ex = Exchange(1)
    steps = epoch_of(loader_for(WorkerAware(), 0, 1, ex, num_workers=2))
    assert [row for s in steps for row in s["rows"]] == list(range(20))


# ---------------------------------------------------------------------- shuffling
def test_buffer_shuffle_is_a_seeded_permutation_per_epoch_independent_of_world_size():
    def orders(world, seed):
        def body(rank, ex):
            loader = loader_for(ud.stream(Rows(50), shuffle_buffer=8), rank, world, ex, seed=seed)
            return [epoch_of(loader), epoch_of(loader)]
        results = run_ranks(world, body)
        per_epoch = []
        for e in range(2):  # the global order: step by step, rank by rank (padding-free here: 50 = 6*8 + 2)
            rows = []
            for s in range(len(results[0][e])):
                for r in range(world):
                    step = results[r][e][s]
                    rows += step["rows"][:step["mine"]]
            per_epoch.append(rows)
        return per_epoch

    one, two = orders(1, seed=3), orders(2, seed=3)
    assert one == two  # the same global order on 1 and 2 ranks
    assert sorted(one[0]) == sorted(one[1]) == list(range(50))
    assert one[0] != one[1] and one[0] != list(range(50))  # shuffled, and anew each epoch
    assert orders(1, seed=4)[0] != one[0]


def test_buffer_shuffle_keeps_rows_near_their_place():
    """A shuffle buffer of k rows: the row at position p leaves after p + k + 1 rows were read, so no row
    comes out more than k places early; and it is a permutation, not the stream's order."""
    loader = loader_for(ud.stream(Rows(200), shuffle_buffer=8), 0, 1, Exchange(1), seed=1)
    rows = [row for s in epoch_of(loader) for row in s["rows"]]
    assert sorted(rows) == list(range(200))
    assert all(pos >= row - 8 for pos, row in enumerate(rows))
    assert rows != list(range(200))


# ---------------------------------------------------------------------- split by shards
def test_split_stream_reads_own_shards_and_pads_ranks_that_ran_out():
    parts = [list(range(0, 9)), list(range(100, 103))]
    epochs = run_ranks(2, lambda r, ex: epoch_of(loader_for(Shards(parts), r, 2, ex, batch_size=2)))
    rank0, rank1 = epochs
    assert [s["rows"] for s in rank0] == [[0, 1], [2, 3], [4, 5], [6, 7], [8]]
    # rank 1 runs out after 3 rows: from then on one padding row (its first row) that weighs nothing
    assert [s["rows"] for s in rank1] == [[100, 101], [102], [100], [100], [100]]
    assert [s["counts"] for s in rank0] == [[2, 2], [2, 1], [2, 0], [2, 0], [1, 0]]
    assert [s["mine"] for s in rank1] == [2, 1, 0, 0, 0]
    assert [s["last"] for s in rank0] == [False] * 4 + [True]
    # gathered rows are rank 0's then rank 1's; the padding row after rank 0's is dropped
    assert rank0[2]["kept"] == [0, 1] and rank0[1]["kept"] is None
    assert [s["window"] for s in rank0] == [7, 5, 4, 3, 1]


def test_padding_rows_are_dropped_wherever_they_sit_in_the_gathered_rows():
    from unified_dist.data.loaders import BatchInfo

    # rank 0 ran out first: its padding row comes before rank 1's two real rows
    assert BatchInfo(real=2, padded=3, is_last=False, counts=[0, 2]).kept_rows() == [1, 2]
    assert BatchInfo(real=3, padded=4, is_last=False, counts=[2, 0, 1]).kept_rows() == [0, 1, 3]
    assert BatchInfo(real=4, padded=4, is_last=False, counts=[2, 2]).kept_rows() is None


def test_split_stream_exchanges_counts_once_per_chunk_of_steps():
    parts = [list(range(200)), list(range(1000, 1100))]
    results = run_ranks(2, lambda r, ex: (epoch_of(loader_for(Shards(parts), r, 2, ex, batch_size=2)), ex))
    steps, exchange = results[0]
    # 100 steps; the last one needs to know that step 101 is empty: 101 steps' counts, 8 a call (the
    # documented EXCHANGE_STEPS) -> 13 all_gathers, not one a step
    assert EXCHANGE_STEPS == 8
    assert len(steps) == 100 and exchange.calls == 13


def test_a_rank_whose_shards_are_empty_is_refused_on_every_rank():
    results = run_ranks(2, lambda r, ex: epoch_of(loader_for(Shards([range(5), []]), r, 2, ex)))
    for exc in results:
        assert isinstance(exc, ud.UnifiedDistError) and "got no examples from its shards" in str(exc), exc


def test_split_false_reads_the_whole_stream_and_split_true_insists():
    parts = [list(range(0, 6)), list(range(100, 104))]
    epochs = run_ranks(2, lambda r, ex: epoch_of(loader_for(ud.stream(Shards(parts), split=False), r, 2, ex,
                                                            batch_size=2)))
    assert [s["rows"] for s in epochs[0]] == [[0, 1], [4, 5], [102]]  # global batches of 4 over both shards
    with pytest.raises(ud.UnifiedDistError, match="cannot split itself"):
        ud.stream(Rows(3), split=True)
    three = run_ranks(3, lambda r, ex: epoch_of(loader_for(ud.stream(Shards(parts), split=True), r, 3, ex)))
    assert all(isinstance(e, ud.UnifiedDistError) and "2 shards, which 3 data-parallel ranks" in str(e)
               for e in three), three


def test_split_true_in_one_process_reads_every_shard():
    parts = [list(range(0, 6)), list(range(100, 104)), list(range(200, 203))]
    steps = epoch_of(loader_for(ud.stream(Shards(parts), split=True), 0, 1, Exchange(1), batch_size=4))
    canonical = [p[i] for i in range(max(map(len, parts))) for p in parts if i < len(p)]  # slot p: shard p % n
    assert [row for s in steps for row in s["rows"]] == canonical


def test_a_datasets_stream_split_by_node_already_is_refused_in_one_line():
    datasets = pytest.importorskip("datasets")
    from datasets.distributed import split_dataset_by_node

    stream = datasets.Dataset.from_dict({"x": list(range(16))}).to_iterable_dataset(num_shards=8)
    for rank, world in ((1, 2), (0, 1)):
        with pytest.raises(ud.UnifiedDistError) as info:
            loader_for(ud.stream(split_dataset_by_node(stream, rank, world)), rank, world, Exchange(world))
        assert str(info.value) == (
            f"prepare() got a datasets stream already split by split_dataset_by_node (rank {rank} of {world}), "
            "which prepare() would split again, losing data; drop the split_dataset_by_node call and pass the "
            "whole stream: prepare() gives each rank its part")
    unsplit = loader_for(stream.map(lambda e: e), 0, 1, Exchange(1), collate_fn=lambda b: [e["x"] for e in b])
    files = [[2 * i, 2 * i + 1] for i in range(8)]  # to_iterable_dataset's 8 shards of 2 rows, in order
    canonical = [f[j] for j in range(2) for f in files]  # slot p: row p // 8 of shard p % 8
    assert [row for batch in unsplit for row in batch] == canonical  # not split: read, all of it


def test_datasets_streaming_csv_splits_by_file_and_reads_whole_with_one_file(tmp_path):
    datasets = pytest.importorskip("datasets")
    files = []
    for name, rows in (("a", range(0, 7)), ("b", range(7, 10))):
        path = tmp_path / f"{name}.csv"
        path.write_text("x\n" + "".join(f"{i}\n" for i in rows))
        files.append(str(path))

    def rows_of(data_files, world):
        def body(rank, ex):
            ds = datasets.load_dataset("csv", data_files=data_files, streaming=True, split="train")
            loader = loader_for(ds, rank, world, ex, batch_size=2, collate_fn=lambda b: [e["x"] for e in b])
            return [(batch, loader.batch_info.mine) for batch in loader]
        results = run_ranks(world, body)
        for result in results:  # a rank's exception, not a TypeError about it
            if isinstance(result, BaseException):
                raise result
        return results

    # the ranks are threads here: a process's first load_dataset("csv") imports the builder, which two threads at
    # once did not survive in a fresh process (AttributeError, seen in the version matrix's unit run); a rank of a
    # real job is a process of its own
    datasets.load_dataset("csv", data_files=files[:1], streaming=True, split="train")

    split = rows_of(files, 2)
    assert [b for b, _ in split[0]] == [[0, 1], [2, 3], [4, 5], [6]]
    assert [b[:m] for b, m in split[1]] == [[7, 8], [9], [], []]
    whole = rows_of(files[:1], 2)
    assert [b for b, _ in whole[0]] == [[0, 1], [4, 5]] and [b for b, _ in whole[1]] == [[2, 3], [6]]


# ---------------------------------------------------------------------- resume
def test_whole_stream_resumes_mid_epoch_at_another_world_size():
    def first_steps(rank, ex):
        loader = loader_for(ud.stream(Rows(45), shuffle_buffer=6), rank, 2, ex, seed=7)
        it = iter(loader)
        [next(it) for _ in range(3)]
        return loader.state_dict()

    state = run_ranks(2, first_steps)[0]
    assert state["stream"] == {"mode": "whole", "consumed": 24}

    full = epoch_of(loader_for(ud.stream(Rows(45), shuffle_buffer=6), 0, 1, Exchange(1), seed=7, batch_size=8))
    expected = [row for s in full[3:] for row in s["rows"]]

    def resume(rank, ex):
        loader = loader_for(ud.stream(Rows(45), shuffle_buffer=6), rank, 3, ex, seed=0)
        loader.load_state_dict(state)
        return epoch_of(loader)

    resumed = run_ranks(3, resume)
    rows = [row for s in range(len(resumed[0])) for r in range(3)
            for row in resumed[r][s]["rows"][:resumed[r][s]["mine"]]]
    assert rows == expected and len(rows) == 21


def test_split_stream_resumes_at_any_world_size_dividing_the_shards_and_refuses_a_whole_read():
    parts = [list(range(0, 9)), list(range(100, 105))]

    def first_steps(rank, ex):
        return _state_after(loader_for(Shards(parts), rank, 2, ex, batch_size=2), 2)

    state = run_ranks(2, first_steps)[0]
    assert state["stream"] == {"mode": "shards", "n_shards": 2, "slots": 8, "samples": 8}
    assert state["samples_consumed"] == 8  # examples 0..3 of both shards (9 and 5 long): no slot empty

    def resume(rank, ex, world=2, batch_size=2):
        loader = loader_for(Shards(parts), rank, world, ex, batch_size=batch_size)
        loader.load_state_dict(state)
        return epoch_of(loader)

    rank0, rank1 = run_ranks(2, resume)
    assert [s["rows"] for s in rank0] == [[4, 5], [6, 7], [8]]
    assert [s["rows"][:s["mine"]] for s in rank1] == [[104], [], []]
    # one process, the same global batch (4): slots 8.. of the canonical order (shard p % 2, example p // 2)
    (alone,) = run_ranks(1, lambda r, ex: resume(r, ex, world=1, batch_size=4))
    assert [s["rows"] for s in alone] == [[4, 104, 5], [6, 7], [8]]

    def after_rank_1_ran_out(rank, ex):  # 4 steps: rank 1's 5 rows were used up in 3
        loader = loader_for(Shards(parts), rank, 2, ex, batch_size=2)
        it = iter(loader)
        [next(it) for _ in range(4)]
        state = loader.state_dict()
        again = loader_for(Shards(parts), rank, 2, ex, batch_size=2)
        again.load_state_dict(state)
        return state, [(batch.tolist(), again.batch_info.mine) for batch in again]

    (state0, rows0), (_, rows1) = run_ranks(2, after_rank_1_ran_out)
    assert state0["stream"]["slots"] == 16
    assert rows0 == [([8], 1)] and rows1 == [([100], 0)]  # rank 1: a padding row (its shards' first), weight 0

    def elsewhere(rank, ex):
        loader = loader_for(ud.stream(Shards(parts), split=False), rank, 2, ex)
        loader.load_state_dict(state)
        return epoch_of(loader)

    for exc in run_ranks(2, elsewhere):
        assert isinstance(exc, ud.UnifiedDistError) and "split=False" in str(exc) and "\n" not in str(exc), exc


# ---------------------------------------------------------------------- issue 46 item 7: one order at any world size
EIGHT = [list(range(100 * s, 100 * s + n)) for s, n in enumerate((7, 3, 9, 5, 6, 2, 8, 4))]


class CountedShards(Shards):
    """Shards that record which shard indices each rank opened (``shard(n_shards, i)`` then iterated)."""

    def __init__(self, parts, opened):
        super().__init__(parts)
        self.opened = opened

    def shard(self, num_shards, index):
        part = Shards(self.parts[index::num_shards])
        opened, key = self.opened, threading.current_thread().name

        class Opened(Shards):
            def __iter__(self):
                opened.setdefault(key, []).append((num_shards, index))
                return super().__iter__()
        return Opened(part.parts)


def canonical_steps(parts, global_batch, start=0):
    """Plain arithmetic: slot p is example p // n of shard p % n (empty past its end); a step is global_batch
    slots from slot ``start`` on, a step with none skipped."""
    n, steps = len(parts), []
    for t in range(start, n * max(map(len, parts)), global_batch):
        rows = [parts[p % n][p // n] for p in range(t, t + global_batch) if p // n < len(parts[p % n])]
        if rows:
            steps.append(rows)
    return steps


def gathered_steps(world, global_batch, dataset, seed=0, epochs=1):
    """Every step's rows of all ranks (as sets, sorted), per epoch, and which shards each rank opened."""
    def body(rank, ex):
        loader = loader_for(dataset, rank, world, ex, batch_size=global_batch // world, seed=seed)
        return [[(s["rows"][:s["mine"]]) for s in epoch_of(loader, limit=64)] for _ in range(epochs)]
    results = run_ranks(world, body)
    for r in results:
        assert not isinstance(r, BaseException), r
    return [[sorted(i for r in range(world) for i in results[r][e][s]) for s in range(len(results[0][e]))]
            for e in range(epochs)]


@pytest.mark.parametrize("global_batch", [8, 4, 6])
def test_shards_give_one_canonical_order_at_every_world_size_dividing_them(global_batch):
    want = [sorted(step) for step in canonical_steps(EIGHT, global_batch)]
    for world in (w for w in (1, 2, 4) if global_batch % w == 0):
        assert gathered_steps(world, global_batch, Shards(EIGHT)) == [want], world


def test_a_state_by_shards_resumes_at_another_world_size_at_the_next_slot():
    def three_steps(rank, ex):  # 2 ranks, global batch 4: 12 slots, not a whole round of the 8 shards
        return _state_after(loader_for(Shards(EIGHT), rank, 2, ex, batch_size=2), 3)

    state = run_ranks(2, three_steps)[0]
    assert state["stream"] == {"mode": "shards", "n_shards": 8, "slots": 12, "samples": 12}

    def resume(rank, ex, world):
        loader = loader_for(Shards(EIGHT), rank, world, ex, batch_size=4 // world)
        loader.load_state_dict(state)
        return [s["rows"][:s["mine"]] for s in epoch_of(loader, limit=64)]

    want = [sorted(step) for step in canonical_steps(EIGHT, 4, start=12)]
    for world in (1, 4):
        ranks = run_ranks(world, lambda r, ex, w=world: resume(r, ex, w))
        assert [sorted(i for r in ranks for i in r[s]) for s in range(len(ranks[0]))] == want, world


def test_each_rank_opens_only_its_shards():
    for world in (1, 2, 4):
        opened = {}
        gathered_steps(world, 8, CountedShards(EIGHT, opened))
        assert len(opened) == world, opened
        for rank_opened in opened.values():  # each shard alone (shard(8, i)), 8 / world of them per rank
            assert all(n == 8 for n, _ in rank_opened) and len(rank_opened) == 8 // world, rank_opened
        assert sorted(i for o in opened.values() for _, i in o) == list(range(8)), opened


def test_shuffled_shards_are_one_order_at_every_world_size_and_new_each_epoch():
    runs = [gathered_steps(world, 8, ud.stream(Shards(EIGHT), shuffle_buffer=16), seed=5, epochs=2)
            for world in (1, 2, 4)]
    assert runs[0] == runs[1] == runs[2]
    first, second = runs[0]
    assert sorted(i for step in first for i in step) == sorted(i for p in EIGHT for i in p)
    assert first != second and first != [sorted(s) for s in canonical_steps(EIGHT, 8)]


class Packed(Shards):
    """Packs consecutive rows of what it reads into blocks of 2 (the rest dropped), as a tokenising stream
    packs tokens: read by shards, the blocks of one shard."""

    def shard(self, num_shards, index):
        return Packed(self.parts[index::num_shards])

    def __iter__(self):
        rows = [i for p in self.parts for i in p]
        return iter(rows[k] * 1000 + rows[k + 1] for k in range(0, len(rows) - 1, 2))


def test_packing_per_shard_gives_the_same_blocks_at_every_world_size():
    blocks = [[p[k] * 1000 + p[k + 1] for k in range(0, len(p) - 1, 2)] for p in EIGHT]
    want = [sorted(step) for step in canonical_steps(blocks, 4)]
    for world in (1, 2, 4):
        assert gathered_steps(world, 4, Packed(EIGHT)) == [want], world


def test_a_world_size_not_dividing_the_shards_reads_whole_and_says_so_in_one_line():
    from unified_dist import errors

    errors._warned.clear()
    with pytest.warns(UserWarning, match="8 shards do not split evenly over 3") as caught:
        rows = gathered_steps(3, 6, Shards(EIGHT))
    assert all("\n" not in str(w.message) for w in caught)
    flat = [i for p in EIGHT for i in p]  # the dataset's own order, in global batches of 6
    assert rows == [[sorted(flat[s:s + 6]) for s in range(0, len(flat), 6)]]


def test_a_map_style_state_is_refused_by_a_stream():
    loader = loader_for(Rows(5), 0, 1, Exchange(1))
    with pytest.raises(ud.UnifiedDistError, match="saved by a map-style loader"):
        loader.load_state_dict({"epoch": 0, "samples_consumed": 4, "num_samples": 5, "seed": 0})


def test_a_stream_state_is_refused_by_a_map_style_loader():
    ud.init(backend="single")
    try:
        loader = ud.prepare(DataLoader(list(range(5)), batch_size=2))
        with pytest.raises(ud.UnifiedDistError, match="saved by a prepared stream"):
            loader.load_state_dict({"epoch": 0, "seed": 0, "stream": {"mode": "whole", "consumed": 4}})
    finally:
        ud.shutdown()


def test_a_finished_epoch_state_starts_the_next_epoch():
    loader = loader_for(Rows(5), 0, 1, Exchange(1))
    epoch_of(loader)
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["stream"]["consumed"] == 0


# ---------------------------------------------------------------------- length, options, fingerprints
def test_len_is_known_only_for_a_sized_stream_read_whole():
    assert len(loader_for(SizedRows(21), 0, 2, Exchange(2), batch_size=4)) == 3
    assert len(loader_for(SizedRows(21), 0, 2, Exchange(2), batch_size=4, drop_last=True)) == 2
    with pytest.raises(TypeError, match="length is unknown"):
        len(loader_for(Rows(21), 0, 2, Exchange(2)))
    tqdm = pytest.importorskip("tqdm")
    assert tqdm.tqdm(loader_for(Rows(3), 0, 1, Exchange(1)), disable=True).total is None


@pytest.mark.parametrize("kwargs, match", [
    (dict(shuffle_buffer=-1), "shuffle_buffer=-1"), (dict(shuffle_buffer=True), "shuffle_buffer=True"),
    (dict(split="yes"), "split='yes'"), (dict(split=2), "split=2"),
])
def test_stream_options_are_checked(kwargs, match):
    with pytest.raises(ud.UnifiedDistError, match=match):
        ud.stream(Rows(3), **kwargs)
    with pytest.raises(ud.UnifiedDistError, match="expects an iterable dataset, got list"):
        ud.stream([1, 2])


def test_fingerprints_follow_content_not_identity():
    a = [{"x": torch.arange(4), "t": "hi"}, (1, 2.5, None)]
    b = [{"t": "hi", "x": torch.arange(4)}, (1, 2.5, None)]
    assert fingerprint(a) == fingerprint(b)
    assert fingerprint([torch.arange(4)]) != fingerprint([torch.arange(4).float()])
    assert fingerprint([torch.arange(4)]) != fingerprint([torch.arange(1, 5)])
    assert fingerprint(["a", "b"]) != fingerprint(["b", "a"])
    assert 0 <= fingerprint(a) < 2**63


def test_one_shard_is_read_whole_at_every_world_size_so_its_state_resumes_across_them():
    """A one-shard dataset (the example's single CSV file) is read whole under 1 and 2 ranks alike: a state
    saved under torchrun x 2 resumes in one process (its canonical order is the whole stream's anyway)."""
    parts = [list(range(10))]
    for world in (1, 2):
        states = run_ranks(world, lambda rank, ex, world=world: _state_after(  # 2 batches: not a peek
            loader_for(ud.stream(Shards(parts)), rank, world, ex, batch_size=2), 2))
        assert all(s["stream"]["mode"] == "whole" for s in states), (world, states)
    assert choose_split(Shards(parts), True, 1)  # split=True still reads it by shards (the same order)


def _state_after(loader, steps):
    """``loader.state_dict()`` after its first ``steps`` batches (two or more: not a peek, docs/data-order.md)."""
    it = iter(loader)
    for _ in range(steps):
        next(it)
    return loader.state_dict()


def test_both_loaders_state_says_epoch_seed_and_the_examples_consumed_not_the_slots():
    """One state shape (map-style and streams): ``epoch``, ``seed``, ``samples_consumed``. Read by shards,
    the examples, not the slots: 3 steps of 8 slots over EIGHT (shards 7, 3, 9, 5, 6, 2, 8, 4 long) are
    rounds 0, 1 and 2 of the canonical order, and in round 2 the 2-example shard is empty: 8 + 8 + 7."""
    def three_steps(rank, ex):
        return _state_after(loader_for(Shards(EIGHT), rank, 2, ex, batch_size=4), 3)

    states = run_ranks(2, three_steps)
    for state in states:
        assert {"epoch", "seed", "samples_consumed"} <= set(state)
        assert state["stream"]["slots"] == 24 and state["samples_consumed"] == 23, state
    whole = run_ranks(2, lambda rank, ex: _state_after(loader_for(ud.stream(Rows(45), split=False), rank, 2, ex), 3))
    assert whole[0]["samples_consumed"] == whole[0]["stream"]["consumed"] == 24  # 3 global batches of 8
