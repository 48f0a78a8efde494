"""The training step through unified_dist (the same file under every launcher)."""
import torch

import unified_dist as ud
from common import main


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


def init():
    ud.init()
    return ud.rank(), ud.world_size()


if __name__ == "__main__":
    main("facade", ud.backend_name, init, make_step, gather, finish=ud.shutdown)
