"""A facade loop for the launcher's supervision of replica groups (tests/launchers/test_replica_groups_supervision.py).

The loop of docs/preemption.md under ``unified-dist launch --replica-groups``: an MLP with SGD on 256 fixed examples,
4 per rank, until the optimizer has taken ``--steps`` steps; after each step ``ud.should_stop()``, and on a stop
``ud.save_checkpoint`` (to ``--out/checkpoints_group<G>``) then ``ud.requeue()`` (exit 75). Each process appends one
JSON line per event to ``--out/group<G>_rank<R>.jsonl``: ``start`` (pid, ``REPLICA_GROUP_RESTARTS``), ``step``
(the committed count, whether it committed, ``ud.data_parallel_world_size()``, the time), ``stop`` (the step,
the checkpoint), ``end`` (the step, the weights' hash).

``--kill-group G --kill-at K``: group G's first process to commit step K kills itself (SIGKILL), once.
``--restart-waits-for NAME``: a restarted group (``REPLICA_GROUP_RESTARTS`` > 0) waits, before ``ud.init``, until
``--out/NAME`` exists, then 3 s (a slow restart, made certain). ``--usage-error-group G``: group G's ``ud.init`` is
given a setting it refuses, and the script says so in one line and exits 2, as the examples do.
"""
import argparse
import hashlib
import os
import signal
import sys
import time

import torch

import unified_dist as ud
from unified_dist.testing.replica_runs import Records

parser = argparse.ArgumentParser()
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--step-sleep", type=float, default=0.1)
parser.add_argument("--timeout", type=float, default=20)
parser.add_argument("--kill-group", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--restart-waits-for", default=None)
parser.add_argument("--usage-error-group", type=int, default=-1)
args = parser.parse_args()

restarts = int(os.environ.get("REPLICA_GROUP_RESTARTS", "0"))
rank = int(os.environ.get("RANK", "0"))
record = Records(args.out, rank)  # before ud.init: a usage error there is recorded too
group, out = record.group, record.out


record(event="start", restarts=restarts)
if restarts and args.restart_waits_for:
    while not (out / args.restart_waits_for).exists():
        time.sleep(0.2)
    time.sleep(3)  # and the survivor's process has ended
try:
    ud.init(timeout=args.timeout, **({"sharding": "tensor-parallel-please"} if group == args.usage_error_group else {}))
except ud.UnifiedDistError as exc:
    print(f"replica_stop_worker.py: error: {exc}", file=sys.stderr, flush=True)
    record(event="usage-error")
    sys.exit(2)

data = torch.Generator().manual_seed(7)
x = torch.randn(256, 16, generator=data)
y = x @ torch.randn(16, 4, generator=data)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
model, optimizer, loader = ud.prepare(model, optimizer, loader)
state = {"model": model, "optimizer": optimizer, "loader": loader}


def digest() -> str:
    return hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in ud.unwrap(model).parameters())).hexdigest()


while optimizer.steps_taken < args.steps:
    for inputs, targets in loader:
        ud.backward(torch.nn.functional.mse_loss(model(inputs), targets))
        before = optimizer.steps_taken
        optimizer.step()
        optimizer.zero_grad()
        record(event="step", step=optimizer.steps_taken, committed=optimizer.steps_taken > before,
               dp=ud.data_parallel_world_size())
        if group == args.kill_group and optimizer.steps_taken == args.kill_at and rank == 0 and restarts == 0:
            record(event="kill", step=optimizer.steps_taken)
            os.kill(os.getpid(), signal.SIGKILL)
        if ud.should_stop():
            path = ud.save_checkpoint(state, str(out / f"checkpoints_group{group}"), optimizer.steps_taken)
            record(event="stop", step=optimizer.steps_taken, checkpoint=path)
            ud.requeue()
        time.sleep(args.step_sleep)
        if optimizer.steps_taken >= args.steps:
            break

record(event="end", step=optimizer.steps_taken, digest=digest())
ud.shutdown()
(out / f"group{group}_rank{rank}.ended").touch()
