"""The sharded sampler's layout, checked by simulating every rank of several world sizes."""
import pytest
import torch

from unified_dist.data.loaders import LoaderStack, PreparedDataLoader, ShardedBatchSampler, plan_global_batches


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


# ---------------------------------------------------------------------- peeks and abandoned passes (issue #46 item 6)
def shuffled(n=10, batch_size=4, seed=5):
    stack = LoaderStack()
    ds = torch.utils.data.TensorDataset(torch.arange(n))
    return PreparedDataLoader(torch.utils.data.DataLoader(ds, batch_size=batch_size, shuffle=True), lambda: (0, 1),
                              torch.device("cpu"), seed, stack), stack


def permutation(n, seed):
    """One process's order of an epoch seeded ``seed``: torch's permutation, computed without the loader."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


def test_a_peek_does_not_move_the_epoch_order():
    """docs/data-order.md: `next(iter(loader))` (also with the iterator kept, as torch's CIFAR tutorial does) gives
    its epoch back: every later epoch has the order it has without the peek, and state_dict is unchanged."""
    loader, _ = shuffled()
    before = loader.state_dict()
    assert next(iter(loader))[0].tolist() == permutation(10, 5)[:4]
    assert loader.state_dict() == before and loader.epoch == 0
    kept = iter(loader)
    next(kept)
    assert loader.state_dict() == before  # also while the peek's iterator is still open
    epochs = [sum((b[0].tolist() for b in loader), []) for _ in range(2)]
    next(iter(loader))  # a peek between epochs
    epochs.append(sum((b[0].tolist() for b in loader), []))
    assert epochs == [permutation(10, 5 + e) for e in range(3)]
    del kept  # the forgotten peek, closed late, must not disturb the loader
    assert loader.state_dict()["epoch"] == 3 and loader.batch_info is None


def test_a_peek_after_a_mid_epoch_load_keeps_the_resume_point():
    loader, _ = shuffled(n=12, batch_size=2)
    loader.load_state_dict({"epoch": 1, "samples_consumed": 4, "num_samples": 12, "seed": 5})
    next(iter(loader))
    assert loader.state_dict()["samples_consumed"] == 4
    assert sum((b[0].tolist() for b in loader), []) == permutation(12, 6)[4:]


def test_a_pass_left_after_a_training_step_or_a_second_batch_uses_its_epoch():
    """`for epoch ...: for batch in loader: train; break` sees a new shuffle every epoch (no batch repeated
    forever), and state_dict keeps where the left pass stopped (a mid-epoch checkpoint resumes there)."""
    loader, stack = shuffled()
    firsts = []
    for _ in range(3):
        for (idx,) in loader:
            stack.note_training()  # what ud.backward and a prepared optimizer's step do
            firsts.append(idx.tolist())
            break
        assert loader.state_dict()["samples_consumed"] == 4
    assert firsts == [permutation(10, 5 + e)[:4] for e in range(3)]
    for k, _ in enumerate(loader):  # two batches out, nothing trained: no peek either
        if k == 1:
            break
    assert loader.state_dict() == {"epoch": 3, "samples_consumed": 8, "num_samples": 10, "seed": 5}
    assert [b[0].tolist() for b in loader] == [permutation(10, 9)[i:i + 4] for i in (0, 4, 8)]


def test_passes_that_all_look_like_peeks_warn_once():
    loader, _ = shuffled()
    with pytest.warns(UserWarning, match="started epoch 0 again 3 times in a row"):
        for _ in range(5):
            for _ in loader:
                break
    assert loader.epoch == 0


def test_an_early_break_after_ud_backward_or_optimizer_step_reshuffles():
    """The real training calls mark the pass: ud.backward, and a prepared optimizer's step after loss.backward()."""
    import unified_dist as ud
    ud.shutdown()
    ud.init(backend="single")
    try:
        model = torch.nn.Linear(1, 1)
        model, opt, loader = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(torch.arange(12.0)), batch_size=4, shuffle=True))
        firsts = []
        for epoch in range(4):
            for (x,) in loader:
                loss = model(x.reshape(-1, 1)).mean()
                ud.backward(loss) if epoch % 2 else loss.backward()
                opt.step()
                opt.zero_grad()
                firsts.append(x.long().tolist())
                break
        assert firsts == [permutation(12, loader.seed + e)[:4] for e in range(4)]
    finally:
        ud.shutdown()


def test_a_stream_peek_does_not_move_the_epoch_order():
    """The same rule for a prepared stream: a peek's epoch is given back, a trained-on break is not."""
    from unified_dist.data.streams import PreparedStreamLoader, stream

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(20))

    def prepared():
        stack = LoaderStack()
        return PreparedStreamLoader(torch.utils.data.DataLoader(stream(Rows(), shuffle_buffer=6), batch_size=4),
                                    lambda: (0, 1), torch.device("cpu"), 3, stack, lambda v: [v], 1), stack

    plain, _ = prepared()
    expected = [sum((b.tolist() for b in plain), []) for _ in range(4)]
    assert expected[0] != expected[1] and sorted(expected[0]) == list(range(20))
    peeked, stack = prepared()
    assert next(iter(peeked)).tolist() == expected[0][:4]
    assert [sum((b.tolist() for b in peeked), []) for _ in range(2)] == expected[:2]
    for batch in peeked:
        stack.note_training()
        assert batch.tolist() == expected[2][:4]
        break
    assert peeked.state_dict()["stream"]["consumed"] == 4 and peeked.epoch == 2
    assert sum((b.tolist() for b in peeked), []) == expected[3]
