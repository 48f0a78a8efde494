"""Plain Horovod with DistributedOptimizer, as a competent user writes it."""
import horovod.torch as hvd
import torch

from common import main


def init():
    hvd.init()
    return hvd.rank(), hvd.size()


def make_step(model):
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    # names of its own, so it can train beside the facade's optimizer in one job (paired.py)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=[("native." + n, p) for n, p in model.named_parameters()])

    def step(batch):
        loss = model(**batch).loss
        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        with optimizer.skip_synchronize():
            optimizer.step()
        optimizer.zero_grad()
    return step


def gather(v):
    return [float(x) for x in hvd.allgather_object(v)]


if __name__ == "__main__":
    main("native", "horovod", init, make_step, gather)
