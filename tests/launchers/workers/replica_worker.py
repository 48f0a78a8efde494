"""A facade training loop for replica groups (tests/launchers/test_replica_groups.py, bench/replicas/).

An MLP regression (float64) with SGD and momentum on 256 fixed examples, shuffled, 4 per rank: the loop is the
usual one (``ud.init``, ``ud.prepare(model, optimizer, loader)``, ``ud.backward``, ``optimizer.step``), and it runs
until the optimizer has taken ``--steps`` steps. The count comes from the optimizer's state, which a healed group
takes from its peer, so every group ends at the same step. Each process appends one JSON line per event to
``--out/group<G>_rank<R>.jsonl``: ``start`` (its pid), one ``step`` per optimizer step (the committed count,
whether this one committed, the hash of the weights its forward ran on, ``ud.data_parallel_world_size()``,
the time), and ``end`` (the parameters, their
float64 sum and the raw bytes' hash, the loss on the whole data set, the step at which it was healed).

``--replay SCHEDULE``: one process without replica groups, batch 8 (2 shares of 4), replaying a run's schedule:
a global batch whose step did not commit is skipped, and a step that ran with fewer groups trains on their shares
of it only (the mean over those examples). Its end equals that run's if every step did what the schedule says.

``--kill-group G --kill-at K``: the first process of group G to reach step K kills itself (SIGKILL; a marker
file makes it happen once). ``--hang-group G --hang-at K --hang-s S``: that process sleeps S seconds in the middle
of step K (after its backward, before its step), once. ``--save``: ``ud.save`` of the model and the optimizer
to ``--out/final.pt`` at the end.
"""
import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch

import unified_dist as ud
from unified_dist import session
from unified_dist.testing.replica_runs import Records

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=24)
parser.add_argument("--batch", type=int, default=4)
parser.add_argument("--out", required=True)
parser.add_argument("--kill-group", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--hang-group", type=int, default=-1)
parser.add_argument("--hang-at", type=int, default=-1)
parser.add_argument("--hang-s", type=float, default=0.0)
parser.add_argument("--step-sleep", type=float, default=0.05)
parser.add_argument("--alone-sleep", type=float, default=None,
                    help="seconds to sleep after a step with fewer groups than the job has (default --step-sleep): "
                         "paces a survivor so a restarted group finds it still running")
parser.add_argument("--await-restart", type=float, default=0.0,
                    help="while fewer groups than the job has take part, wait up to this many seconds after each step "
                         "until the lost group's new process has started (its rank 0 logged 'start'): a survivor then "
                         "cannot finish the job alone however slowly a loaded machine restarts its peer")
parser.add_argument("--sharding", default=None)
parser.add_argument("--timeout", type=float, default=10)
parser.add_argument("--save", action="store_true", help="ud.save the model and optimizer to --out/final.pt at the end")
parser.add_argument("--replay", default=None,
                    help="one process, batch 8: a JSON list with one [committed, shares] per global batch, shares "
                         "the data-parallel ranks (of 2) whose examples took part; trains on exactly those")
args = parser.parse_args()

ud.init(timeout=args.timeout, **({"sharding": args.sharding} if args.sharding else {}))
record = Records(args.out, ud.rank())
group, out = record.group, record.out


record(event="start")
# float64 throughout: the physics checks then hold to ~1e-12 on any CPU, where float32's reordered sums
# (another CPU, another kernel) drift by ~1e-6 over 60 steps and a bound tuned on one machine fails on another
torch.set_default_dtype(torch.float64)
data = torch.Generator().manual_seed(7)
x = torch.randn(256, 16, generator=data)
y = x @ torch.randn(16, 4, generator=data) + 0.1 * torch.randn(256, 4, generator=data)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=args.batch, shuffle=True)
model, optimizer, loader = ud.prepare(model, optimizer, loader)


def digest(tensors) -> str:
    """This rank's bytes of ``tensors`` (a sharded parameter's local shard), hashed."""
    local = (t.to_local() if hasattr(t, "to_local") else t for t in tensors)
    return hashlib.sha1(b"".join(t.detach().numpy().tobytes() for t in local)).hexdigest()


def replacement_started() -> bool:
    """Whether every rank 0 that was killed or hung (the only ones this script kills or hangs) has a new process:
    as many 'start' events in the groups' rank-0 logs as groups plus 'kill' and 'hang' events."""
    starts = lost = 0
    for path in out.glob("group*_rank0.jsonl"):
        for line in path.read_text().splitlines():
            event = json.loads(line)["event"] if line.strip() else None
            starts += event == "start"
            lost += event in ("kill", "hang")
    return starts >= int(os.environ.get("NUM_REPLICA_GROUPS", "1")) + lost


full_world = int(os.environ.get("NUM_REPLICA_GROUPS", "1")) * ud.world_size()
if args.replay:
    from unified_dist.data.loaders import shard

    schedule = json.loads(Path(args.replay).read_text())
    done = 0
    while done < len(schedule):
        for inputs, targets in loader:
            if done == len(schedule):
                break
            committed, shares = schedule[done]
            done += 1
            if not committed:
                continue
            rows = torch.cat([torch.arange(offset, offset + count) for count, offset in
                              (shard(inputs.shape[0], 2, r) for r in shares)])
            loss = torch.nn.functional.mse_loss(model(inputs[rows]), targets[rows])
            ud.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            record(event="step", step=optimizer.steps_taken, committed=True, dp=len(shares), loss=loss.item())
    args.steps = 0  # the training loop below has nothing left to do

while optimizer.steps_taken < args.steps:
    for inputs, targets in loader:
        loss = torch.nn.functional.mse_loss(model(inputs), targets)
        ud.backward(loss)
        before = optimizer.steps_taken
        upcoming = before + 1
        used = digest(model.parameters())  # the weights this step's forward ran on
        if group == args.hang_group and upcoming == args.hang_at and ud.rank() == 0 and record.once("hang"):
            record(event="hang", step=upcoming)
            time.sleep(args.hang_s)
        optimizer.step()
        optimizer.zero_grad()
        record(event="step", step=optimizer.steps_taken, committed=optimizer.steps_taken > before, used=used,
               dp=ud.data_parallel_world_size(), loss=loss.item())
        if group == args.kill_group and optimizer.steps_taken == args.kill_at and ud.rank() == 0 \
                and record.once("kill"):
            record(event="kill", step=optimizer.steps_taken)
            os.kill(os.getpid(), signal.SIGKILL)
        fewer = ud.data_parallel_world_size() < full_world
        time.sleep(args.alone_sleep if fewer and args.alone_sleep is not None else args.step_sleep)
        waited = time.monotonic()
        while fewer and args.await_restart and not replacement_started() \
                and time.monotonic() - waited < args.await_restart:
            time.sleep(0.1)
        if optimizer.steps_taken >= args.steps:
            break

if args.save:  # every group's main process writes the same weights to the same file
    ud.save({"model": model, "optimizer": optimizer}, str(out / "final.pt"))
inner = ud.unwrap(model)
params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in inner.parameters()]
with torch.no_grad():
    full_loss = torch.nn.functional.mse_loss(inner(x), y).item()
replicas = session.current_backend().replicas
record(event="end", step=optimizer.steps_taken, rank=ud.rank(), world=ud.world_size(),
       checksum=sum(p.detach().double().sum().item() for p in params),
       digest=hashlib.sha1(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest(),
       loss=full_loss, params=torch.cat([p.detach().reshape(-1) for p in params]).tolist(),
       healed_at=None if replicas is None else replicas.healed_at,
       short_steps=[] if replicas is None else replicas.short_steps)
ud.shutdown()
