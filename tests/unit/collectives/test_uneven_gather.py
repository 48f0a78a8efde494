"""UnevenGather's protocol, with W simulated ranks as threads sharing an equal-size gather."""
import threading

import pytest
import torch

from unified_dist.collectives.uneven_gather import UnevenGather
from unified_dist.errors import CollectiveError


class FakeGroup:
    """all_gather_equal for `world` threads: every rank's row, stacked in rank order; counts calls."""

    def __init__(self, world):
        self.world, self.rows, self.calls, self.broadcasts = world, [None] * world, 0, 0
        self.row_bytes = []  # rank 0's row size in bytes, per gather
        self.barrier = threading.Barrier(world, timeout=10)  # a rank left waiting fails instead of hanging

    def gather_equal(self, rank):
        def gather(row):
            self.rows[rank] = row.clone()
            self.barrier.wait()
            sizes = {r.shape for r in self.rows}
            assert len(sizes) == 1, f"ranks sent different row sizes {sizes}: a real group would hang"
            out = torch.stack(self.rows)
            if rank == 0:
                self.calls += 1
                self.row_bytes.append(row.numel() * row.element_size())
            self.barrier.wait()
            return out
        return gather

    def broadcast(self, rank):
        def bcast(tensor, src):
            self.rows[rank] = tensor.clone()
            self.barrier.wait()
            out = self.rows[src].clone()
            if rank == 0:
                self.broadcasts += 1
            self.barrier.wait()
            return out  # not in place, like some backends
        return bcast


def run_ranks(world, per_rank_calls):
    """per_rank_calls(rank) -> list of tensors to gather in order; returns results[rank][i] and the group."""
    group = FakeGroup(world)
    results, errors = [None] * world, [None] * world

    def body(rank):
        gatherer = UnevenGather(group.gather_equal(rank), group.broadcast(rank), rank)
        try:
            results[rank] = [gatherer(t) for t in per_rank_calls(rank)]
        except Exception as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results, errors, group


@pytest.mark.parametrize("world", [2, 3])
def test_results_match_concatenation_and_repeats_take_one_round(world):
    def calls(rank):
        even = torch.full((4, 3), float(rank))
        uneven = torch.arange(10 * (rank + 1), dtype=torch.float64).reshape(-1, 1) + 100 * rank  # > 64 bytes
        return [even, even, even, uneven, uneven, torch.zeros((0 if rank == 0 else 2, 3)),
                torch.tensor([rank % 2 == 0]), torch.full((2,), rank, dtype=torch.complex128)]
    results, errors, group = run_ranks(world, calls)
    assert errors == [None] * world, errors
    expected = [torch.cat([calls(r)[i] for r in range(world)]) for i in range(8)]
    for rank in range(world):
        for got, want in zip(results[rank], expected):
            assert got.dtype == want.dtype and torch.equal(got, want)
    # first call: headers only, then the data; the 2 repeats: one each; uneven growth: two; the rest fit
    assert group.calls == 2 + 1 + 1 + 2 + 1 + 1 + 1 + 1, group.calls


def test_shrinking_sizes_fit_in_one_round():
    """After a large gather, smaller (uneven) ones take one round each, return every rank's own
    values, and the padding shrinks with them: the capacity is the largest payload of the gather
    just done, rounded up to 64 bytes (uneven_gather's module doc), not the largest ever seen."""
    def calls(rank):
        return [torch.arange(64 + 16 * rank, dtype=torch.float32) + 1000 * rank,  # 256 / 320 bytes
                torch.full((8 + rank,), float(rank + 1)),                          # 32 / 36 bytes
                torch.tensor([7.0, 8.0, 9.0]) * (rank + 1)]                        # 12 bytes each
    results, errors, group = run_ranks(2, calls)
    assert errors == [None, None], errors
    for i in range(3):
        want = torch.cat([calls(0)[i], calls(1)[i]])
        assert all(torch.equal(results[rank][i], want) for rank in range(2)), (i, results[0][i], want)
    assert group.calls == 2 + 1 + 1, group.calls
    header = 12 * 8  # ndim, 8 dims, dtype, payload bytes, spare: int64 words
    # 1st: headers only (capacity 0), then the payloads padded to 320; 2nd: header + 320 (it fits);
    # 3rd: header + 64 (36 bytes, the 2nd gather's largest, rounded up to 64)
    assert group.row_bytes == [header, 320, header + 320, header + 64], group.row_bytes


@pytest.mark.parametrize("second, message", [
    (lambda r: torch.zeros(2, 3 + r), "rank 0: (2, 3), rank 1: (2, 4)"),
    (lambda r: torch.zeros(2, dtype=torch.float32 if r == 0 else torch.int64),
     "rank 0: (2,) float32, rank 1: (2,) int64"),
])
def test_mismatch_raises_the_same_one_line_error_on_every_rank(second, message):
    results, errors, _ = run_ranks(2, lambda rank: [torch.ones(3), second(rank)])
    assert all(isinstance(e, CollectiveError) for e in errors), errors
    assert {str(e) for e in errors} == {str(errors[0])} and message in str(errors[0]) and "\n" not in str(errors[0])


@pytest.mark.parametrize("world", [2, 3])
def test_large_payloads_gather_the_tensors_themselves(world, monkeypatch):
    import unified_dist.collectives.uneven_gather as ug

    monkeypatch.setattr(ug, "INLINE_LIMIT", 256)
    def calls(rank):
        return [torch.full((40, 2), float(rank)), torch.full((40, 2), float(rank)),
                torch.arange(60 + 20 * rank, dtype=torch.float32).reshape(-1, 2), torch.ones(3, 2)]
    results, errors, group = run_ranks(world, calls)
    assert errors == [None] * world, errors
    for i in range(4):
        want = torch.cat([calls(r)[i] for r in range(world)])
        assert all(torch.equal(results[rank][i], want) for rank in range(world)), i
    # over 256 bytes: a header round + a direct gather (even) or one broadcast per rank (uneven);
    # capacity 0 after them, so 2 gathers for the last
    assert group.calls == 2 + 2 + 1 + 2 and group.broadcasts == world, (group.calls, group.broadcasts)
    even = results[0][0]
    assert even._base is not None, "an even large gather is returned as a view of the gathered tensor"


def test_large_uneven_pads_past_the_broadcast_limit(monkeypatch):
    import unified_dist.collectives.uneven_gather as ug

    monkeypatch.setattr(ug, "INLINE_LIMIT", 64)
    monkeypatch.setattr(ug, "MAX_BROADCAST_RANKS", 2)
    results, errors, group = run_ranks(3, lambda rank: [torch.arange(40 * (rank + 1), dtype=torch.float32)])
    assert errors == [None] * 3, errors
    want = torch.cat([torch.arange(40 * (r + 1), dtype=torch.float32) for r in range(3)])
    assert all(torch.equal(results[r][0], want) for r in range(3)) and group.broadcasts == 0 and group.calls == 2
