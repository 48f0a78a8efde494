"""The example's length-grouped training order and longest-first evaluation order."""
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from unified_dist.data.loaders import LoaderStack, PreparedDataLoader

pytestmark = pytest.mark.example
_spec = importlib.util.spec_from_file_location(
    "sentiment_data", Path(__file__).resolve().parents[2] / "examples" / "bert_sentiment" / "data.py")
sentiment_data = importlib.util.module_from_spec(_spec)
sys.modules["sentiment_data"] = sentiment_data  # dataclasses look their module up
_spec.loader.exec_module(sentiment_data)

LENGTHS = [int(x) for x in torch.randint(3, 64, (1000,), generator=torch.Generator().manual_seed(0))]


def padded_tokens(order, batch):
    return sum(max(LENGTHS[i] for i in order[k:k + batch]) * len(order[k:k + batch])
               for k in range(0, len(order), batch))


def test_order_is_a_permutation_with_less_padding_and_a_short_last_batch_last():
    order = list(sentiment_data.LengthGroupedOrder(LENGTHS, 64, seed=0))
    assert sorted(order) == list(range(len(LENGTHS)))
    shuffled = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(0)).tolist()
    assert padded_tokens(order, 64) < 0.75 * padded_tokens(shuffled, 64)  # 0.71 here; real text gains more
    # whole batches are shuffled; the 1000 % 64 = 40 leftover examples stay the last global batch
    from transformers.trainer_pt_utils import get_length_grouped_indices

    grouped = get_length_grouped_indices(LENGTHS, 64, generator=torch.Generator().manual_seed(0))
    assert order[-40:] == grouped[-40:] and order[:-40] != grouped[:-40]
    assert sorted(tuple(sorted(order[k:k + 64])) for k in range(0, 960, 64)) == \
        sorted(tuple(sorted(grouped[k:k + 64])) for k in range(0, 960, 64))


def test_order_depends_on_seed_and_epoch_only():
    a = sentiment_data.LengthGroupedOrder(LENGTHS, 64, seed=0)
    b = sentiment_data.LengthGroupedOrder(LENGTHS, 64, seed=0)
    assert list(a) == list(b)
    b.set_epoch(1)
    assert list(a) != list(b)
    a.set_epoch(1)
    assert list(a) == list(b)


def test_union_of_rank_batches_is_the_single_process_batch():
    """2 ranks x 32 see, step by step, exactly the single process's batches of 64."""
    ds = list(range(len(LENGTHS)))

    def batches(rank, world, per_rank):
        loader = torch.utils.data.DataLoader(ds, batch_size=per_rank,
                                             sampler=sentiment_data.LengthGroupedOrder(LENGTHS, 64, seed=3))
        prepared = PreparedDataLoader(loader, lambda: (rank, world), torch.device("cpu"), seed=0, stack=LoaderStack())
        return [b.tolist() for b in prepared]

    single = batches(0, 1, 64)
    r0, r1 = batches(0, 2, 32), batches(1, 2, 32)
    assert [sorted(a + b) for a, b in zip(r0, r1)] == [sorted(s) for s in single]


def test_longest_first_sorts_a_tokenised_split():
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": [[1] * n for n in (3, 9, 1, 9, 5)], "label": [0, 1, 0, 1, 1]})
    out = sentiment_data.longest_first(ds)
    assert [len(x) for x in out["input_ids"]] == [9, 9, 5, 3, 1] and sorted(out["label"]) == sorted(ds["label"])
