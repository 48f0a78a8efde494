"""Horovod's torch API under a launcher: a Horovod script's ``import horovod.torch as hvd`` (the shim of
unified_dist.horovod.redirect is first on PYTHONPATH), checked against plain torch arithmetic on the
known per-rank inputs. Under torchrun/python ``hvd`` is unified_dist.horovod; under horovodrun it is real
Horovod (the shim steps aside), so the same checks pin the two to one behaviour.

Each ``@check`` function runs on every rank; the worker writes ``{name: "ok" | error}`` to
``<out>/hvd_rank<r>.json``. tests/test_horovod_compat.py launches it and asserts each check.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import horovod.torch as hvd
import torch

CHECKS = []


def check(fn):
    CHECKS.append(fn)
    return fn


def same(actual, expected, tol=0.0):
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"dtype {actual.dtype} != {expected.dtype}"
    diff = (actual.double() - expected.double()).abs().max().item() if actual.numel() else 0.0
    assert diff <= tol, f"{actual.tolist()} != {expected.tolist()} (max diff {diff})"


def x_of(r, dtype=torch.float32):
    """Rank r's input for the reductions."""
    return torch.tensor([r + 1.0, -2.0 * (r + 1), 0.5 * r + 3], dtype=torch.float64).to(dtype)


def every(fn):
    return [fn(r) for r in range(hvd.size())]


# ---------------------------------------------------------------------- (1) topology
@check
def topology_matches_the_launcher():
    expected_size = int(os.environ["EXPECTED_SIZE"])
    rank_var = next((os.environ[k] for k in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
                     if k in os.environ), "0")
    assert hvd.is_initialized()
    assert (hvd.size(), hvd.rank()) == (expected_size, int(rank_var)), (hvd.size(), hvd.rank())
    assert (hvd.local_size(), hvd.local_rank()) == (expected_size, int(rank_var))  # one host
    assert (hvd.cross_size(), hvd.cross_rank()) == (1, 0)
    assert hvd.gloo_built() and not hvd.mpi_enabled() and not hvd.ccl_built()


@check
def the_module_is_the_expected_engine():
    real = os.environ.get("HOROVOD_RANK") is not None
    import unified_dist.horovod as udh

    if real:  # the shim stepped aside, and unified_dist.horovod hands out real Horovod's functions
        assert hvd.__name__ == "horovod.torch" and udh.allreduce is hvd.allreduce, hvd.__name__
        udh.init()  # Horovod's init (already running: kept), then the facade's session adopts it
        import unified_dist as ud

        assert (ud.backend_name(), ud.world_size(), ud.rank()) == ("horovod", hvd.size(), hvd.rank())
    else:
        assert hvd is udh, hvd.__name__


# ---------------------------------------------------------------------- (2) collectives
@check
def allreduce_ops_and_scaling():
    n = hvd.size()
    xs = every(x_of)
    mine = x_of(hvd.rank())
    same(hvd.allreduce(mine), sum(xs) / n, 1e-6)  # Average is the default
    same(hvd.allreduce(mine, op=hvd.Sum), sum(xs), 1e-6)
    same(hvd.allreduce(mine, op=hvd.Min), torch.stack(xs).min(0).values)
    same(hvd.allreduce(mine, op=hvd.Max), torch.stack(xs).max(0).values)
    same(hvd.allreduce(mine, op=hvd.Product), torch.stack(xs).prod(0), 1e-5)
    same(hvd.allreduce(mine, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), sum(xs) * 0.5, 1e-6)
    same(hvd.allreduce(mine, average=False), sum(xs), 1e-6)
    same(hvd.allreduce(mine, name="named.one"), sum(xs) / n, 1e-6)
    same(hvd.allreduce(mine.double(), op=hvd.Average), (sum(xs) / n).double(), 1e-12)
    ints = every(lambda r: torch.tensor([2 * (r + 1), 10], dtype=torch.int64))
    same(hvd.allreduce(ints[hvd.rank()], op=hvd.Sum), sum(ints))
    same(mine, x_of(hvd.rank()))  # the input is not modified


@check
def in_place_async_and_grouped():
    n = hvd.size()
    xs = every(x_of)
    t = x_of(hvd.rank())
    out = hvd.allreduce_(t, op=hvd.Sum)
    same(t, sum(xs), 1e-6)
    assert out is t or torch.equal(out, t)
    handle = hvd.allreduce_async(x_of(hvd.rank()), op=hvd.Max)
    while not hvd.poll(handle):
        time.sleep(0.001)
    same(hvd.synchronize(handle), torch.stack(xs).max(0).values)
    t2 = x_of(hvd.rank())
    same(hvd.synchronize(hvd.allreduce_async_(t2)), sum(xs) / n, 1e-6)
    same(t2, sum(xs) / n, 1e-6)
    a, b = hvd.grouped_allreduce([x_of(hvd.rank()), 2 * x_of(hvd.rank())], op=hvd.Sum)
    same(a, sum(xs), 1e-6)
    same(b, 2 * sum(xs), 1e-6)
    pair = [x_of(hvd.rank()), x_of(hvd.rank())]
    hvd.grouped_allreduce_(pair)
    same(pair[1], sum(xs) / n, 1e-6)


