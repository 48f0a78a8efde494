"""Microseconds per call of small unified_dist.horovod collectives (4 floats) under torchrun x 2: unnamed
allreduce, named allreduce, allgather and barrier; the median of 5 timings of 300 calls, printed by rank 0.

Run against two checkouts in alternation to see what the by-name negotiation (issue 50) costs::

    OMP_NUM_THREADS=1 PYTHONPATH=<checkout> torchrun --nproc_per_node 2 bench/hvd_negotiation_cost.py <label>

Not a results file of its own: the closing note of issue 50 gives one such comparison (5 alternating pairs).
"""
from __future__ import annotations

import sys
import time

import torch

import unified_dist.horovod as hvd


def main() -> None:
    hvd.init()
    x = torch.ones(4)
    for _ in range(50):
        hvd.allreduce(x)
    calls = (("unnamed", lambda i: hvd.allreduce(x)), ("named", lambda i: hvd.allreduce(x, name=f"n{i % 7}")),
             ("allgather", lambda i: hvd.allgather(x)), ("barrier", lambda i: hvd.barrier()))
    best = {}
    for what, fn in calls:
        timings = []
        for _ in range(5):
            start = time.perf_counter()
            for i in range(300):
                fn(i)
            timings.append((time.perf_counter() - start) / 300 * 1e6)
        best[what] = round(sorted(timings)[2], 1)
    if hvd.rank() == 0:
        print(sys.argv[1] if len(sys.argv) > 1 else "run", "median of 5 x 300 calls, us per call:", best, flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
