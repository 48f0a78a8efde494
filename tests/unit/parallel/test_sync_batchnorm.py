"""The portable SyncBatchNorm's arithmetic, in process: W threads play W ranks over an in-memory
gather, and every rank's outputs, input gradients, summed parameter gradients and running
statistics must equal plain BatchNorm on the concatenated batch (uneven and empty per-rank
batches included). The real launchers run the same comparison in the contract suite.

The comparison runs in float64 (SyncBatchNorm keeps a float64 input's statistics in float64), with a
bound derived from the data, which the seeds fix (only the rounding differs between CPUs):
- every compared value comes through at most 8 chained sums (2 convolutions and 2 BatchNorms, forward
  and backward), each over N <= 36 elements of one channel (9 samples x 2 x 2), whose terms are a
  layer's input (|a| <= 3.5) times its output gradient (|g| <= 18; measured with hooks on a float64
  run of the reference), so sum|terms| <= 36 x 3.5 x 18 ~ 2.3e3;
- one such sum, in another order, moves by at most N * u * sum|terms| = 36 x 2**-53 x 2.3e3 ~ 9e-12;
- the two normalisations divide by the batch's standard deviation (>= 0.18 per channel: x 5.6 each),
  so the worst case is 8 x 5.6**2 x 9e-12 ~ 2.3e-9: TOL = 1e-8 (a margin of 4 over that worst case;
  measured at most 1.4e-14 on 2026-11-28, AMD EPYC, the conv biases' summed gradients, whose true
  value is 0). A mistake (local statistics, a missing all-reduce) moves values by more than 1e-2.
In float32 the same terms gave 1.4e-6 against the old tuned 1e-5 (issue #58)."""
from __future__ import annotations

import threading
from typing import List

import pytest
import torch

from unified_dist.parallel.sync_batchnorm import SyncBatchNorm, convert, global_moments, portable_from

TOL = 1e-8
"""Absolute bound of every float64 comparison below; derived in the module docstring."""