@check
def allgather_unequal_rows():
    r, n = hvd.rank(), hvd.size()
    rows = lambda k: torch.full((k + 1, 2), float(k))  # noqa: E731 - rank k sends k+1 rows of k
    same(hvd.allgather(rows(r)), torch.cat([rows(k) for k in range(n)]))
    same(hvd.synchronize(hvd.allgather_async(rows(r).to(torch.int32))), torch.cat([rows(k) for k in range(n)]).int())
    first, second = hvd.grouped_allgather([rows(r), rows(r) * 2])
    same(second, torch.cat([rows(k) for k in range(n)]) * 2)


@check
def broadcast_from_the_last_rank():
    root = hvd.size() - 1
    mine = x_of(hvd.rank())
    same(hvd.broadcast(mine, root), x_of(root))
    same(mine, x_of(hvd.rank()))
    t = x_of(hvd.rank())
    hvd.broadcast_(t, root)
    same(t, x_of(root))
    same(hvd.synchronize(hvd.broadcast_async(x_of(hvd.rank()), 0)), x_of(0))


@check
def alltoall_with_and_without_splits():
    r, n = hvd.rank(), hvd.size()
    # rank i sends (i + j + 1) rows valued 10*i + j to rank j
    send = torch.cat([torch.full((r + j + 1, 3), 10.0 * r + j) for j in range(n)])
    splits = torch.tensor([r + j + 1 for j in range(n)], dtype=torch.int32)
    out, received = hvd.alltoall(send, splits=splits)
    same(out, torch.cat([torch.full((i + r + 1, 3), 10.0 * i + r) for i in range(n)]))
    same(received, torch.tensor([i + r + 1 for i in range(n)], dtype=torch.int32))
    even = torch.arange(2 * n, dtype=torch.float32) + 100 * r
    same(hvd.alltoall(even), torch.cat([torch.arange(2 * r, 2 * r + 2, dtype=torch.float32) + 100 * i
                                        for i in range(n)]))


@check
def reducescatter_average_and_sum():
    r, n = hvd.rank(), hvd.size()
    full = [torch.arange(12, dtype=torch.float32).reshape(6, 2) * (k + 1) for k in range(n)]
    total = sum(full)
    rows = 6 // n
    same(hvd.reducescatter(full[r]), (total / n)[r * rows:(r + 1) * rows], 1e-6)
    same(hvd.reducescatter(full[r], op=hvd.Sum), total[r * rows:(r + 1) * rows], 1e-6)


@check
def mismatched_shapes_are_an_error_on_every_rank():
    """Horovod refuses ranks that disagree on a tensor's shape or dtype (never a silent mix of bytes)."""
    r = hvd.rank()
    if hvd.size() == 1:
        return
    for call in (lambda: hvd.allreduce(torch.ones(r + 2)), lambda: hvd.broadcast(torch.ones(r + 2), 0),
                 lambda: hvd.allreduce(torch.ones(2, dtype=torch.float32 if r == 0 else torch.int32), op=hvd.Sum)):
        try:
            call()
        except RuntimeError:
            continue
        raise AssertionError("a mismatch across ranks did not raise")
    same(hvd.allreduce(x_of(r), op=hvd.Sum), sum(every(x_of)), 1e-6)  # and the job goes on


@check
def barrier_returns():
    hvd.barrier()


