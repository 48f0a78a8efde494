"""What unified_dist/horovod/_ops.py refuses before a request is sent (issue 58 item 8): the other members then
hear of it in the request's tick (REFUSED) instead of waiting for this member's row until the timeout."""
from __future__ import annotations

import pytest
import torch

from unified_dist.horovod import _ops


def test_a_tensor_of_more_dimensions_than_a_row_carries_is_refused_before_it_is_sent(monkeypatch):
    told = []
    monkeypatch.setattr(_ops.global_process_set, "ranks", [0, 1])
    monkeypatch.setattr(_ops, "_communicates", lambda ps: True)
    monkeypatch.setattr(_ops, "_tell_refusal", lambda ps: told.append(ps))
    monkeypatch.setattr(_ops, "_controller", lambda ps: pytest.fail("the request reached the negotiation"))
    with pytest.raises(ValueError, match="at most 16 dimensions, got 17"):
        _ops.allreduce_async(torch.zeros([1] * 17))
    assert told == [_ops.global_process_set]  # the others raise too, in the tick this rank sends instead
