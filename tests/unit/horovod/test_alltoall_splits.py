"""alltoall's splits are checked as Horovod checks them, before their values are read (issue 58 item 9).

Horovod's own test_horovod_alltoall_splits_type_error passes ``torch.empty(size, dtype=torch.float32)``:
where that garbage read as valid counts on one rank only, that rank alone started the alltoall and the
ranks stayed one operation apart for the rest of its suite. A splits tensor that is not a 1-D int32 tensor
is refused on every rank, whatever it holds; lists of counts are taken as they are.
"""
from __future__ import annotations

import pytest
import torch

from unified_dist.horovod._ops import _splits_of


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.int16])
def test_splits_not_int32_are_refused_even_when_they_hold_valid_counts(dtype):
    with pytest.raises(ValueError, match="32-bit integers"):
        _splits_of(torch.zeros(2), torch.ones(2, dtype=dtype), 2)


def test_splits_of_two_dimensions_are_refused():
    with pytest.raises(ValueError, match="1-D"):
        _splits_of(torch.zeros(2), torch.ones(1, 2, dtype=torch.int32), 2)


def test_int32_splits_and_lists_are_taken():
    assert _splits_of(torch.zeros(3, 2), torch.tensor([1, 2], dtype=torch.int32), 2) == [1, 2]
    assert _splits_of(torch.zeros(3, 2), [2, 1], 2) == [2, 1]
    assert _splits_of(torch.zeros(4), None, 2) == [2, 2]


def test_int32_splits_that_do_not_sum_to_the_rows_are_refused():
    with pytest.raises(ValueError, match="summing to dim 0"):
        _splits_of(torch.zeros(3), torch.tensor([1, 1], dtype=torch.int32), 2)