@check
def gradients_flow_as_horovods():
    r, n = hvd.rank(), hvd.size()
    # upstream gradients are contiguous here: real Horovod refuses an expanded one (what .sum() sends
    # back), see our_engine_takes_any_gradient_layout
    x = x_of(r).requires_grad_()
    (hvd.allreduce(x, op=hvd.Sum) * torch.ones(3)).sum().backward()
    same(x.grad, torch.full((3,), float(n)))
    x = x_of(r).requires_grad_()
    (hvd.allreduce(x) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    same(x.grad, torch.tensor([1.0, 2.0, 3.0]), 1e-6)
    y = torch.ones(r + 1, 2, requires_grad=True)
    total = sum(k + 1 for k in range(n))
    weights = torch.arange(total * 2, dtype=torch.float32).reshape(total, 2)
    (hvd.allgather(y) * weights).sum().backward()
    start = sum(k + 1 for k in range(r))
    same(y.grad, weights[start:start + r + 1])
    z = x_of(r).requires_grad_()
    (hvd.broadcast(z, 0) * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    same(z.grad, torch.tensor([1.0, 2.0, 3.0]) if r == 0 else torch.zeros(3))


@check
def our_engine_takes_any_gradient_layout():
    """A difference, in our favour: the expanded gradient of ``.sum()`` reaches the allreduce's backward,
    which real Horovod refuses (``ValueError: Tensor is required to be contiguous``)."""
    if os.environ.get("HOROVOD_RANK") is not None:
        return
    x = x_of(hvd.rank()).requires_grad_()
    hvd.allreduce(x, op=hvd.Sum).sum().backward()
    same(x.grad, torch.full((3,), float(hvd.size())))


# ---------------------------------------------------------------------- (3) state broadcasts
@check
def broadcast_parameters_and_objects():
    torch.manual_seed(100 + hvd.rank())
    model = torch.nn.Linear(4, 3)
    torch.manual_seed(100)
    reference = torch.nn.Linear(4, 3)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for a, b in zip(model.parameters(), reference.parameters()):
        same(a.detach(), b.detach())
    assert hvd.broadcast_object({"from": hvd.rank(), "f": (lambda v: v + 1)}, root_rank=0)["from"] == 0
    assert hvd.allgather_object({"r": hvd.rank()}) == [{"r": k} for k in range(hvd.size())]


@check
def broadcast_optimizer_state_takes_root_values():
    """A state with tensors (momentum) and options (lr, momentum) from rank 0; SGD, not Adam: Adam's
    constructor imports torch._dynamo (seconds)."""
    r = hvd.rank()
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.9 - 0.1 * r)
    model(x_of(r)).sum().backward()
    opt.step()  # a local step: each rank's momentum buffer is its own gradient x_r
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    assert (opt.param_groups[0]["lr"], opt.param_groups[0]["momentum"]) == (0.1, 0.9), opt.param_groups[0]
    same(opt.state[model.weight]["momentum_buffer"].reshape(-1), x_of(0))


@check
def broadcast_optimizer_state_steps_an_empty_state_once():
    """Horovod's rule: an optimizer without state first steps once on zero gradients, on every rank with
    its own options (here weight decay moves each rank's weights by its own lr), then takes rank 0's."""
    r = hvd.rank()
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1 * (r + 1), momentum=0.5, weight_decay=0.5)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    same(model.weight.detach(), torch.full((1, 3), 1.0 - 0.1 * (r + 1) * 0.5), 1e-7)
    same(opt.state[model.weight]["momentum_buffer"], torch.full((1, 3), 0.5), 1e-7)  # rank 0's: wd * w = 0.5
    assert opt.param_groups[0]["lr"] == 0.1


# ---------------------------------------------------------------------- (4) DistributedOptimizer
def _trained(passes, op=None, compression=None, predivide=1.0, lr=0.1):
    """A Linear(3, 1) from ones, each rank's loss sum(model(x)) over its own inputs, ``passes`` backward
    passes per step, one step; returns the weight."""
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    kwargs = {"op": op} if op is not None else {}
    if compression is not None:
        kwargs["compression"] = compression
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr),
                                   named_parameters=model.named_parameters(), backward_passes_per_step=passes,
                                   gradient_predivide_factor=predivide, **kwargs)
    for k in range(passes):
        model(x_of(hvd.rank()) * (k + 1)).sum().backward()
    opt.step()
    opt.zero_grad()
    return model.weight.detach().reshape(-1)


def _expected(passes, reduce):
    """What one SGD step gives: the gradient of pass k on rank r is x_r * (k+1); passes are summed."""
    grads = [sum(x_of(r) * (k + 1) for k in range(passes)) for r in range(hvd.size())]
    return torch.ones(3) - 0.1 * reduce(grads)


@check
def distributed_optimizer_averages():
    n = hvd.size()
    same(_trained(1), _expected(1, lambda g: sum(g) / n), 1e-6)
    same(_trained(1, op=hvd.Sum), _expected(1, sum), 1e-6)
    same(_trained(1, predivide=2.0), _expected(1, lambda g: sum(g) / n), 1e-6)


@check
def distributed_optimizer_accumulates_backward_passes():
    n = hvd.size()
    same(_trained(2), _expected(2, lambda g: sum(g) / n), 1e-6)
    same(_trained(3, op=hvd.Sum), _expected(3, sum), 1e-5)


@check
def distributed_optimizer_fp16_compression():
    n = hvd.size()
    same(_trained(1, compression=hvd.Compression.fp16), _expected(1, lambda g: sum(g) / n), 2e-3)


