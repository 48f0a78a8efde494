"""Microseconds per call of small unified_dist.horovod collectives (4 floats) under torchrun x 2: unnamed
allreduce, named allreduce, allgather and barrier, and per ``DistributedOptimizer`` step of a small MLP
(3 Linear layers, 6 gradients; zero_grad, forward, backward, step); the median of 5 timings of 300
calls, printed by rank 0.

Run against two checkouts in alternation to see what the by-name negotiation (issue 50) or the step's
one tick that lets a joined rank answer the gradient reductions (issue 58) costs::

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> torchrun --nproc_per_node 2 bench/horovod/hvd_negotiation_cost.py <label>

Within one run it also pairs blocks of 50 steps with and without the step's tick (``step_without_tick``:
``gradient_step`` patched out, which is what a step cost before issue 58), alternating, so both halves
see the same load: ``step_tick_ratio`` is the median over 10 pairs of (with / without). On a machine
shared by other work this paired ratio is the number to read; the absolute timings move with the load.

``--out FILE`` (the code since issue 58): rank 0 writes a results file with the machine's record
(bench/shared/provenance.py: commit, command, CPU, load and steal around the run), the timings, and ``--repeat N``
rounds of the paired ratio (10 pairs each, default 3), so the ratio is read over several rounds, not one::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 bench/horovod/hvd_negotiation_cost.py new --repeat 3 \
        --out bench/horovod/results/negotiation_cost.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

import unified_dist.horovod as hvd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("label", nargs="?", default="run")
    parser.add_argument("--out", default=None, help="results file (rank 0 writes it)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of 10 paired blocks (default 3)")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "shared"))
    import provenance  # bench/shared/provenance.py

    record = provenance.start()
    hvd.init()
    x = torch.ones(4)
    for _ in range(50):
        hvd.allreduce(x)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    batch = torch.randn(16, 32)

    def step(i: int) -> None:
        opt.zero_grad()
        model(batch).sum().backward()
        opt.step()
    calls = (("unnamed", lambda i: hvd.allreduce(x)), ("named", lambda i: hvd.allreduce(x, name=f"n{i % 7}")),
             ("allgather", lambda i: hvd.allgather(x)), ("barrier", lambda i: hvd.barrier()), ("step", step))
    best = {}
    for what, fn in calls:
        timings = []
        for _ in range(5):
            start = time.perf_counter()
            for i in range(300):
                fn(i)
            timings.append((time.perf_counter() - start) / 300 * 1e6)
        best[what] = round(sorted(timings)[2], 1)
    from unified_dist.horovod import _ops

    rounds = []
    if hasattr(_ops, "gradient_step"):  # the code since issue 58: pair steps with and without its tick
        ticking = _ops.gradient_step
        for _ in range(args.repeat):
            ratios = []
            for pair in range(10):
                timed = {}
                for with_tick in ((True, False) if pair % 2 == 0 else (False, True)):  # each first in half the pairs
                    _ops.gradient_step = ticking if with_tick else (lambda *a: None)
                    begin = time.perf_counter()
                    for i in range(50):
                        step(i)
                    timed[with_tick] = (time.perf_counter() - begin) / 50 * 1e6
                ratios.append(timed[True] / timed[False])
            rounds.append(round(sorted(ratios)[len(ratios) // 2], 3))
        _ops.gradient_step = ticking
        best["step_tick_ratio"] = sorted(rounds)[len(rounds) // 2]
    if hvd.rank() == 0:
        print(args.label, "median of 5 x 300 calls, us per call:", best, "rounds:", rounds, flush=True)
        if args.out:
            record.update(what="unified_dist.horovod under torchrun x 2 on gloo/CPU: microseconds per call (median "
                               "of 5 x 300) and, per round, the median over 10 pairs of 50-step blocks of a 3-layer "
                               "MLP's DistributedOptimizer step with / without issue 58's negotiation tick",
                          us_per_call={k: v for k, v in best.items() if k != "step_tick_ratio"},
                          step_tick_ratio_per_round=rounds, step_tick_ratio_median=best.get("step_tick_ratio"))
            Path(args.out).write_text(json.dumps(provenance.finish(record), indent=1) + "\n")
    hvd.shutdown()


if __name__ == "__main__":
    main()
