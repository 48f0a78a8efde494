"""The self-test ``unified-dist test`` runs in every rank, under a real launcher.

    <launcher> selftest_worker.py --out DIR --backend NAME --world-size N

Every rank runs the same checks in the same order, so the collectives line up; a check asserts
only after its collectives, so one failing rank does not strand the others. Expected values come
from arithmetic or from plain single-process torch, never from unified_dist itself. Each rank
rewrites ``DIR/rank<R>.json`` before and after every check, so when a launch hangs the parent
still sees which check each rank was in.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__" and sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)  # run as a script: don't let this folder's modules shadow top-level ones

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from typing import Any, Callable, Dict, List, Tuple  # noqa: E402

import torch  # noqa: E402

import unified_dist as ud  # noqa: E402


def _equal(got: torch.Tensor, expected: torch.Tensor) -> None:
    got = got.detach().cpu()
    assert got.shape == expected.shape and torch.equal(got, expected.to(got.dtype)), \
        f"got {got.tolist()}, expected {expected.tolist()}"


def _all_reduce(op: str) -> Callable[[argparse.Namespace], None]:
    def check(args: argparse.Namespace) -> None:
        r, w = ud.rank(), ud.world_size()
        base = torch.tensor([1.0, -2.0, 3.0])
        x = base * (r + 1)
        before = x.clone()
        got = ud.all_reduce(x, op)
        total = base * sum(range(1, w + 1))
        expected = {"sum": total, "mean": total / w, "max": torch.tensor([w, -2.0, 3.0 * w]),
                    "min": torch.tensor([1.0, -2.0 * w, 3.0])}[op]
        _equal(got, expected)
        assert torch.equal(x, before), "all_reduce modified its input"
    check.__name__ = f"all_reduce_{op}"
    return check


def identity(args: argparse.Namespace) -> None:
    ranks = ud.all_gather(torch.tensor(ud.rank()))
    assert ud.backend_name() == args.backend, f"backend {ud.backend_name()!r}, expected {args.backend!r}"
    assert ud.world_size() == args.world_size, f"world size {ud.world_size()}, expected {args.world_size}"
    assert ranks.tolist() == list(range(args.world_size)), f"ranks {ranks.tolist()}"


def all_gather_even(args: argparse.Namespace) -> None:
    r, w = ud.rank(), ud.world_size()
    got = ud.all_gather(torch.full((2, 3), float(r)))
    _equal(got, torch.cat([torch.full((2, 3), float(k)) for k in range(w)]))


def all_gather_uneven(args: argparse.Namespace) -> None:
    r, w = ud.rank(), ud.world_size()
    got = ud.all_gather(torch.arange(r + 1, dtype=torch.float32).reshape(-1, 1) + 10 * r)
    _equal(got, torch.cat([torch.arange(k + 1, dtype=torch.float32).reshape(-1, 1) + 10 * k for k in range(w)]))


def all_gather_0d(args: argparse.Namespace) -> None:
    got = ud.all_gather(torch.tensor(float(ud.rank())))
    _equal(got, torch.arange(ud.world_size(), dtype=torch.float32))


def broadcast_tensor(args: argparse.Namespace) -> None:
    r, src = ud.rank(), ud.world_size() - 1
    x = torch.arange(4.0) + 100 * r
    got = ud.broadcast(x, src=src)
    _equal(got, torch.arange(4.0) + 100 * src)
    assert torch.equal(x, torch.arange(4.0) + 100 * r), "broadcast modified its input"


def broadcast_object(args: argparse.Namespace) -> None:
    r, src = ud.rank(), ud.world_size() - 1
    got = ud.broadcast({"from": r, "items": [r, "x"]}, src=src)
    assert got == {"from": src, "items": [src, "x"]}, got


def barrier(args: argparse.Namespace) -> None:
    """Ranks > 0 leave a marker late, then enter the barrier: rank 0 must find every marker after it."""
    r, w = ud.rank(), ud.world_size()
    ud.barrier()
    if r > 0:
        time.sleep(0.2)
        open(os.path.join(args.out, f"barrier_rank{r}"), "w").close()
    ud.barrier()
    if r == 0:
        missing = [k for k in range(1, w) if not os.path.exists(os.path.join(args.out, f"barrier_rank{k}"))]
        assert not missing, f"rank 0 left the barrier before ranks {missing} reached it"


def gather_for_metrics(args: argparse.Namespace) -> None:
    """An eval loader whose last global batch is ragged: every sample must come back exactly once."""
    w, batch = ud.world_size(), 2
    n = batch * w * 2 - 1  # the second global batch is one sample short (split unevenly)
    data = torch.utils.data.TensorDataset(torch.arange(n), torch.arange(n) * 3)
    loader = ud.prepare(torch.utils.data.DataLoader(data, batch_size=batch))
    index, tripled = [], []
    for idx, value in loader:
        got = ud.gather_for_metrics({"idx": idx, "value": value})
        index.append(got["idx"].cpu())
        tripled.append(got["value"].cpu())
    _equal(torch.cat(index), torch.arange(n))
    _equal(torch.cat(tripled), torch.arange(n) * 3)


def _model() -> torch.nn.Module:
    torch.manual_seed(1234)
    return torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


def training_step(args: argparse.Namespace) -> None:
    """N ranks x batch b, one SGD step == one plain torch process x batch N*b."""
    w, batch = ud.world_size(), 4
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(batch * w, 5, generator=g), torch.randn(batch * w, 1, generator=g)

    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5)
    torch.nn.functional.mse_loss(reference(x), y).backward()
    ref_opt.step()

    model = _model()
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


CHECKS: List[Tuple[str, Callable[[argparse.Namespace], None]]] = [
    (fn.__name__, fn) for fn in (
        identity, _all_reduce("sum"), _all_reduce("mean"), _all_reduce("max"), _all_reduce("min"),
        all_gather_even, all_gather_uneven, all_gather_0d, broadcast_tensor, broadcast_object, barrier,
        gather_for_metrics, training_step)
]
"""Every check in the order it runs; the parent's table lists them in this order, after ``init``."""


class _Results:
    """This rank's results file, rewritten atomically after every change."""

    def __init__(self, out: str, rank: int) -> None:
        self.path = os.path.join(out, f"rank{rank}.json")
        self.data: Dict[str, Any] = {"rank": rank, "checks": {}}

    def record(self, name: str, status: str, seconds: float = 0.0, error: str = "") -> None:
        self.data["checks"][name] = {"status": status, "seconds": round(seconds, 4), "error": error}
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def _run(results: _Results, name: str, fn: Callable[[], None]) -> bool:
    results.record(name, "running")
    start = time.perf_counter()
    try:
        fn()
    except Exception as exc:  # recorded for the parent's table
        lines = str(exc).strip().splitlines()
        results.record(name, "fail", time.perf_counter() - start,
                       f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__)
        traceback.print_exc()  # the full story goes to the launcher's output
        return False
    results.record(name, "pass", time.perf_counter() - start)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    args = parser.parse_args()

    from unified_dist.detection import detect

    results = _Results(args.out, detect(os.environ).rank)  # the launcher's rank, known before joining
    if not _run(results, "init", ud.init):
        sys.exit(1)
    for name, fn in CHECKS:
        _run(results, name, lambda: fn(args))
    ud.barrier()
    ud.shutdown()


if __name__ == "__main__":
    main()