@check
def ranks_reaching_different_parameters_reduce_correctly():
    """Rank r's loss reaches only head r % 2 (Horovod's test_force_allreduce case): each head's gradient is
    the average of the ranks that reached it and zeros from the others."""
    n = hvd.size()
    heads = torch.nn.ModuleList([torch.nn.Linear(3, 1, bias=False) for _ in range(2)])
    with torch.no_grad():
        for head in heads:
            head.weight.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(heads.parameters(), lr=0.1),
                                   named_parameters=heads.named_parameters())
    heads[hvd.rank() % 2](x_of(hvd.rank())).sum().backward()
    opt.step()
    for k, head in enumerate(heads):
        grad = sum((x_of(r) for r in range(n) if r % 2 == k), torch.zeros(3)) / n
        same(head.weight.detach().reshape(-1), torch.ones(3) - 0.1 * grad, 1e-6)


@check
def synchronize_then_skip_synchronize():
    n = hvd.size()
    model = torch.nn.Linear(3, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    assert isinstance(opt, torch.optim.SGD)
    model(x_of(hvd.rank())).sum().backward()
    if n > 1:
        try:
            opt.zero_grad()
        except AssertionError:
            pass
        else:
            raise AssertionError("zero_grad() between backward and step did not raise")
    opt.synchronize()
    same(model.weight.grad.reshape(-1), sum(every(x_of)) / n, 1e-6)
    with opt.skip_synchronize():
        opt.step()
    same(model.weight.detach().reshape(-1), torch.ones(3) - 0.1 * sum(every(x_of)) / n, 1e-6)


# ---------------------------------------------------------------------- (5) process sets, SyncBatchNorm, names
@check
def process_sets_reduce_over_their_ranks():
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        return  # a set of the one rank would duplicate the global set (refused, as by Horovod)
    singles = [hvd.add_process_set([k]) for k in range(n)]
    mine = singles[r]
    assert mine.included() and not singles[(r + 1) % n].included()
    assert (mine.size(), mine.rank(), hvd.global_process_set.size()) == (1, 0, n)
    same(hvd.allreduce(x_of(r), op=hvd.Sum, process_set=mine), x_of(r))
    same(hvd.allgather(x_of(r), process_set=mine), x_of(r))
    same(hvd.allreduce(x_of(r), op=hvd.Sum, process_set=hvd.global_process_set), sum(every(x_of)), 1e-6)
    for ps in singles:
        assert hvd.remove_process_set(ps)
    assert not hvd.remove_process_set(hvd.global_process_set)


@check
def sync_batchnorm_normalises_over_the_global_batch():
    """Ours runs on CPU and equals BatchNorm over every rank's rows; real Horovod's refuses CPU tensors."""
    r, n = hvd.rank(), hvd.size()
    batch = lambda k: torch.arange(6 * (k + 1), dtype=torch.float32).reshape(2 * (k + 1), 3) * (k + 1)  # noqa: E731
    bn = hvd.SyncBatchNorm(3)
    if os.environ.get("HOROVOD_RANK") is not None:
        try:
            bn(batch(r))
        except ValueError as exc:
            assert "GPU" in str(exc)
            return
        raise AssertionError("real Horovod's SyncBatchNorm ran on CPU tensors")
    reference = torch.nn.BatchNorm1d(3)
    full = reference(torch.cat([batch(k) for k in range(n)]))
    start = sum(2 * (k + 1) for k in range(r))
    same(bn(batch(r)), full[start:start + 2 * (r + 1)].detach(), 1e-5)
    same(bn.running_mean, reference.running_mean, 1e-6)
    same(bn.running_var, reference.running_var, 1e-5)


# issue 58's checks run before the by-name checks: after a_second_operation_under_a_queued_name_is_a_value_error
# real Horovod's handle counts differ across ranks, and its unnamed operations no longer pair
@check
def grouped_requests_of_different_counts_raise_on_every_rank():
    """Issue 58: rank 0 grouped_allreduce([a, b]), rank 1 grouped_allreduce([a, b, c]): both raise, naming
    each rank's request, and a following allreduce(d) sums the d's (it summed rank 0's d with rank 1's c).
    Real Horovod waits forever here (FACTS.md, 2026-11-28)."""
    if os.environ.get("HOROVOD_RANK") is not None or hvd.size() == 1:
        return
    r, n = hvd.rank(), hvd.size()
    for name in (None, "grouped.counts"):
        tensors = [torch.ones(3), torch.full((3,), 10.0)] + ([torch.full((3,), 200.0)] if r > 0 else [])
        try:
            hvd.grouped_allreduce(tensors, op=hvd.Sum, name=name)
        except RuntimeError as exc:
            message = str(exc)
            assert type(exc).__name__ == "HorovodInternalError" and "\n" not in message, message
            assert "rank 0: grouped allreduce of 2 tensors" in message, message
            assert "rank 1: grouped allreduce of 3 tensors" in message, message
        else:
            raise AssertionError("grouped requests of different counts did not raise")
        d = torch.full((3,), 1000.0 * (r + 1))
        same(hvd.allreduce(d, op=hvd.Sum), torch.full((3,), 1000.0 * n * (n + 1) / 2))


@check
def more_queued_names_than_a_row_carries_still_pair():
    """Issue 58: rank 0 queues SLOTS + 6 names, rank 1 only the last 6 and synchronizes one of them: the
    rows carry the first 64 names only, which once gave a false "cannot be paired" error."""
    r, n = hvd.rank(), hvd.size()
    names = [f"many.{i}" for i in range(70)]
    value = lambda i: torch.tensor([float(i + r)])  # noqa: E731
    if r == 0:
        handles = {k: hvd.allreduce_async(value(i), name=k, op=hvd.Sum) for i, k in enumerate(names)}
    else:
        handles = {k: hvd.allreduce_async(value(i), name=k, op=hvd.Sum) for i, k in enumerate(names) if i >= 64}
        handles[names[-1]] = hvd.synchronize(handles[names[-1]])  # its result
        handles.update({k: hvd.allreduce_async(value(i), name=k, op=hvd.Sum) for i, k in enumerate(names) if i < 64})
    for i, k in enumerate(names):
        result = handles[k] if isinstance(handles[k], torch.Tensor) else hvd.synchronize(handles[k])
        same(result, torch.tensor([float(n * i + n * (n - 1) / 2)]))


@check
def alltoall_of_no_rows_and_non_contiguous_tensors():
    """Issue 58: an alltoall where rank 0 sends no rows, and collectives of non-contiguous tensors (once a
    local error inside the transfer on one rank, the other rank left waiting)."""
    r, n = hvd.rank(), hvd.size()
    send = torch.full((0, 2), 5.0) if r == 0 else torch.arange(2.0 * n).reshape(n, 2) + 10 * r
    splits = torch.tensor([0] * n if r == 0 else [1] * n, dtype=torch.int32)
    out, received = hvd.alltoall(send, splits=splits)
    same(received, torch.tensor([0] + [1] * (n - 1), dtype=torch.int32))
    same(out, torch.cat([torch.arange(2.0 * r, 2.0 * r + 2).reshape(1, 2) + 10 * k for k in range(1, n)]))
    base = lambda k: torch.arange(6.0).reshape(2, 3) * (k + 1)  # noqa: E731
    total = sum(base(k) for k in range(n))
    if os.environ.get("HOROVOD_RANK") is not None:
        try:
            hvd.allreduce(base(r).t(), op=hvd.Sum)
        except ValueError as exc:  # real Horovod refuses them on the calling rank (every rank here)
            assert "contiguous" in str(exc), exc
            return
    # the odd ranks' tensors are transposed views, the even ranks' the same values laid out contiguously:
    # moving raw memory would mix elements of different positions
    mine = lambda: base(r).t() if r % 2 else base(r).t().contiguous()  # noqa: E731
    assert mine().is_contiguous() == (r % 2 == 0)
    same(hvd.allreduce(mine(), op=hvd.Sum), total.t())
    inplace = mine()
    hvd.allreduce_(inplace, op=hvd.Sum)
    same(inplace, total.t())
    cast = mine()
    hvd.broadcast_(cast, root_rank=n - 1)
    same(cast, base(n - 1).t())
    same(hvd.allgather(mine()), torch.cat([base(k).t() for k in range(n)]))


@check
def alltoall_splits_not_int32_raise_on_every_rank_whatever_they_hold():
    """Issue 58 item 9: Horovod's test_horovod_alltoall_splits_type_error passes ``torch.empty(size,
    dtype=torch.float32)`` as splits; where its garbage read as valid counts on one rank only, that rank
    started the alltoall, the others raised, and the ranks stayed one operation apart for the rest of the
    suite (22 failures). Horovod refuses a splits tensor that is not int32 before reading it: every rank."""
    r, n = hvd.rank(), hvd.size()
    splits = torch.ones(n, dtype=torch.float32) if r == 0 else torch.full((n,), 7.0)  # valid counts on rank 0
    try:
        hvd.alltoall(torch.zeros(n), splits)
        raise AssertionError("an alltoall with float32 splits did not raise")
    except ValueError:
        pass
    same(hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum), torch.tensor([n * (n + 1) / 2.0]))  # in step


