"""DDP's ``gradient_as_bucket_view``: off (torch's default) vs on, alternating in one launch.

    torchrun --nproc_per_node 2 bench/step/bucket_view.py --out FILE [--steps N] [--warmup W]

Two identical copies of the example's model, each wrapped in plain DDP (as native_torch.py), one
with ``gradient_as_bucket_view=True``: its ``.grad`` tensors are views into DDP's communication
buckets, so the copy of every gradient into a bucket before the all-reduce, and back out after it,
is skipped, and one gradient-sized buffer (91 MB here) is not allocated. Steps alternate as in
paired.py (order swapped every pair). Written: the median paired step-time ratio (on / off) with
quartiles, and, as a check that the setting took effect, whether every gradient of the "on" copy
shares storage with others (a bucket) while the "off" copy's gradients each own theirs.
"""
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from common import model_and_batches, parse_args
from native_torch import train_step

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "shared"))
import provenance  # noqa: E402  (bench/shared/provenance.py)


def make_step(model, view: bool):
    """``(the DDP model, its step)``: native_torch.py's step, with or without bucket views."""
    model = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=view)
    return model, train_step(model)


def gradient_storages(model) -> int:
    """How many distinct storages hold the gradients of ``model`` (after a backward)."""
    return len({p.grad.untyped_storage().data_ptr() for p in model.parameters() if p.grad is not None})


args = parse_args()
record = provenance.start()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, batches = model_and_batches(args, rank, world)
twin = copy.deepcopy(model)
(off_model, off), (on_model, on) = make_step(model, False), make_step(twin, True)
steps = {"off": off, "on": on}
times = {"off": [], "on": []}
for i, batch in enumerate(batches):
    for name in (("off", "on") if i % 2 == 0 else ("on", "off")):
        dist.barrier()
        start = time.perf_counter()
        steps[name](batch)
        elapsed = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if i >= args.warmup:
            times[name].append(elapsed.item())
# zero_grad(set_to_none=True) dropped the gradients: one more backward each to count their storages
for m in (off_model, on_model):
    m(**batches[0]).loss.backward()
parameters = sum(1 for p in on_model.parameters() if p.requires_grad)
ratios = [a / b for a, b in zip(times["on"], times["off"])]
q = statistics.quantiles(ratios, n=4)
if rank == 0:
    with open(args.out, "w") as f:
        json.dump({**provenance.finish(record), "world_size": world, "parameters": parameters,
                   "gradient_bytes": sum(p.numel() * p.element_size() for p in on_model.parameters()
                                         if p.requires_grad),
                   "gradient_storages": {"off": gradient_storages(off_model), "on": gradient_storages(on_model)},
                   "step_times_s": times, "median_step_s": {k: statistics.median(v) for k, v in times.items()},
                   "median_paired_ratio_on_vs_off": statistics.median(ratios), "ratio_iqr": [q[0], q[2]]},
                  f, indent=1)
dist.destroy_process_group()
