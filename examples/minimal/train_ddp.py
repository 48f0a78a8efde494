#!/usr/bin/env python
"""Linear regression on toy data with plain torch.distributed (DDP): the porting guide's "before".

    torchrun --standalone --nproc_per_node 2 examples/minimal/train_ddp.py --batch-size 16

It runs under torchrun only; train.py beside it is the same loop through unified_dist.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def toy_data(n: int = 512) -> TensorDataset:
    """y = x . w + noise with 8 features and w = linspace(-1, 1): the same tensors everywhere."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    y = x @ torch.linspace(-1, 1, 8) + 0.1 * torch.randn(n, generator=g)
    return TensorDataset(x, y.unsqueeze(1))


def main() -> None:
    p = argparse.ArgumentParser(description="linear regression on toy data, data parallel")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=32, help="examples per process per step")
    p.add_argument("--output-dir", default="runs/minimal")
    args = p.parse_args()

    dist.init_process_group("gloo")  # "nccl" on GPUs, and model.to(f"cuda:{LOCAL_RANK}")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = DistributedSampler(toy_data(), shuffle=True, seed=0)
    loader = DataLoader(toy_data(), batch_size=args.batch_size, sampler=sampler)

    step, epoch = 0, 0
    while step < args.steps:
        sampler.set_epoch(epoch)  # a new shuffle each epoch
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()  # DDP averages the gradients across processes
            optimizer.step()
            step += 1
            if step % 10 == 0:
                mean = loss.detach().clone()
                dist.all_reduce(mean)  # the sum over processes (gloo has no average)
                if dist.get_rank() == 0:
                    print(f"step {step}: loss {mean.item() / dist.get_world_size():.6f}")
            if step == args.steps:
                break
        epoch += 1

    if dist.get_rank() == 0:  # evaluate on one process (a DistributedSampler would pad the split)
        with torch.no_grad():
            x, y = toy_data().tensors
            errors = (model.module(x) - y).pow(2).squeeze(1)
        print(f"final mse {errors.mean().item():.6f} on {len(errors)} examples after {step} steps")
        os.makedirs(os.path.join(args.output_dir, "checkpoints"), exist_ok=True)
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                   os.path.join(args.output_dir, "checkpoints", f"checkpoint-{step:09d}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