class ThreadComm:
    """all_gather / all_reduce(sum) between W threads, one call at a time in the same order."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.barrier = threading.Barrier(world)
        self.slots: List[torch.Tensor] = [torch.empty(0)] * world

    def gather(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = t.detach().clone()
        self.barrier.wait()
        out = torch.cat(self.slots)
        self.barrier.wait()
        return out

    def reduce_sum(self, rank: int, t: torch.Tensor) -> torch.Tensor:
        return self.gather(rank, t.unsqueeze(0)).sum(dim=0)


def _model(momentum=0.1) -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), torch.nn.BatchNorm2d(4, momentum=momentum), torch.nn.ReLU(),
                               torch.nn.Conv2d(4, 2, 1), torch.nn.BatchNorm2d(2)).double()


def _run_ranks(sizes: List[int], momentum, steps: int = 2):
    torch.manual_seed(0)
    total = sum(sizes)
    x_all = torch.randn(total, 3, 2, 2).double()
    g_all = torch.randn(total, 2, 2, 2).double()
    reference = _model(momentum)
    xr = x_all.clone().requires_grad_()
    for _ in range(steps):
        out_ref = reference(xr)
    (out_ref * g_all).sum().backward()

    comm = ThreadComm(len(sizes))
    results: List[dict] = [{} for _ in sizes]
    errors: List[BaseException] = []

    models = [convert(_model(momentum), portable_from) for _ in sizes]  # here: the global RNG is not thread-safe

    def rank_main(rank: int) -> None:
        try:
            model = models[rank]
            for layer in model.modules():
                if isinstance(layer, SyncBatchNorm):
                    layer.gather = lambda t, r=rank: comm.gather(r, t)
                    layer.reduce_sum = lambda t, r=rank: comm.reduce_sum(r, t)
                    layer.rank_world = lambda r=rank: (r, comm.world)
            lo = sum(sizes[:rank])
            x = x_all[lo:lo + sizes[rank]].clone().requires_grad_()
            for _ in range(steps):
                out = model(x)
            (out * g_all[lo:lo + sizes[rank]]).sum().backward()
            results[rank] = {"out": out.detach(), "x_grad": x.grad, "model": model, "lo": lo}
        except BaseException as exc:  # surfaced below; a dead thread would hang the others
            errors.append(exc)
            comm.barrier.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(sizes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    return reference, xr, out_ref, results


@pytest.mark.parametrize("sizes,momentum", [([4, 4], 0.1), ([3, 5], 0.1), ([1, 6, 2], None), ([0, 5], 0.1)])
def test_every_rank_equals_batchnorm_on_the_concatenated_batch(sizes, momentum):
    reference, xr, out_ref, results = _run_ranks(sizes, momentum)
    for rank, size in enumerate(sizes):
        got, lo = results[rank], results[rank]["lo"]
        assert got["out"].dtype == torch.float64
        torch.testing.assert_close(got["out"], out_ref[lo:lo + size].detach(), rtol=0, atol=TOL)
        torch.testing.assert_close(got["x_grad"], xr.grad[lo:lo + size], rtol=0, atol=TOL)
    for name, p_ref in reference.named_parameters():
        summed = sum(dict(r["model"].named_parameters())[name].grad for r in results)
        torch.testing.assert_close(summed, p_ref.grad, rtol=0, atol=TOL, msg=name)
    for rank in range(len(sizes)):  # every rank keeps the same running statistics as the reference
        state = results[rank]["model"].state_dict()
        assert list(state) == list(reference.state_dict())
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=TOL, msg=key)


@pytest.mark.parametrize("dtype,expected", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                            (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_statistics_are_float32_for_narrow_inputs_and_the_inputs_own_dtype_when_wider(dtype, expected):
    """bf16/fp16 activations get float32 statistics (as torch's BatchNorm kernels); a float64 model
    keeps float64 statistics, as plain BatchNorm and a world of one do, instead of float32 rounding."""
    torch.manual_seed(0)
    x = (torch.randn(6, 3, 4, dtype=torch.float64) + 1 / 3).to(dtype)
    mean, var, total = global_moments(x, lambda t: t, lambda t: t, 0)
    assert (mean.dtype, var.dtype, total) == (expected, expected, 24)
    truth = x.double().transpose(0, 1).reshape(3, -1)  # float64 moments of the same (rounded) inputs
    # moments of 24 values of magnitude < 4, rounded at most 24 * eps * 4**2 in the expected dtype (8.5e-14
    # in float64, where float32 statistics would be ~1e-7 off)
    bound = 24 * torch.finfo(expected).eps * 16
    torch.testing.assert_close(mean.double(), truth.mean(dim=1), rtol=0, atol=bound)
    torch.testing.assert_close(var.double(), truth.var(dim=1, unbiased=False), rtol=0, atol=bound)
    layer = SyncBatchNorm(3).to(dtype if dtype == torch.float64 else torch.float32)
    layer.gather, layer.reduce_sum = (lambda t: torch.cat([t, t])), (lambda t: 2 * t)
    layer.rank_world = lambda: (0, 2)  # two ranks with the same batch: the synchronised path
    assert layer(x).dtype == dtype


def test_state_dict_loads_into_the_unconverted_model_and_back():
    converted = convert(_model(), portable_from)
    plain = _model()
    plain.load_state_dict(converted.state_dict())  # strict: the same keys
    convert(_model(), portable_from).load_state_dict(plain.state_dict())


def test_conversion_shares_parameters_and_keeps_mode():
    bn = torch.nn.BatchNorm1d(3, eps=1e-3, momentum=0.2, affine=True)
    bn.eval()
    sync = portable_from(bn)
    assert sync.weight is bn.weight and sync.running_mean is bn.running_mean
    assert (sync.eps, sync.momentum, sync.training) == (1e-3, 0.2, False)
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(m, SyncBatchNorm)
                   for m in convert(_model(), portable_from).modules())
