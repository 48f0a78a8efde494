"""One short job for bench/exit/exit_stress.py: a DDP-style model, 3 steps, an all_reduce, then the
script simply ends (no ud.shutdown(): the facade's exit handler must leave the stack cleanly).

With ``EXIT_WORKER_REPORT=DIR`` each rank writes ``DIR/rank<R>.json``: what was alive after the
training (``running``) and what is still alive once the facade's own exit handler has run
(``at_exit``): the torch process group, the DDP reducer of the prepared model, Horovod. The
handler that looks is registered *before* ``ud.init()``, which registers the facade's; atexit
runs handlers last in, first out, so this one runs after the facade's (and after Horovod's own,
which ``hvd.init()`` registers inside ``ud.init()``). bench/exit/exit_stress.py counts a launch whose
``at_exit`` shows anything alive as a missed teardown: a deterministic check, where the crash
the teardown prevents comes only now and then.
"""
import atexit
import json
import os

import torch
import torch.distributed as dist

import unified_dist as ud

REPORT = os.environ.get("EXIT_WORKER_REPORT")


def alive(model, backend: str) -> dict:
    hvd_alive = False
    if backend == "horovod":
        import horovod.torch as hvd

        hvd_alive = bool(hvd.is_initialized())
    return {"process_group": dist.is_available() and dist.is_initialized(),
            "ddp_reducer": hasattr(model, "reducer"), "horovod": hvd_alive}


def report_after_the_facade(running: dict) -> None:
    """Registered before ud.init(), so it runs after the facade's exit handler (LIFO)."""
    state = {"rank": running["rank"], "running": running["alive"],
             "at_exit": alive(globals().get("model"), running["backend"])}
    with open(os.path.join(REPORT, f"rank{running['rank']}.json"), "w") as f:
        json.dump(state, f)


running: dict = {}
if REPORT:
    atexit.register(report_after_the_facade, running)
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
running.update(rank=ud.rank(), backend=ud.backend_name(), alive=alive(model, ud.backend_name()))
print(f"done rank {ud.rank()}", flush=True)
