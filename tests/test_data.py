"""The sharded sampler's layout, checked by simulating every rank of several world sizes."""
import pytest
import torch

from unified_dist.data import LoaderStack, PreparedDataLoader, ShardedBatchSampler, plan_global_batches


def rank_batches(n, b, world, shuffle=True, epoch=0, start=0, drop_last=False):
    order = (lambda e: torch.randperm(n, generator=torch.Generator().manual_seed(e)).tolist()) if shuffle \
        else (lambda e: list(range(n)))
    out = []
    for r in range(world):
        s = ShardedBatchSampler(order, n, b, r, world, drop_last)
        s.epoch, s.start = epoch, start
        out.append(list(s))
    return out


LAYOUTS = [(n, gb, w) for n, gb in [(23, 6), (24, 6), (5, 12), (100, 8)] for w in (1, 2, 3, 4) if gb % w == 0]


@pytest.mark.parametrize("n,global_batch,world", LAYOUTS)
def test_union_of_step_is_the_single_process_batch(n, global_batch, world):
    single = rank_batches(n, global_batch, 1)[0]
    per_rank = rank_batches(n, global_batch // world, world)
    assert all(len(r) == len(single) for r in per_rank), "ranks must take the same number of steps"
    for step, expected in enumerate(single):
        m = len(expected)
        real = [per_rank[r][step] if r < m else [] for r in range(world)]  # ranks past m hold only padding
        union = [i for batch in real for i in batch]
        assert union == expected  # concatenated in rank order == single-process order, no sample twice
        sizes = [len(per_rank[r][step]) for r in range(world)]
        assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)  # as even as it goes
        assert all(per_rank[r][step] == [expected[0]] for r in range(m, world))  # one padding row each


def test_ragged_last_batch_is_split_unevenly_without_repeats():
    assert rank_batches(7, 2, 2, shuffle=False) == [[[0, 1], [4, 5]], [[2, 3], [6]]]
    # fewer samples than ranks: the last rank's one row is padding (the batch's first sample)
    assert rank_batches(5, 2, 2, shuffle=False) == [[[0, 1], [4]], [[2, 3], [4]]]
    assert [b[-1] for b in rank_batches(8, 2, 3, shuffle=False)] == [[6], [7], [6]]


def test_drop_last_drops_the_incomplete_global_batch():
    assert plan_global_batches(10, 4, 0, drop_last=True) == [4, 4]
    assert plan_global_batches(10, 4, 0, drop_last=False) == [4, 4, 2]
    assert plan_global_batches(10, 4, 8, drop_last=False) == [2]
    assert rank_batches(10, 2, 2, drop_last=True)[1] == rank_batches(10, 2, 2)[1][:2]


def test_resume_start_skips_consumed_samples_for_any_world_size():
    full = rank_batches(30, 6, 1)[0]
    resumed_two_ranks = rank_batches(30, 3, 2, start=12)
    resumed_union = [a + b for a, b in zip(*resumed_two_ranks)]
    assert resumed_union == full[2:]


def test_prepared_loader_epochs_state_and_batch_info():
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    loader = PreparedDataLoader(torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True), lambda: (0, 1),
                                device=torch.device("cpu"), seed=5, stack=LoaderStack())
    assert len(loader) == 3
    first = [b[0].tolist() for b in loader]
    second = [b[0].tolist() for b in loader]
    assert first != second and sorted(sum(first, [])) == list(range(10))
    assert first == [torch.randperm(10, generator=torch.Generator().manual_seed(5)).tolist()[i:i + 4]
                     for i in range(0, 10, 4)]
    assert loader.state_dict()["epoch"] == 2 and loader.state_dict()["samples_consumed"] == 0
    infos = []
    for _ in loader:
        infos.append((loader.batch_info.real, loader.batch_info.is_last))
    assert infos == [(4, False), (4, False), (2, True)]
    assert loader.batch_info is None


def test_loader_state_for_another_dataset_is_refused():
    ds = torch.utils.data.TensorDataset(torch.arange(10))
    loader = PreparedDataLoader(torch.utils.data.DataLoader(ds, batch_size=4), lambda: (0, 1), torch.device("cpu"),
                                0, LoaderStack())
    with pytest.raises(Exception, match="dataset of 11 samples"):
        loader.load_state_dict({"epoch": 0, "samples_consumed": 4, "num_samples": 11})


def test_state_taken_after_the_last_batch_resumes_at_the_next_epoch():
    ds = torch.utils.data.TensorDataset(torch.arange(8))
    loader = PreparedDataLoader(torch.utils.data.DataLoader(ds, batch_size=4), lambda: (0, 1), torch.device("cpu"),
                                0, LoaderStack())
    for _ in loader:
        state = loader.state_dict()
    assert state == {"epoch": 0, "samples_consumed": 8, "num_samples": 8, "seed": 0}
    loader.load_state_dict(state)
    assert loader.epoch == 1 and len(list(loader)) == 2
