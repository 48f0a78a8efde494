"""Collective throughput: the facade vs the raw backend call, interleaved, inside one launch.

    <launcher> bench/collectives_worker.py --out FILE [--sizes-kb 4,64,...] [--reps N]

Raw calls are what a competent user writes for the same contract (a new result, input kept):
torch: ``t.clone()`` + ``dist.all_reduce``; accelerate: ``accelerate.utils.reduce``;
horovod: ``hvd.allreduce``. Also: uneven vs even all_gather of the same bytes, and the cost of
check mode (the facade's signature exchange before each collective).
"""
import argparse
import json
import statistics
import time

import torch

import unified_dist as ud
from unified_dist import checkmode


def raw_ops(backend):
    """name -> (all_reduce_sum(t), all_gather_even(t)) written against the backend's own library."""
    if backend == "torch":
        import torch.distributed as dist

        def reduce(t):
            out = t.clone()
            dist.all_reduce(out)
            return out

        def gather(t):
            parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
            dist.all_gather(parts, t)
            return torch.cat(parts)
        return reduce, gather
    if backend == "accelerate":
        from accelerate.utils import gather, reduce

        return (lambda t: reduce(t, reduction="sum")), gather
    if backend == "horovod":
        import horovod.torch as hvd

        return (lambda t: hvd.allreduce(t, op=hvd.Sum)), hvd.allgather
    return (lambda t: t.clone()), (lambda t: t.clone())


def timed(fn, reps):
    ud.barrier()
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return samples


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--sizes-kb", default="4,64,1024,16384,65536")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds of facade/raw")
    args = p.parse_args()
    ud.init()
    backend = ud.backend_name()
    raw_reduce, raw_gather = raw_ops(backend)
    session_backend = ud.facade._backend()
    rows = []
    for kb in [int(s) for s in args.sizes_kb.split(",")]:
        n = kb * 1024 // 4
        t = torch.randn(n)
        reps = max(3, args.reps if kb <= 1024 else args.reps // 2)
        for _ in range(2):  # warm-up
            ud.all_reduce(t, "sum"), raw_reduce(t), ud.all_gather(t), raw_gather(t)
        series = {k: [] for k in ("facade_all_reduce", "raw_all_reduce", "facade_all_gather", "raw_all_gather",
                                  "uneven_all_gather", "checkmode_all_reduce")}
        uneven = torch.randn(n + (n // 4 if ud.rank() == 0 else -(n // 4)))  # same total bytes as even
        for _ in range(args.rounds):  # interleave so drift hits every variant alike
            series["facade_all_reduce"] += timed(lambda: ud.all_reduce(t, "sum"), reps)
            series["raw_all_reduce"] += timed(lambda: raw_reduce(t), reps)
            series["facade_all_gather"] += timed(lambda: ud.all_gather(t), reps)
            series["raw_all_gather"] += timed(lambda: raw_gather(t), reps)
            series["uneven_all_gather"] += timed(lambda: ud.all_gather(uneven), reps)
            series["checkmode_all_reduce"] += timed(
                lambda: (checkmode.verify(session_backend, checkmode.signature("all_reduce", t, op="sum")),
                         ud.all_reduce(t, "sum")), reps)
        med = {k: statistics.median(v) for k, v in series.items()}
        rows.append({"size_kb": kb, **{f"{k}_s": v for k, v in med.items()},
                     "all_reduce_ratio": med["facade_all_reduce"] / med["raw_all_reduce"],
                     "all_gather_ratio": med["facade_all_gather"] / med["raw_all_gather"],
                     "uneven_vs_even_ratio": med["uneven_all_gather"] / med["facade_all_gather"],
                     "checkmode_ratio": med["checkmode_all_reduce"] / med["facade_all_reduce"],
                     "all_reduce_GBps": kb * 1024 / med["facade_all_reduce"] / 1e9})
    if ud.is_main():
        with open(args.out, "w") as f:
            json.dump({"backend": backend, "world_size": ud.world_size(), "rows": rows}, f, indent=1)
    ud.shutdown()


if __name__ == "__main__":
    main()
