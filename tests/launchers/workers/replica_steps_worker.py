"""A facade loop with a BatchNorm model and an evaluation loader, for tests/launchers/test_replica_groups_steps.py.

An MLP classifier with ``BatchNorm1d`` (float64) over 240 fixed examples, 4 per rank, trained with SGD until its
optimizer has taken ``--steps`` steps. ``--eval-every K``: every K committed steps, and once after the last, the
usual evaluation through a prepared loader (``model.eval()``, ``torch.no_grad()``, ``ud.gather_for_metrics``) over
a split of 50 examples (not a multiple of any batch). ``--sleep-after S``: S seconds between the last step and
``ud.shutdown()`` (a long evaluation or save). ``--loop``: ``for`` (``for batch in loader``, leaving it after the
last step), ``top`` (the same, checking for its end at the top of the body: it leaves the loader right after
fetching one more batch, that step's quorum held) or ``next`` (one iterator, ``next(it)``, kept past the last step:
its pass never ends before the program does). Each process appends
JSON lines to ``--out/group<G>_rank<R>.jsonl``: ``start``, ``step`` (the committed count, whether it committed),
``eval`` (the step, the rows gathered, the accuracy, the loss sum over the split), and ``end`` (the weights' and the
BatchNorm buffers' hashes, the step at which it was healed).

``--kill-group G --kill-at K``: the first process of group G to reach step K kills itself (SIGKILL; once). A group
started again writes ``--out/restarted.ready`` once prepared, right before its first quorum; a survivor that steps
with fewer groups than the job has waits for that file first (however slow the restart on a busy machine), then
paces its steps by ``--alone-sleep``.
``--own-at-rejoin-s S``: in a step in which more groups take part than in the one before (a group came back), the
step's own work takes S seconds more (before its backward; a ``rejoined`` event).
``--slow-heal-s S``: a process that heals from a live peer at a step > 0 sleeps S seconds while taking its state
(a stalled peer, inside torchft's quorum).
"""
import argparse
import hashlib
import os
import signal
import time

import torch

import unified_dist as ud
from unified_dist import session
from unified_dist.testing.replica_runs import Records

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=10)
parser.add_argument("--out", required=True)
parser.add_argument("--timeout", type=float, default=10)
parser.add_argument("--eval-every", type=int, default=0)
parser.add_argument("--sleep-after", type=float, default=0.0)
parser.add_argument("--step-sleep", type=float, default=0.0)
parser.add_argument("--alone-sleep", type=float, default=None)
parser.add_argument("--kill-group", type=int, default=-1)
parser.add_argument("--kill-at", type=int, default=-1)
parser.add_argument("--own-at-rejoin-s", type=float, default=0.0)
parser.add_argument("--slow-heal-s", type=float, default=0.0)
parser.add_argument("--loop", choices=("for", "top", "next"), default="for")
args = parser.parse_args()

ud.init(timeout=args.timeout)
record = Records(args.out, ud.rank())
group, out = record.group, record.out


def digest(tensors) -> str:
    return hashlib.sha1(b"".join(t.detach().contiguous().numpy().tobytes() for t in tensors)).hexdigest()


record(event="start", restarts=int(os.environ.get("REPLICA_GROUP_RESTARTS", "0")))
torch.set_default_dtype(torch.float64)
data = torch.Generator().manual_seed(3)
x = torch.randn(290, 8, generator=data)
y = (x @ torch.randn(8, generator=data) > 0).long()
train_set = torch.utils.data.TensorDataset(x[:240], y[:240])
eval_set = torch.utils.data.TensorDataset(x[240:], y[240:])  # 50 examples
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_loader = torch.utils.data.DataLoader(train_set, batch_size=4, shuffle=True)
eval_loader = torch.utils.data.DataLoader(eval_set, batch_size=4)
model, optimizer, train_loader, eval_loader = ud.prepare(model, optimizer, train_loader, eval_loader)

