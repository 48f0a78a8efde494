"""Plain DDP under torchrun, as a competent user writes it."""
import torch
import torch.distributed as dist

from common import main


def init():
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def make_step(model, **ddp_options):
    """Plain DDP (``ddp_options`` go to DistributedDataParallel) and its training step."""
    return train_step(torch.nn.parallel.DistributedDataParallel(model, **ddp_options))


def train_step(model):
    """The step of an already wrapped ``model``: forward, backward, clip, AdamW, zero_grad."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    return step


def gather(v):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, v)
    return out


if __name__ == "__main__":
    main("native", "torch", init, make_step, gather, finish=dist.destroy_process_group)
