"""The facade's contract as checks every rank runs under a real launcher: one list, :data:`CHECKS`.

``unified-dist test`` runs exactly these (``selftest_worker.py``, one table row each); the tests'
contract worker (``tests/launchers/workers/contract_worker.py``) runs them first in its ``core`` suite and
adds the checks only a test needs (error paths, gradient accumulation, loaders, checkpoints
across backends, adopting a running stack).

Every rank runs the checks in the same order, so their collectives line up; a check asserts only
after its collectives, so one failing rank does not strand the others. Expected values come from
arithmetic or from plain single-process torch, never from unified_dist itself. A check takes a
:class:`Context` and raises ``AssertionError`` (or the facade's error) on failure.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

import unified_dist as ud


@dataclass(frozen=True)
class Context:
    """What a check may rely on: a folder every rank of the launch shares, and what the launch
    should have started (``None``: not checked)."""

    out: str
    backend: Optional[str] = None
    world_size: Optional[int] = None


Check = Callable[[Context], None]


def equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    """``got`` is exactly ``expected`` (same shape, same values in ``got``'s dtype)."""
    got = got.detach().cpu()
    assert got.shape == expected.shape and torch.equal(got, expected.to(got.dtype)), \
        f"got {got.tolist()}, expected {expected.tolist()}"


def tiny_model() -> torch.nn.Module:
    """The same small regression model on every rank and in every reference."""
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def regression_data(n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` inputs and targets for :func:`tiny_model`, the same on every rank."""
    g = torch.Generator().manual_seed(7)
    return torch.randn(n, 5, generator=g), torch.randn(n, 1, generator=g)


# ----------------------------------------------------------------- the checks, in the order they run
def identity(ctx: Context) -> None:
    r, w = ud.rank(), ud.world_size()
    ranks = ud.all_gather(torch.tensor(r))
    assert ctx.backend is None or ud.backend_name() == ctx.backend, \
        f"backend {ud.backend_name()!r}, expected {ctx.backend!r}"
    assert ctx.world_size is None or w == ctx.world_size, f"world size {w}, expected {ctx.world_size}"
    assert ranks.tolist() == list(range(w)), f"ranks {ranks.tolist()}"
    assert ud.is_main() == (r == 0)
    assert 0 <= ud.local_rank() < w and ud.is_local_main() == (ud.local_rank() == 0)
    assert ud.device().type in ("cpu", "cuda")


def _all_reduce(op: str) -> Check:
    def check(ctx: Context) -> None:
        r, w = ud.rank(), ud.world_size()
        base = torch.tensor([1.0, -2.0, 3.0])
        x = base * (r + 1)
        before = x.clone()
        got = ud.all_reduce(x, op)
        default = ud.all_reduce(x) if op == "mean" else None  # mean is the default
        total = base * sum(range(1, w + 1))
        expected = {"sum": total, "mean": total / w, "max": torch.tensor([w, -2.0, 3.0 * w]),
                    "min": torch.tensor([1.0, -2.0 * w, 3.0])}[op]
        equal(got, expected)
        if default is not None:
            equal(default, expected)
        assert torch.equal(x, before), "all_reduce modified its input"
        assert got is not x, "all_reduce returned its input"
    check.__name__ = f"all_reduce_{op}"
    return check


def all_gather_even(ctx: Context) -> None:
    r, w = ud.rank(), ud.world_size()
    got = ud.all_gather(torch.full((2, 3), float(r)))
    equal(got, torch.cat([torch.full((2, 3), float(k)) for k in range(w)]))


def all_gather_uneven(ctx: Context) -> None:
    """Dim 0 differs per rank, down to an empty part on rank 0."""
    r, w = ud.rank(), ud.world_size()
    got = ud.all_gather(torch.arange(r + 1, dtype=torch.float32).reshape(-1, 1) + 10 * r)
    empty = ud.all_gather(torch.zeros((0 if r == 0 else 1, 2)))
    equal(got, torch.cat([torch.arange(k + 1, dtype=torch.float32).reshape(-1, 1) + 10 * k for k in range(w)]))
    assert empty.shape == (w - 1, 2), f"an empty part gathered to {tuple(empty.shape)}, expected {(w - 1, 2)}"


def all_gather_0d(ctx: Context) -> None:
    got = ud.all_gather(torch.tensor(float(ud.rank())))
    equal(got, torch.arange(ud.world_size(), dtype=torch.float32))


def broadcast_tensor(ctx: Context) -> None:
    r, src = ud.rank(), ud.world_size() - 1
    x = torch.arange(4.0) + 100 * r
    got = ud.broadcast(x, src=src)
    equal(got, torch.arange(4.0) + 100 * src)
    assert torch.equal(x, torch.arange(4.0) + 100 * r), "broadcast modified its input"


def broadcast_object(ctx: Context) -> None:
    r, src = ud.rank(), ud.world_size() - 1
    got = ud.broadcast({"from": r, "items": [r, "x"]}, src=src)
    assert got == {"from": src, "items": [src, "x"]}, got


def barrier(ctx: Context) -> None:
    """Ranks > 0 leave a marker late, then enter the barrier: rank 0 must find every marker after it."""
    r, w = ud.rank(), ud.world_size()
    markers = [os.path.join(ctx.out, f"barrier_rank{k}") for k in range(w)]
    if r == 0:  # left by an earlier launch into the same folder
        for marker in markers:
            if os.path.exists(marker):
                os.remove(marker)
    ud.barrier()
    if r > 0:
        time.sleep(0.2)
        open(markers[r], "w").close()
    ud.barrier()
    if r == 0:
        missing = [k for k in range(1, w) if not os.path.exists(markers[k])]
        assert not missing, f"rank 0 left the barrier before ranks {missing} reached it"


def gather_for_metrics(ctx: Context) -> None:
    """Eval loaders with ragged last batches: every sample comes back exactly once, in order."""
    w = ud.world_size()
    for n, b in ((23, 4), (7, 5), (1, 2), (16, 2), (2 * w * 2 - 1, 2)):
        data = torch.utils.data.TensorDataset(torch.arange(n), torch.arange(n) * 3)
        loader = ud.prepare(torch.utils.data.DataLoader(data, batch_size=b))
        index, tripled, plain_rows = [], [], 0
        for idx, value in loader:
            got = ud.gather_for_metrics({"idx": idx, "value": value})
            plain_rows += ud.all_gather(idx).shape[0]
            index.append(got["idx"].cpu())
            tripled.append(got["value"].cpu())
        equal(torch.cat(index), torch.arange(n))
        equal(torch.cat(tripled), torch.arange(n) * 3)
        assert n <= plain_rows <= n + w - 1, f"{plain_rows} rows for {n} samples"  # padding only evens the last step


def training_step(ctx: Context) -> None:
    """N ranks x batch b, one SGD step == one plain torch process x batch N*b."""
    w, batch = ud.world_size(), 4
    x, y = regression_data(batch * w)

    reference = tiny_model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()

    model = tiny_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)
    model, opt, loader = ud.prepare(model, opt, loader)
    for xb, yb in loader:
        with ud.accumulate(model):
            ud.backward(torch.nn.functional.mse_loss(model(xb), yb))
            opt.step()
            opt.zero_grad()
    mine = torch.cat([p.detach().cpu().reshape(-1) for p in ud.unwrap(model).parameters()])
    every = ud.all_gather(mine.reshape(1, -1))
    expected = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    assert torch.allclose(mine, expected, atol=1e-6, rtol=0), \
        f"parameters differ from the 1-process step by {(mine - expected).abs().max().item():.3g}"
    assert all(torch.equal(row.cpu(), mine) for row in every), "ranks hold different parameters"


DTYPES: Tuple[torch.dtype, ...] = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                                   torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes :func:`dtype_matrix` sends through every collective."""


def _short(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _ints(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Small non-negative integers in ``dtype``, exact in every one of :data:`DTYPES`; for bool, odd is True."""
    return values % 2 == 1 if dtype == torch.bool else values.to(dtype)


def _differs(got: torch.Tensor, expected: torch.Tensor, rule: str) -> Optional[str]:
    """What differs between ``got`` and ``expected`` (``None``: nothing). ``rule`` is the dtype ``got``
    must have: ``same`` as ``expected``; ``count`` any integer but bool; ``floating`` any floating."""
    got = got.detach().cpu()
    dtype_ok = {"same": got.dtype == expected.dtype, "count": not got.is_floating_point() and got.dtype != torch.bool,
                "floating": got.is_floating_point()}[rule]
    if not dtype_ok:
        return f"dtype {_short(got.dtype)}, expected {_short(expected.dtype) if rule == 'same' else rule}"
    if got.shape != expected.shape or not torch.equal(got.to(expected.dtype), expected):
        return f"got {got.tolist()}, expected {expected.tolist()}"
    return None


def _gathered_for_metrics(values: torch.Tensor, batch_size: int) -> torch.Tensor:
    """``gather_for_metrics`` of every batch of a prepared loader over ``values``, concatenated. A
    batch whose gather fails does not stop the loop (every rank gathers every batch); the first
    failure is raised at the end."""
    loader = ud.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(values), batch_size=batch_size))
    parts, errors = [], []
    for (batch,) in loader:
        try:
            parts.append(ud.gather_for_metrics(batch).cpu())
        except (ud.CollectiveTimeout, ud.PeerLost):
            raise
        except Exception as exc:  # reported with its dtype by the caller
            errors.append(exc)
    if errors:
        raise errors[0]
    return torch.cat(parts)


def dtype_matrix(ctx: Context) -> None:
    """Every dtype of :data:`DTYPES` through ``all_reduce`` (sum/mean/max/min), ``all_gather`` (even and
    uneven), ``gather_for_metrics`` (ragged last batch) and ``broadcast``, on small integers (exact in
    every dtype). A result keeps its dtype, except that a bool sum counts Trues (an integer) and an
    integer or bool mean is floating; a bool max is any, its min all; a uint8/int8/int16 sum past the
    dtype's range wraps modulo 2**bits. Each case that fails is named (dtype, op, what differed)."""
    r, w = ud.rank(), ud.world_size()
    src = w - 1
    failures: List[str] = []
    cases = 0

    def attempt(dtype: torch.dtype, op: str, run: Callable[[], torch.Tensor], expected: torch.Tensor,
                rule: str = "same") -> None:
        nonlocal cases
        cases += 1
        try:
            got = run()
        except (ud.CollectiveTimeout, ud.PeerLost):
            raise  # the ranks no longer line up: every later case would wait out the timeout
        except Exception as exc:  # every rank raises it alike, so later cases still line up
            lines = str(exc).strip().splitlines()
            failures.append(f"{_short(dtype)} {op}: raised {type(exc).__name__}: {lines[0] if lines else ''}")
            return
        problem = _differs(got, expected, rule)
        if problem is not None:
            failures.append(f"{_short(dtype)} {op}: {problem}")

    for dtype in DTYPES:
        is_bool, is_float = dtype == torch.bool, dtype.is_floating_point

        def row(k: int) -> torch.Tensor:  # rank k's all_reduce input, as int64
            return torch.tensor([1, 0, int(k == 0)]) if is_bool else torch.tensor([k + 1, 3, w - k])  # noqa: B023 - called within this iteration

        every = torch.stack([row(k) for k in range(w)])
        mine = _ints(row(r), dtype)
        total = every.sum(0)
        mean = total.double() / w  # integers: (w + 1) / 2 and 3, exact in every floating dtype
        attempt(dtype, "all_reduce sum", lambda: ud.all_reduce(mine, "sum"),  # noqa: B023 - called within this iteration
                total if is_bool else total.to(dtype), "count" if is_bool else "same")
        attempt(dtype, "all_reduce mean", lambda: ud.all_reduce(mine, "mean"),  # noqa: B023 - called within this iteration
                mean.to(dtype) if is_float else mean, "same" if is_float else "floating")
        attempt(dtype, "all_reduce max", lambda: ud.all_reduce(mine, "max"), every.max(0).values.to(dtype))  # noqa: B023 - called within this iteration
        attempt(dtype, "all_reduce min", lambda: ud.all_reduce(mine, "min"), every.min(0).values.to(dtype))  # noqa: B023 - called within this iteration
        if dtype in (torch.uint8, torch.int8, torch.int16):  # a sum past the range wraps, as gloo's own does
            span = 2 ** (8 * dtype.itemsize)
            big = {torch.uint8: 200, torch.int8: 100, torch.int16: 30000}[dtype]
            wrapped = (big * w) % span if dtype == torch.uint8 else (big * w + span // 2) % span - span // 2
            large = torch.tensor([big], dtype=dtype)
            attempt(dtype, "all_reduce sum past its range", lambda: ud.all_reduce(large, "sum"),  # noqa: B023 - called within this iteration
                    torch.tensor([wrapped], dtype=dtype))

        def even(k: int) -> torch.Tensor:
            return _ints(torch.arange(6).reshape(2, 3) + k, dtype)  # noqa: B023 - called within this iteration

        def uneven(k: int) -> torch.Tensor:  # k + 1 rows
            return _ints(torch.arange(2 * (k + 1)).reshape(k + 1, 2) + 3 * k, dtype)  # noqa: B023 - called within this iteration

        attempt(dtype, "all_gather even", lambda: ud.all_gather(even(r)), torch.cat([even(k) for k in range(w)]))
        attempt(dtype, "all_gather uneven", lambda: ud.all_gather(uneven(r)),
                torch.cat([uneven(k) for k in range(w)]))
        values = _ints(torch.arange(2 * w + 1) * 7 % 13, dtype)  # batches of 2: the last one is ragged
        attempt(dtype, "gather_for_metrics", lambda: _gathered_for_metrics(values, 2), values)  # noqa: B023 - called within this iteration
        sent = _ints(torch.arange(4) + r, dtype)
        attempt(dtype, "broadcast", lambda: ud.broadcast(sent, src=src), _ints(torch.arange(4) + src, dtype))  # noqa: B023 - called within this iteration
        if not torch.equal(sent, _ints(torch.arange(4) + r, dtype)):
            failures.append(f"{_short(dtype)} broadcast: modified its input")
    assert not failures, f"{len(failures)} of {cases} dtype cases failed: " + "; ".join(failures)


CHECKS: Tuple[Check, ...] = (
    identity, _all_reduce("sum"), _all_reduce("mean"), _all_reduce("max"), _all_reduce("min"),
    all_gather_even, all_gather_uneven, all_gather_0d, broadcast_tensor, broadcast_object, barrier,
    gather_for_metrics, training_step, dtype_matrix)
"""Every check in the order it runs; its ``__name__`` is its name (a self-test row, a test id)."""
