#!/usr/bin/env python
"""Linear regression on toy data through unified_dist: the porting guide's "after" (see README.md).

    python examples/minimal/train.py
    torchrun --standalone --nproc_per_node 2 examples/minimal/train.py --batch-size 16
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no examples/minimal/train.py --batch-size 16
    horovodrun -np 2 -H localhost:2 --gloo python examples/minimal/train.py --batch-size 16
"""
import argparse
import os

import torch
from torch.utils.data import DataLoader, TensorDataset

import unified_dist as ud


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

    ud.init()  # joins whatever launched this process: python, torchrun, accelerate launch, horovodrun
    ud.seed_everything(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(toy_data(), batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(toy_data(), batch_size=64)
    model, optimizer, loader, eval_loader = ud.prepare(model, optimizer, loader, eval_loader)

    checkpoints = os.path.join(args.output_dir, "checkpoints")
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    if ud.latest_checkpoint(checkpoints):  # a requeued job resumes where it stopped, at any world size
        ud.load(ud.latest_checkpoint(checkpoints), state)
    step = state["step"]
    while step < args.steps:  # the prepared loader reshuffles each epoch by itself
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            ud.backward(loss)  # gradients averaged across processes, on every backend
            optimizer.step()
            step += 1
            if ud.should_stop():  # SIGUSR1/SIGTERM on any process: every process stops at this step
                ud.save_checkpoint({**state, "step": step}, checkpoints, step)
                ud.requeue()  # SLURM: scontrol requeue; elsewhere exit 75, which restarts the job
            if step % 10 == 0:
                mean = ud.all_reduce(loss.detach(), "mean")  # the same value on every process
                ud.print(f"step {step}: loss {mean.item():.6f}")  # printed by the main process only
            if step == args.steps:
                break

    with torch.no_grad():  # every process evaluates its shard; gather_for_metrics drops the padding
        errors = torch.cat([ud.gather_for_metrics((model(x) - y).pow(2).squeeze(1)) for x, y in eval_loader])
    ud.print(f"final mse {errors.mean().item():.6f} on {len(errors)} examples after {step} steps")
    ud.save_checkpoint({**state, "step": step}, checkpoints, step)
    ud.shutdown()


if __name__ == "__main__":
    main()