@check
def an_argument_error_on_one_rank_raises_on_every_rank_and_keeps_them_in_step():
    """Issue 58 item 8: splits invalid on rank 0 only. Rank 0 raises its ValueError before sending; the
    others raise too (HorovodInternalError, the rows say rank 0 refused), instead of pairing their alltoall
    with rank 0's next one. Real Horovod pairs them (the others' result then holds rank 0's next data, and
    every later operation is one apart): a difference in our favour, so ours only."""
    if os.environ.get("HOROVOD_RANK") is not None:
        return
    r, n = hvd.rank(), hvd.size()
    rows = torch.arange(2.0 * n) + 100 * r  # 2 rows to each rank
    bad = torch.full((n,), -1, dtype=torch.int32) if r == 0 else torch.full((n,), 2, dtype=torch.int32)
    try:
        hvd.alltoall(rows, bad)
        raise AssertionError("an alltoall with splits invalid on rank 0 did not raise here")
    except (ValueError, hvd.HorovodInternalError) as exc:
        expected = ValueError if r == 0 else hvd.HorovodInternalError
        assert type(exc) is expected, f"{type(exc).__name__}: {exc}"
        assert r == 0 or "[0] raised an argument error" in str(exc), str(exc)
    got, _ = hvd.alltoall(rows, torch.full((n,), 2, dtype=torch.int32))
    same(got, torch.cat([torch.arange(2.0 * r, 2.0 * r + 2) + 100 * s for s in range(n)]))  # in step


