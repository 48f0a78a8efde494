"""Plain DDP under torchrun, as a competent user writes it."""
import os

import torch
import torch.distributed as dist

from common import model_and_batches, parse_args, report, run_steps

args = parse_args()
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
model, batches = model_and_batches(args, rank, world)
model = torch.nn.parallel.DistributedDataParallel(model)
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)


def step(batch):
    loss = model(**batch).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()


median, times = run_steps(step, batches, args.warmup)


def gather(v):
    out = [None] * world
    dist.all_gather_object(out, v)
    return out


report(args, "native", "torch", rank, world, median, times, gather)
dist.destroy_process_group()