replicas = session.current_backend().replicas
if int(os.environ.get("REPLICA_GROUP_RESTARTS", "0")):
    (out / "restarted.ready").touch()
if args.slow_heal_s and replicas is not None:
    sess = session.current()

    def slow_load(state, generators=True):
        if generators:  # a heal at a step > 0 (step 0 is every group's common start)
            record(event="slow_heal", seconds=args.slow_heal_s)
            time.sleep(args.slow_heal_s)
        sess._load_replica_state(state, generators)

    replicas.heal_with(sess._replica_state, slow_load)


def evaluate():
    model.eval()
    rows, correct, loss_sum = 0, 0, 0.0
    with torch.no_grad():
        for inputs, targets in eval_loader:
            logits = model(inputs)
            losses = torch.nn.functional.cross_entropy(logits, targets, reduction="none")
            gathered_losses = ud.gather_for_metrics(losses)
            gathered_hits = ud.gather_for_metrics((logits.argmax(-1) == targets).long())
            rows += len(gathered_hits)
            correct += int(gathered_hits.sum())
            loss_sum += float(gathered_losses.sum())
    model.train()
    record(event="eval", step=optimizer.steps_taken, rows=rows, accuracy=correct / max(rows, 1), loss_sum=loss_sum)


full_world = int(os.environ.get("NUM_REPLICA_GROUPS", "1")) * ud.world_size()
previous = None  # ud.data_parallel_world_size() in the step before
def train_on(inputs, targets) -> None:
    """One step's work on its batch (the batch's fetch held the step's quorum)."""
    global previous
    taking_part = ud.data_parallel_world_size()
    if previous is not None and taking_part > previous:
        record(event="rejoined", step=optimizer.steps_taken + 1)
        time.sleep(args.own_at_rejoin_s)  # this group's own work in the step
    previous = taking_part
    loss = torch.nn.functional.cross_entropy(model(inputs), targets)
    ud.backward(loss)
    before = optimizer.steps_taken
    optimizer.step()
    optimizer.zero_grad()
    record(event="step", step=optimizer.steps_taken, committed=optimizer.steps_taken > before,
           dp=ud.data_parallel_world_size())
    if group == args.kill_group and optimizer.steps_taken == args.kill_at and ud.rank() == 0 and record.once("kill"):
        record(event="kill", step=optimizer.steps_taken)
        os.kill(os.getpid(), signal.SIGKILL)
    if args.eval_every and optimizer.steps_taken > before and optimizer.steps_taken % args.eval_every == 0:
        evaluate()
    fewer = ud.data_parallel_world_size() < full_world
    if fewer and args.kill_group >= 0:
        for _ in range(1000):  # 200 s at most
            if (out / "restarted.ready").exists():
                break
            time.sleep(0.2)
    time.sleep(args.alone_sleep if fewer and args.alone_sleep is not None else args.step_sleep)


model.train()
if args.loop == "next":
    held = iter(train_loader)  # kept past the last step: its pass never ends before the program does
    while optimizer.steps_taken < args.steps:
        try:
            batch = next(held)
        except StopIteration:
            held = iter(train_loader)
            continue
        train_on(*batch)
else:
    while optimizer.steps_taken < args.steps:
        for inputs, targets in train_loader:
            if args.loop == "top" and optimizer.steps_taken >= args.steps:
                break  # the batch just fetched held the next step's quorum: the loop leaves it
            train_on(inputs, targets)
            if args.loop == "for" and optimizer.steps_taken >= args.steps:
                break

if args.eval_every:
    evaluate()
time.sleep(args.sleep_after)  # after the last step: an evaluation or a save that outlasts the timeout
inner = ud.unwrap(model)
record(event="end", step=optimizer.steps_taken, params=digest(inner.parameters()),
       buffers=digest(b for b in inner.buffers() if b.is_floating_point()),
       running_mean=inner[1].running_mean.tolist(), healed_at=None if replicas is None else replicas.healed_at)
ud.shutdown()