@check
def named_operations_pair_by_name_in_any_order():
    """Ranks issue the same named operations in opposite orders: each pairs with its name (Horovod's
    negotiation), never with whatever the other rank issued at the same position."""
    r, n = hvd.rank(), hvd.size()
    a, b = torch.tensor([1.0 + r]), torch.tensor([100.0 * (1 + r)])
    if r % 2 == 0:
        ha, hb = hvd.allreduce_async(a, name="swap.a", op=hvd.Sum), hvd.allreduce_async(b, name="swap.b", op=hvd.Sum)
    else:
        hb, ha = hvd.allreduce_async(b, name="swap.b", op=hvd.Sum), hvd.allreduce_async(a, name="swap.a", op=hvd.Sum)
    first, second = (ha, hb) if r % 2 == 0 else (hb, ha)
    results = {first: hvd.synchronize(first), second: hvd.synchronize(second)}
    same(results[ha], torch.tensor([sum(1.0 + k for k in range(n))]))
    same(results[hb], torch.tensor([sum(100.0 * (1 + k) for k in range(n))]))
    # different kinds and shapes, crossed, with an unnamed operation issued in between
    rows = torch.full((r + 1, 2), float(r))
    if r % 2 == 0:
        hg = hvd.allgather_async(rows, name="swap.gather")
        hc = hvd.broadcast_async(torch.tensor([float(r), 7.0]), root_rank=0, name="swap.bcast")
    else:
        hc = hvd.broadcast_async(torch.tensor([float(r), 7.0]), root_rank=0, name="swap.bcast")
        hg = hvd.allgather_async(rows, name="swap.gather")
    same(hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum), torch.tensor([float(n)]))
    done = {h: hvd.synchronize(h) for h in ((hc, hg) if r % 2 else (hg, hc))}
    same(done[hg], torch.cat([torch.full((k + 1, 2), float(k)) for k in range(n)]))
    same(done[hc], torch.tensor([0.0, 7.0]))


@check
def a_second_operation_under_a_queued_name_is_a_value_error():
    """Horovod's duplicate-name error: raised at once, nothing sent; the name is free once its operation ran."""
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        return
    tensor = torch.full((3,), float(r))
    if r == 0:
        hvd.allreduce_async(tensor, name="dup.name", op=hvd.Sum)
        try:
            hvd.allreduce_async(tensor, name="dup.name")
        except ValueError:
            pass
        else:
            raise AssertionError("a second allreduce_async under a queued name did not raise")
    hvd.barrier()
    if r > 0:
        handle = hvd.allreduce_async(tensor, name="dup.name", op=hvd.Sum)
        same(hvd.synchronize(handle), torch.full((3,), float(sum(range(n)))))
    hvd.barrier()
    same(hvd.allgather(torch.tensor([r]), name="dup.name"), torch.arange(n))  # free again


@check
def operations_that_cannot_be_paired_raise_on_every_rank_naming_them():
    """Rank 0 waits for a name rank 1 has not queued while rank 1 blocks in an unnamed allreduce: Horovod
    would wait forever; here both raise one line naming both operations, and the job goes on."""
    if os.environ.get("HOROVOD_RANK") is not None or hvd.size() == 1:
        return  # real Horovod hangs here (its stall warning only)
    r = hvd.rank()
    handle = hvd.allreduce_async(torch.ones(1), name="only.rank0", op=hvd.Sum) if r == 0 else None
    try:
        if r == 0:
            hvd.synchronize(handle)
        else:
            hvd.allreduce(torch.ones(1))
    except RuntimeError as exc:
        message = str(exc)
        assert "\n" not in message and "'only.rank0'" in message and "unnamed allreduce" in message, message
    else:
        raise AssertionError("an unpairable pair of operations did not raise")
    if r > 0:
        handle = hvd.allreduce_async(torch.ones(1), name="only.rank0", op=hvd.Sum)
    same(hvd.synchronize(handle), torch.tensor([float(hvd.size())]))


