"""A training loop that stops on a preemption signal, checkpoints, requeues and resumes (issue 29),
run under a real launcher by tests/launchers/test_preemption_under_launchers.py.

    <launcher> tests/launchers/workers/preempt_worker.py --dir CKPT_DIR --out OUT_DIR --tag NAME
                                               [--wait-for-signal RANKS] [--signal-in-save]
                                               [--first-ask-after-ready] [--signal-self-at-ready RANK]

The loop: a float64 ``Linear(3, 1)``, AdamW, a prepared map-style DataLoader of ``ROWS`` rows (global
micro-batch ``GLOBAL`` rows, whatever the world size), ``gradient_accumulation_steps=2``, and
``ud.should_stop()`` after every micro-step. On start it resumes from ``ud.latest_checkpoint(CKPT_DIR)``
(model, optimizer, loader position, every rank's RNG, step). A run that did not resume saves a
checkpoint at optimizer step ``READY_STEP`` and then writes OUT_DIR/<tag>_ready_rank<R>.json (its pid):
the test sends its signal then. With ``--wait-for-signal 0,1`` every rank then waits, without a timed
sleep, until each listed rank has received its stop signal (each writes OUT_DIR/<tag>_signalled_rank<R>.json
once it has): the stop is agreed at the next optimizer step, ``READY_STEP + 1``, however slow the machine.
On stop: OUT_DIR/<tag>_stop_rank<R>.json (the step), ``ud.save_checkpoint``, ``ud.requeue()``.
At the end: OUT_DIR/<tag>_done_rank<R>.json with the final weights.

Every run writes OUT_DIR/<tag>_calls_rank<R>.json: for each micro-step, whether it synchronised
gradients and how many backend primitives (all_reduce_, all_gather_*, broadcast_*, barrier) it called.

``--signal-in-save``: while rank 0 writes the stop checkpoint, halfway through the bytes, it sends
itself SIGTERM (a second stop signal): the checkpoint must still be complete.

``--first-ask-after-ready``: the loop calls ``ud.should_stop()`` only after the ready checkpoint (a program
that logs or evaluates before it first asks); ``--signal-self-at-ready R``: rank R sends itself SIGTERM right
after the ready checkpoint, before that first ask (docs/preemption.md: held to the end of the next step).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import signal
import sys
import time

import torch
from torch.utils.data import DataLoader, TensorDataset

import unified_dist as ud
from unified_dist import session

ROWS, GLOBAL, ACCUMULATION, TOTAL_STEPS = 40, 4, 2, 60  # 40 rows = 5 optimizer steps of 8 rows per epoch
READY_STEP = 3
LR, WEIGHT_DECAY = 0.05, 0.01
PRIMITIVES = ("all_reduce_", "all_gather_equal", "all_gather_uneven", "broadcast_", "broadcast_object", "barrier")


def data():
    """Row i: (x_i, y_i) from a fixed generator (the test's plain reference trains on the same rows)."""
    g = torch.Generator().manual_seed(29)
    x = torch.randn(ROWS, 3, generator=g, dtype=torch.float64)
    return x, torch.randn(ROWS, 1, generator=g, dtype=torch.float64)


def initial_weights():
    g = torch.Generator().manual_seed(7)
    return torch.randn(1, 3, generator=g, dtype=torch.float64), torch.randn(1, generator=g, dtype=torch.float64)


def write(path, data):
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def count_primitives(calls):
    """Count every call of the backend's collective primitives in ``calls[0]``."""
    cls = type(session.current_backend())
    for name in PRIMITIVES:
        real = getattr(cls, name, None)
        if real is None:
            continue

        def counted(self, *args, _real=real, **kwargs):
            calls[0] += 1
            return _real(self, *args, **kwargs)
        setattr(cls, name, counted)


def signal_halfway_through_save(marker):
    """Rank 0's torch.save writes half of the checkpoint's bytes, then a second SIGTERM arrives, then
    the rest is written; ``marker`` (a JSON file) says how far the write was and which signals this
    process had recorded once the second was handled."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        buffer = io.BytesIO()
        real(obj, buffer, *args, **kwargs)
        raw = buffer.getvalue()
        f.write(raw[:len(raw) // 2])
        f.flush()
        stops = session.current().stops
        before = len(stops.received)
        os.kill(os.getpid(), signal.SIGTERM)
        while len(stops.received) == before:  # os.kill runs the Python handler at once; wait for it regardless
            time.sleep(0.001)
        write(marker, {"written": len(raw) // 2, "of": len(raw), "received": session.current().stops.received})
        f.write(raw[len(raw) // 2:])
    torch.save = save


def wait_for_signals(out, tag, rank, ranks):
    """Return once every rank of ``ranks`` has received a stop signal: each writes its ``signalled`` file when
    its signal is recorded (the test sends the signals after it saw the ready files)."""
    mine = os.path.join(out, f"{tag}_signalled_rank{rank}.json")
    wanted = [os.path.join(out, f"{tag}_signalled_rank{r}.json") for r in ranks]
    while not all(os.path.exists(path) for path in wanted):
        if rank in ranks and not os.path.exists(mine) and session.current().stops.pending:
            write(mine, {"received": list(session.current().stops.received)})
        time.sleep(0.01)  # polls for the files, whatever the time they take


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--tag", required=True)
    parser.add_argument("--wait-for-signal", default="", help="ranks, e.g. 0,1: after the ready checkpoint every "
                        "rank waits until these ranks received their stop signal")
    parser.add_argument("--signal-in-save", action="store_true")
    parser.add_argument("--first-ask-after-ready", action="store_true")
    parser.add_argument("--signal-self-at-ready", type=int, default=None)
    args = parser.parse_args()

    ud.init(gradient_accumulation_steps=ACCUMULATION, timeout=60)
    rank, world = ud.rank(), ud.world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT", "0")))
    tag = f"{args.tag}_r{restart}" if restart else args.tag
    ud.seed_everything(1234)
    model = torch.nn.Linear(3, 1).double()
    weight, bias = initial_weights()
    with torch.no_grad():
        model.weight.copy_(weight)
        model.bias.copy_(bias)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = data()
    loader = DataLoader(TensorDataset(x, y), batch_size=GLOBAL // world, shuffle=False)
    model, optimizer, loader = ud.prepare(model, optimizer, loader)

    state = {"model": model, "optimizer": optimizer, "loader": loader, "rng": ud.RNG, "step": 0}
    resumed_from = ud.latest_checkpoint(args.dir)
    if resumed_from:
        ud.load(resumed_from, state)
    step = state["step"]
    first_step = step
    calls = [0]
    count_primitives(calls)
    micro_steps = []
    ready = False

    def dump_calls():
        write(os.path.join(args.out, f"{tag}_calls_rank{rank}.json"), micro_steps)

    while step < TOTAL_STEPS:
        for xb, yb in loader:
            before = calls[0]
            with ud.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(xb), yb)
                ud.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            synced = ud.sync_gradients()
            stop = ud.should_stop() if ready or resumed_from or not args.first_ask_after_ready else False
            micro_steps.append([synced, calls[0] - before])
            if synced:
                step += 1
            if stop:
                write(os.path.join(args.out, f"{tag}_stop_rank{rank}.json"),
                      {"step": step, "steps_taken": optimizer.steps_taken, "world": world, "pid": os.getpid(),
                       "first_step": first_step, "resumed_from": resumed_from, "time": time.time(),
                       "received": list(session.current().stops.received)})
                dump_calls()
                if args.signal_in_save and rank == 0:
                    signal_halfway_through_save(os.path.join(args.out, f"{tag}_save_signal.json"))
                state["step"] = step
                ud.save_checkpoint(state, args.dir, step)
                try:
                    ud.requeue()
                except SystemExit as leaving:  # the status this rank leaves with, seen by the rank itself
                    write(os.path.join(args.out, f"{tag}_exit_rank{rank}.json"), {"code": leaving.code})
                    raise
            if not resumed_from and step == READY_STEP and synced:
                state["step"] = step
                ud.save_checkpoint(state, args.dir, step)
                write(os.path.join(args.out, f"{tag}_ready_rank{rank}.json"), {"pid": os.getpid(), "world": world})
                ready = True
                if args.signal_self_at_ready == rank:
                    os.kill(os.getpid(), signal.SIGTERM)
                if args.wait_for_signal:
                    wait_for_signals(args.out, tag, rank, [int(r) for r in args.wait_for_signal.split(",")])
            if step == TOTAL_STEPS:
                break
    dump_calls()
    write(os.path.join(args.out, f"{tag}_done_rank{rank}.json"),
          {"step": step, "world": world, "first_step": first_step, "resumed_from": resumed_from,
           "weight": ud.unwrap(model).weight.detach().reshape(-1).tolist(),
           "bias": ud.unwrap(model).bias.detach().reshape(-1).tolist(), "launcher": ud.launcher()})


if __name__ == "__main__":
    sys.exit(main())
