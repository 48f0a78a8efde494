"""The CUDA-only paths of SyncBatchNorm, with a fake device (CI has no GPU): on CUDA, torch and
Accelerate use torch's SyncBatchNorm and Horovod uses hvd.SyncBatchNorm; everywhere else, and for
one process, the portable implementation or nothing. The conversions themselves run on CPU."""
from __future__ import annotations

import types

import pytest
import torch

from unified_dist.backends.accelerate_backend import AccelerateBackend
from unified_dist.backends.horovod_backend import HorovodBackend
from unified_dist.backends.torch_ddp import TorchBackend
from unified_dist.parallel.sync_batchnorm import SyncBatchNorm


class FakeHorovodSyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Stands in for hvd.SyncBatchNorm (which refuses CPU tensors)."""


def _backend(monkeypatch, cls, device: str, world: int):
    monkeypatch.setattr(cls, "device", property(lambda self: torch.device(device)))
    monkeypatch.setattr(cls, "world_size", property(lambda self: world))
    backend = object.__new__(cls)
    backend.hvd = types.SimpleNamespace(SyncBatchNorm=FakeHorovodSyncBatchNorm)
    return backend


def _model():
    return torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))


@pytest.mark.parametrize("cls,device,world,expected", [
    (TorchBackend, "cuda", 2, torch.nn.SyncBatchNorm),
    (AccelerateBackend, "cuda", 2, torch.nn.SyncBatchNorm),
    (HorovodBackend, "cuda", 2, FakeHorovodSyncBatchNorm),
    (TorchBackend, "cpu", 2, SyncBatchNorm),
    (AccelerateBackend, "cpu", 2, SyncBatchNorm),
    (HorovodBackend, "cpu", 2, SyncBatchNorm),
    (TorchBackend, "cuda", 1, torch.nn.BatchNorm1d),
    (HorovodBackend, "cuda", 1, torch.nn.BatchNorm1d),
])
def test_each_backend_picks_its_synchronised_batchnorm(monkeypatch, cls, device, world, expected):
    model = _model()
    weight = model[1].weight
    converted = _backend(monkeypatch, cls, device, world).convert_sync_batchnorm(model, gather=None, reduce_sum=None)
    assert type(converted[1]) is expected
    assert converted[1].weight is weight  # parameters are kept, not copied
    assert list(converted.state_dict()) == list(_model().state_dict())  # BatchNorm's keys
