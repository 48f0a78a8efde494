"""The example's training step, timed on one rank per host, with the bytes it put on the wire.

    <launcher> bench/network/network_worker.py --out FILE [--steps N] [--warmup W] [--comm-reps K] [--accum A]

Every rank trains the example's model (bench/step/facade.py's step: prepare, accumulate,
backward, clip, AdamW) on its own batches. After ``--warmup`` steps, all ranks meet at a
barrier, read their interface's byte counters (``/sys/class/net/<NIC>/statistics``, the
namespace's own under ``ip netns exec``), run ``--steps`` steps, meet again and read them again:
throughput = world x batch x steps / elapsed, bytes per optimizer step = every rank's
transmitted bytes summed (each byte crosses the link once) / optimizer steps.

``--accum A`` runs ``ud.init(gradient_accumulation_steps=A)``: a "step" is then one micro-batch,
the gradient is reduced once per A of them (one optimizer step), and ``--steps``/``--warmup``
must be multiples of A so the timed window holds whole optimizer steps.

Then ``--comm-reps`` serialised all-reduces of the gradient's size (in the compressed format
when compression is on), alone: the communication time the step would pay if none of it
overlapped backward (see bench/network/network.py for the overlap figure). With one process
(the one-host baseline) nothing is sent and the comm time is 0.

Rank 0 writes FILE (JSON). The interface is ``--nic`` (default udnet0, tools/netns_hosts.sh's).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "step"))

import unified_dist as ud  # noqa: E402
from common import model_and_batches  # noqa: E402  (bench/step/common.py)
from facade import make_step  # noqa: E402  (bench/step/facade.py: the step every benchmark times)
from unified_dist.backends.buckets import HOROVOD_CYCLE_VAR  # noqa: E402

DTYPE = {None: torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--comm-reps", type=int, default=3)
    p.add_argument("--nic", default="udnet0")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    args = p.parse_args()
    if args.steps % args.accum or args.warmup % args.accum:
        p.error(f"--steps {args.steps} and --warmup {args.warmup} must be multiples of --accum {args.accum}")
    return args


def wire_bytes(nic):
    """(tx, rx) bytes of ``nic`` in this network namespace (0, 0 where it does not exist)."""
    base = f"/sys/class/net/{nic}/statistics"
    try:
        return tuple(int(open(f"{base}/{d}_bytes").read()) for d in ("tx", "rx"))
    except OSError:
        return 0, 0


def serialised_comm_s(numel, compression, reps):
    """Median seconds of one all-reduce of ``numel`` gradient elements in the wire format."""
    if ud.world_size() == 1 or reps < 1:
        return 0.0
    flat = torch.ones(numel, dtype=DTYPE[compression])
    times = []
    for _ in range(reps):
        ud.barrier()
        start = time.perf_counter()
        ud.all_reduce(flat, "sum")
        times.append(ud.all_reduce(torch.tensor([time.perf_counter() - start]), "max").item())
    return statistics.median(times)


def main():
    args = parse_args()
    ud.init(gradient_accumulation_steps=args.accum)
    rank, world = ud.rank(), ud.world_size()
    model, batches = model_and_batches(args, rank, world)
    numel = sum(p.numel() for p in model.parameters() if p.requires_grad)
    step = make_step(model)
    for batch in batches[:args.warmup]:
        step(batch)
    step_times = []
    ud.barrier()
    before = wire_bytes(args.nic)
    start = time.perf_counter()
    for batch in batches[args.warmup:]:
        t0 = time.perf_counter()
        step(batch)
        step_times.append(time.perf_counter() - t0)
    ud.barrier()
    elapsed = time.perf_counter() - start
    after = wire_bytes(args.nic)
    sent = [int(x) for x in ud.all_gather(torch.tensor([after[0] - before[0]], dtype=torch.int64))]
    elapsed = ud.all_reduce(torch.tensor([elapsed]), "max").item()
    comm_s = serialised_comm_s(numel, ud.gradient_compression(), args.comm_reps)
    formats = ud.all_gather_object(ud.gradient_compression())  # the launcher passed it to every host
    if rank == 0:
        steps = len(step_times)
        with open(args.out, "w") as f:
            json.dump({"backend": ud.backend_name(), "launcher": ud.launcher(), "world_size": world,
                       "compression": ud.gradient_compression(), "compression_per_rank": formats, "steps": steps,
                       "warmup": args.warmup, "accum": args.accum, "mean_step_s": elapsed / steps,
                       "batch_size": args.batch_size, "max_length": args.max_length, "grad_numel": numel,
                       "elapsed_s": elapsed, "samples_per_s": world * args.batch_size * steps / elapsed,
                       "median_step_s": statistics.median(step_times), "step_times_s": step_times,
                       "tx_bytes_per_rank": sent, "wire_bytes_per_step": sum(sent) / (steps // args.accum),
                       "serialised_allreduce_s": comm_s,
                       # what Horovod's hvd.init() read: the launch's, or the facade's CPU default
                       "horovod_cycle_time": os.environ.get(HOROVOD_CYCLE_VAR)}, f, indent=1)
    ud.shutdown()


if __name__ == "__main__":
    main()
