"""Plain Horovod with DistributedOptimizer, as a competent user writes it."""
import horovod.torch as hvd
import torch

from common import model_and_batches, parse_args, report, run_steps

args = parse_args()
hvd.init()
model, batches = model_and_batches(args, hvd.rank(), hvd.size())
optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())


def step(batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with optimizer.skip_synchronize():
        optimizer.step()
    optimizer.zero_grad()


median, times = run_steps(step, batches, args.warmup)
report(args, "native", "horovod", hvd.rank(), hvd.size(), median, times,
       lambda v: [float(x) for x in hvd.allgather_object(v)])