# ---------------------------------------------------------------------- (6) elastic
@check
def elastic_state_syncs_commits_and_restores():
    import horovod.torch.elastic as elastic

    r = hvd.rank()
    torch.manual_seed(r)
    model = torch.nn.Linear(2, 2)
    torch.manual_seed(0)
    reference = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = elastic.TorchState(model=model, optimizer=opt, epoch=10 + r)

    @elastic.run
    def train(state):
        return state.epoch

    assert train(state) == 10  # rank 0's
    same(model.weight.detach(), reference.weight.detach())
    state.epoch = 5
    state.commit()
    state.epoch = 7
    state.restore()
    assert state.epoch == 5


@check
def elastic_sampler_skips_recorded_batches():
    import horovod.torch.elastic as elastic

    r, n = hvd.rank(), hvd.size()
    sampler = elastic.ElasticSampler(list(range(10 * n)), shuffle=False)
    assert list(sampler) == list(range(r, 10 * n, n))
    sampler.record_batch(0, 2)
    sampler.load_state_dict(sampler.state_dict())
    assert list(sampler) == list(range(2 * n + r, 10 * n, n))


# ---------------------------------------------------------------------- (7) join, last: real Horovod names an
# unnamed operation by its handle count, which the ranks' different work around a join leaves unequal
@check
def join_returns_the_last_rank_to_join():
    """Rank 0 joins at once; the others first run a named and an unnamed allreduce, which it answers."""
    r = hvd.rank()
    if r > 0:
        hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="before.join"))
        hvd.allreduce(torch.ones(2))
    last = hvd.join()
    assert last != 0 or hvd.size() == 1, last
    assert hvd.allgather_object(last) == [last] * hvd.size()


@check
def joined_ranks_answer_allreduces_with_zeros_and_refuse_the_rest():
    """Horovod's join: the joined rank adds zeros (Average still divides by the full size, integers
    truncate); an allgather or a broadcast while a rank is joined raises on the others."""
    r, n = hvd.rank(), hvd.size()
    if n == 1:
        return
    ints = torch.tensor([1, 8, 15, -29], dtype=torch.int32)
    floats = torch.tensor([[1.5, -3.0], [9.0, 0.25]], dtype=torch.float64)
    for first in range(n):
        if r == first:
            last = hvd.join()
        else:
            try:
                ha = hvd.allreduce_async(ints, name="join.ints", average=True)
                hb = hvd.allreduce_async(floats, name="join.floats", average=True)
                same(hvd.synchronize(ha), torch.div(ints * (n - 1), n, rounding_mode="trunc"))
                same(hvd.synchronize(hb), floats * (n - 1) / n)
                same(hvd.allreduce(floats, op=hvd.Sum), floats * (n - 1))
                for refused in (lambda: hvd.allgather(floats), lambda: hvd.broadcast(floats, r, name="join.bcast")):
                    try:
                        refused()
                    except RuntimeError:
                        continue
                    raise AssertionError("a collective other than allreduce ran while a rank had joined")
            finally:
                last = hvd.join()  # also after a failed assertion: the joined rank is waiting for it
        assert last != first, (last, first)
        assert hvd.allgather_object(last) == [last] * n


@check
def distributed_optimizer_with_uneven_steps_joins():
    """Issue 58, Horovod's idiom for uneven data: rank 0 trains 6 steps, the others 3, each then calls
    hvd.join(); the joined ranks answer the gradient reductions with zeros (Average still divides by the
    full size) and each rank keeps its own weights. Expected: a one-process float64 replay in plain torch."""
    r, n = hvd.rank(), hvd.size()
    steps = lambda k: 6 if k == 0 else 3  # noqa: E731
    inputs = lambda k, step: (x_of(k, torch.float64) * (step + 1)).reshape(1, 3)  # noqa: E731
    target = lambda k, step: torch.tensor([[0.5 * k - step]], dtype=torch.float64)  # noqa: E731

    def fresh():
        model = torch.nn.Linear(3, 1, bias=False).double()
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[0.3, -0.2, 0.1]], dtype=torch.float64))
        return model

    def loss(model, k, step):
        return ((model(inputs(k, step)) - target(k, step)) ** 2).sum()

    model = fresh()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.5),
                                   named_parameters=model.named_parameters())
    start = time.monotonic()
    for step in range(steps(r)):
        opt.zero_grad()
        loss(model, r, step).backward()
        opt.step()
    last = hvd.join()
    seconds = time.monotonic() - start
    # the replay: every rank's copy of the model, the gradient of a step the average over the ranks still
    # training of their own gradient at their own weights, zeros from the joined ones
    replicas = [fresh() for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.5) for m in replicas]
    for step in range(max(steps(k) for k in range(n))):
        training = [k for k in range(n) if step < steps(k)]
        grads = []
        for k in training:
            replicas[k].zero_grad()
            loss(replicas[k], k, step).backward()
            grads.append(replicas[k].weight.grad.clone())
        for k in training:
            replicas[k].weight.grad = sum(grads) / n
            opts[k].step()
    assert last == 0, last  # rank 0 joined last
    same(model.weight.detach(), replicas[r].weight.detach(), 1e-12)
    if r > 0:  # the joined rank kept the weights of its own 3 steps
        assert not torch.equal(model.weight.detach(), replicas[0].weight.detach())
    assert seconds < 60, f"{seconds:.1f} s"


