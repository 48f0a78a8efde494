"""Collective throughput: the facade vs the raw backend call, interleaved, inside one launch.

    <launcher> bench/collectives/collectives_worker.py --out FILE [--sizes-kb 4,64,...] [--rounds N]

Raw calls are what a competent user writes for the same contract (a new result, input kept):
torch: ``t.clone()`` + ``dist.all_reduce``, and ``all_gather_into_tensor`` into one buffer;
accelerate: ``accelerate.utils.reduce``;
horovod: ``hvd.allreduce``. Also: uneven vs even all_gather of the same bytes, and the cost of
check mode (the facade's signature exchange before each collective).
"""
import argparse
import json
import statistics
import time

import torch

import unified_dist as ud
from unified_dist.collectives import checkmode as checkmode


def raw_ops(backend):
    """name -> (all_reduce_sum(t), all_gather_even(t)) written against the backend's own library."""
    if backend == "torch":
        import torch.distributed as dist

        def reduce(t):
            out = t.clone()
            dist.all_reduce(out)
            return out

        # the best raw call for equal shapes: one buffer, no list + cat (its name per torch: unified_dist.compat)
        from unified_dist.compat import all_gather_into_tensor as gather_into

        def gather(t):
            out = t.new_empty((dist.get_world_size() * t.shape[0], *t.shape[1:]))
            gather_into(out, t)
            return out
        return reduce, gather
    if backend == "accelerate":
        from accelerate.utils import gather, reduce

        return (lambda t: reduce(t, reduction="sum")), gather
    if backend == "horovod":
        import horovod.torch as hvd

        return (lambda t: hvd.allreduce(t, op=hvd.Sum)), hvd.allgather
    return (lambda t: t.clone()), (lambda t: t.clone())


def block_time(fn, reps):
    """(wall seconds, caller-thread CPU seconds) per call over ``reps`` back-to-back calls.

    Wall time is the slowest rank's block, started after a barrier: timing single calls on one
    rank would measure its skew against the other rank as much as the collective. On this
    2-core VM loopback latency is bimodal (about 0.2 ms or 1.5-2.5 ms per small collective, by
    phases), so wall ratios are medians over many interleaved blocks and come with their spread.
    The calling thread's CPU time does not include waiting for the peer or gloo's own threads:
    it isolates what the facade adds (Python, copies) from the network's noise.
    """
    ud.barrier()
    start, cpu = time.perf_counter(), time.thread_time()
    for _ in range(reps):
        fn()
    cpu, elapsed = time.thread_time() - cpu, time.perf_counter() - start
    wall = ud.all_reduce(torch.tensor([elapsed], dtype=torch.float64), "max").item()
    return wall / reps, cpu / reps


def reps_for(kb):
    """Calls per timed block: the same for every variant of a size, so their blocks compare."""
    return 50 if kb <= 64 else 20 if kb <= 1024 else 4 if kb <= 16384 else 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sizes-kb", default="4,64,1024,16384,65536")
    p.add_argument("--rounds", type=int, default=15, help="interleaved rounds; each times one block per variant")
    args = p.parse_args()
    ud.init()
    backend = ud.backend_name()
    raw_reduce, raw_gather = raw_ops(backend)
    session_backend = ud.facade.current_backend()
    rows = []
    for kb in [int(s) for s in args.sizes_kb.split(",")]:
        n = kb * 1024 // 4
        t = torch.randn(n)
        for _ in range(2):  # warm-up
            ud.all_reduce(t, "sum"), raw_reduce(t), ud.all_gather(t), raw_gather(t)
        uneven = torch.randn(n + (n // 4 if ud.rank() == 0 else -(n // 4)))  # same total bytes as even
        variants = {
            "facade_all_reduce": lambda: ud.all_reduce(t, "sum"),  # noqa: B023 - timed within this iteration
            "raw_all_reduce": lambda: raw_reduce(t),  # noqa: B023 - timed within this iteration
            "facade_all_gather": lambda: ud.all_gather(t),  # noqa: B023 - timed within this iteration
            "raw_all_gather": lambda: raw_gather(t),  # noqa: B023 - timed within this iteration
            "uneven_all_gather": lambda: ud.all_gather(uneven),  # noqa: B023 - timed within this iteration
            "checkmode_all_reduce": lambda: (
                checkmode.verify(session_backend, checkmode.signature("all_reduce", t, op="sum")),  # noqa: B023 - timed within this iteration
                ud.all_reduce(t, "sum")),  # noqa: B023 - timed within this iteration
        }
        reps = {k: reps_for(kb) for k in variants}
        series = {k: [] for k in variants}
        names = list(variants)
        for round_ in range(args.rounds):  # interleaved, rotating the order so drift hits every variant alike
            for k in names[round_ % len(names):] + names[:round_ % len(names)]:
                series[k].append(block_time(variants[k], reps[k]))
        wall = {k: statistics.median(w for w, _ in v) for k, v in series.items()}
        cpu = {k: statistics.median(c for _, c in v) for k, v in series.items()}

        def spread(a, b):  # quartiles of the per-round ratios a/b (blocks timed next to each other)
            q = statistics.quantiles([x[0] / y[0] for x, y in zip(series[a], series[b])], n=4)  # noqa: B023 - timed within this iteration
            return [q[0], q[2]]

        rows.append({"size_kb": kb, "reps_per_block": reps, "rounds": args.rounds,
                     **{f"{k}_s": v for k, v in wall.items()},
                     **{f"{k}_cpu_us": v * 1e6 for k, v in cpu.items()},
                     "all_reduce_ratio": wall["facade_all_reduce"] / wall["raw_all_reduce"],
                     "all_reduce_ratio_iqr": spread("facade_all_reduce", "raw_all_reduce"),
                     "all_gather_ratio": wall["facade_all_gather"] / wall["raw_all_gather"],
                     "all_gather_ratio_iqr": spread("facade_all_gather", "raw_all_gather"),
                     "uneven_vs_even_ratio": wall["uneven_all_gather"] / wall["facade_all_gather"],
                     "checkmode_ratio": wall["checkmode_all_reduce"] / wall["facade_all_reduce"],
                     "all_reduce_cpu_overhead_us": (cpu["facade_all_reduce"] - cpu["raw_all_reduce"]) * 1e6,
                     "all_gather_cpu_overhead_us": (cpu["facade_all_gather"] - cpu["raw_all_gather"]) * 1e6,
                     "all_reduce_GBps": kb * 1024 / wall["facade_all_reduce"] / 1e9})
    if ud.is_main():
        with open(args.out, "w") as f:
            json.dump({"backend": backend, "world_size": ud.world_size(), "rows": rows}, f, indent=1)
    ud.shutdown()


if __name__ == "__main__":
    main()
