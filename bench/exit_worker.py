"""One short job for bench/exit_stress.py: a DDP-style model, 3 steps, an all_reduce, then the
script simply ends (no ud.shutdown(): the facade's exit handler must leave the stack cleanly)."""
import torch

import unified_dist as ud

ud.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = ud.prepare(model, optimizer)
for _ in range(3):
    loss = model(torch.randn(8, 32)).pow(2).mean()
    ud.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
ud.all_reduce(torch.ones(1), "sum")
print(f"done rank {ud.rank()}", flush=True)