# the last check: it leaves the global process set refused on every rank (what it checks)
@check
def a_transfer_that_fails_on_one_rank_raises_on_every_rank_at_once():
    """Issue 58 item 8: rank 1 cannot allocate the output of an alltoall that sends it 64 MiB (an address-space
    limit set on rank 1 only, inside the transfer after the ranks agreed to run it). Rank 1 raises at once; rank 0,
    blocked in its share, raised only at the collective timeout (60.0 s with UNIFIED_DIST_TIMEOUT=60, measured
    before the fix); now both raise HorovodInternalError in one line naming rank 1, the request and the error,
    within seconds, and every later operation is refused on both in one line. Real Horovod 0.28.1 under
    horovodrun -np 2 --gloo, same failure: rank 1 raised at once, rank 0 after gloo's 30 s timeout, then every
    later operation raised "Horovod has been shut down" (measured by hand: it costs 30 s, so ours only)."""
    if os.environ.get("HOROVOD_RANK") is not None or hvd.size() == 1:
        return
    import resource

    import torch.distributed as dist

    r, n = hvd.rank(), hvd.size()
    rows = 64 * 2 ** 20 // 8  # float64 rows: 64 MiB from rank 0 to rank 1
    send = torch.zeros(rows if r == 0 else 0, dtype=torch.float64)
    splits = torch.tensor([0] * n, dtype=torch.int32)
    if r == 0:
        splits[1] = rows
    limit = resource.getrlimit(resource.RLIMIT_AS)
    start = time.monotonic()
    try:
        if r == 1:  # 16 MiB more address space than this process holds now: the 64 MiB output cannot be had
            held = int(next(line for line in open("/proc/self/status") if line.startswith("VmSize")).split()[1])
            cap = held * 1024 + 16 * 2 ** 20
            resource.setrlimit(resource.RLIMIT_AS, (cap if limit[1] < 0 else min(cap, limit[1]), limit[1]))
        hvd.alltoall(send, splits)
        raise AssertionError(f"rank {r}: the alltoall rank 1 cannot receive returned")
    except hvd.HorovodInternalError as exc:
        seconds, message = time.monotonic() - start, str(exc)
    finally:
        resource.setrlimit(resource.RLIMIT_AS, limit)
    # prompt: seconds, against the session's 600 s collective timeout (and real Horovod's 30 s)
    assert seconds < 20, f"rank {r} raised after {seconds:.1f} s: {message}"
    assert "\n" not in message and "failed on rank 1" in message and "alltoall" in message, message
    assert "allocate" in message, message
    later = {"allreduce": lambda: hvd.allreduce(torch.ones(2)),
             "named allreduce": lambda: hvd.synchronize(hvd.allreduce_async(torch.ones(2), name="after.failure")),
             "allgather": lambda: hvd.allgather(torch.ones(2)), "broadcast": lambda: hvd.broadcast(torch.ones(2), 0),
             "barrier": hvd.barrier, "join": hvd.join}
    for what, operation in later.items():
        start = time.monotonic()
        try:
            operation()
            raise AssertionError(f"rank {r}: {what} ran after the failure")
        except hvd.HorovodInternalError as exc:
            refused = str(exc)
        assert time.monotonic() - start < 5, f"{what} took {time.monotonic() - start:.1f} s to be refused"
        assert "\n" not in refused and "refused" in refused and "failed on rank 1" in refused, refused
    dist.barrier()  # on the default group: rank 1 stays alive (its connections open) until rank 0 has raised


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    results, seconds = {}, {}
    for fn in CHECKS:
        try:
            start = time.perf_counter()
            fn()
            results[fn.__name__] = "ok"
            seconds[fn.__name__] = round(time.perf_counter() - start, 3)
        except Exception as exc:  # recorded, and the other checks still run (in the same order on every rank)
            results[fn.__name__] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"
    Path(args.out, f"hvd_rank{hvd.rank()}.json").write_text(json.dumps(results))
    Path(args.out, f"hvd_seconds{hvd.rank()}.json").write_text(json.dumps(seconds))
    hvd.shutdown()
    sys.exit(0)


if __name__ == "__main__":
    main()
