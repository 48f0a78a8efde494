"""Plain Horovod with DistributedOptimizer, as a competent user writes it."""
import horovod.torch as hvd
import torch

from common import model_and_batches, parse_args, report, run_steps


def init():
    hvd.init()
    return hvd.rank(), hvd.size()


def make_step(model, prefix=""):
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = hvd.DistributedOptimizer(
        optimizer, named_parameters=[(prefix + n, p) for n, p in model.named_parameters()])

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
    args = parse_args()
    rank, world = init()
    model, batches = model_and_batches(args, rank, world)
    median, times = run_steps(make_step(model), batches, args.warmup)
    report(args, "native", "horovod", rank, world, median, times, gather)
