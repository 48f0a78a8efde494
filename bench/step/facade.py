"""The training step through unified_dist (the same file under every launcher)."""
import torch

import unified_dist as ud
from common import model_and_batches, parse_args, report, run_steps


def make_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    model, optimizer = ud.prepare(model, optimizer)

    def step(batch):
        with ud.accumulate(model):
            loss = model(**batch).loss
            ud.backward(loss)
            ud.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad()
    return step


def gather(v):
    return [float(x) for x in ud.all_gather(torch.tensor([v]))]


if __name__ == "__main__":
    args = parse_args()
    ud.init()
    model, batches = model_and_batches(args, ud.rank(), ud.world_size())
    median, times = run_steps(make_step(model), batches, args.warmup)
    report(args, "facade", ud.backend_name(), ud.rank(), ud.world_size(), median, times, gather)
    ud.shutdown()
