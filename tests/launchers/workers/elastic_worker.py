"""A training job that loses a process mid-run and must finish anyway.

    <launcher> tests/launchers/workers/elastic_worker.py --out DIR [--kill-at STEP] [--kill-rank R]

Uses ud.ElasticState + ud.elastic_run, committing every 4 steps. With --kill-at, rank R
SIGKILLs itself once (a marker file in DIR makes it happen only on the first attempt).
Rank 0 writes DIR/result.json with the final weights; every entry into train() is logged to
DIR/entries.jsonl (rank, world size, step at entry).
"""
import argparse
import json
import os
import signal
import time

import torch

import unified_dist as ud


def wait_for_the_replacement(state, marker, seconds=150):
    """Short-handed at the end (a horovod elastic job after losing a worker): commit until the
    replacement horovodrun discovers has joined (the commit raises HostsUpdatedInterrupt and
    elastic_run re-enters train with the larger world), rather than a pace that hopes it is in time."""
    deadline = time.monotonic() + seconds
    while ud.world_size() == 1 and os.path.exists(marker):
        if time.monotonic() > deadline:
            raise SystemExit(f"no replacement worker joined within {seconds} s")
        state.commit()
        time.sleep(0.2)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at", type=int, default=0)
    p.add_argument("--kill-rank", type=int, default=1)
    p.add_argument("--epochs", type=int, default=2)
    args = p.parse_args()
    ud.init(timeout=60)
    ud.seed_everything(3)
    g = torch.Generator().manual_seed(11)
    x = torch.randn(96, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.1
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4, shuffle=True)
    model, optimizer, loader = ud.prepare(model, optimizer, loader)
    state = ud.ElasticState(model=model, optimizer=optimizer, loader=loader, step=0, epoch=0,
                            checkpoint_dir=os.path.join(args.out, "ckpt"))
    marker = os.path.join(args.out, "killed")

    @ud.elastic_run
    def train(state):
        with open(os.path.join(args.out, "entries.jsonl"), "a") as f:
            f.write(json.dumps({"rank": ud.rank(), "world": ud.world_size(), "step": state.step,
                                "restored_from": state.restored_from}) + "\n")
        while state.epoch < args.epochs:
            for xb, yb in state.loader:
                loss = torch.nn.functional.mse_loss(state.model(xb), yb)
                ud.backward(loss)
                state.optimizer.step()
                state.optimizer.zero_grad()
                state.step += 1
                time.sleep(0.05)
                if state.step == args.kill_at and ud.rank() == args.kill_rank and not os.path.exists(marker):
                    open(marker, "w").close()
                    os.kill(os.getpid(), signal.SIGKILL)
                if state.step % 4 == 0:
                    state.commit()
            if state.epoch + 1 == args.epochs:
                wait_for_the_replacement(state, marker)
            state.epoch += 1
            state.commit()

    train(state)
    if ud.is_main():
        weights = torch.cat([p.detach().reshape(-1) for p in ud.unwrap(model).parameters()]).tolist()
        with open(os.path.join(args.out, "result.json"), "w") as f:
            json.dump({"weights": weights, "step": state.step, "epoch": state.epoch, "world": ud.world_size()}, f)


if __name__ == "__main__":
    main()
