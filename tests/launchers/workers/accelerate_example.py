"""A small Accelerate training script in the shape of Accelerate's ``examples/nlp_example.py`` and
``by_feature/checkpointing.py`` (written for these tests; no hub access): a classifier that returns
``.loss``/``.logits`` as a transformers model does, seeded random data, AdamW with a linear warm-up
schedule, gradient accumulation through ``accelerator.accumulate``, gradient clipping, evaluation
through ``gather_for_metrics`` over an uneven split, ``save_state`` after the first epoch.

tests/launchers/test_accelerate_compat.py runs it as written (``from accelerate import Accelerator``) and with
that one line changed to ``from unified_dist.accelerate import Accelerator``, under several launchers.

    --out FILE      the main process appends one JSON line per run: float64 parameter sum, final lr, ...
    --save DIR      save_state(DIR) at the end of the first epoch (the run goes on: its end is the uninterrupted one)
    --resume DIR    after the full run, a second run in the same process: load_state(DIR), then the epochs left
"""
import argparse
import gc
import json
import types

import torch
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, set_seed
from torch.utils.data import DataLoader, TensorDataset

EPOCHS = 3


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Dropout(0.1),
                                       torch.nn.Linear(32, 2))

    def forward(self, x, labels):
        logits = self.net(x)
        return types.SimpleNamespace(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)


def examples(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, (x[:, :4].sum(1) > 0).long())


def collate(rows):
    x, labels = zip(*rows)
    return {"x": torch.stack(x), "labels": torch.stack(labels)}


def train(args, resume=None):
    # a seedable sampler makes epoch e's order a function of (seed, e): a resumed run sees the same batches
    accelerator = Accelerator(gradient_accumulation_steps=2, cpu=args.cpu,
                              dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(42)
    train_dl = DataLoader(examples(96, 1), batch_size=8, shuffle=True, drop_last=True, collate_fn=collate)
    eval_dl = DataLoader(examples(37, 2), batch_size=8, collate_fn=collate)
    model = Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    total = len(train_dl) * EPOCHS // 2
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 3) * max(0.0, 1 - s / total))
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    start = 0
    if resume:
        accelerator.load_state(resume)
        start = 1
    accuracy, lrs = [], []
    for epoch in range(start, EPOCHS):
        model.train()
        train_dl.set_epoch(epoch)
        for batch in train_dl:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        model.eval()
        correct, seen = 0, 0
        for batch in eval_dl:
            with torch.no_grad():
                predictions = model(**batch).logits.argmax(-1)
            predictions, references = accelerator.gather_for_metrics((predictions, batch["labels"]))
            correct += (predictions == references).sum().item()
            seen += len(references)
        accuracy.append([correct, seen])
        lrs.append(scheduler.get_last_lr()[0])
        accelerator.print(f"epoch {epoch}: {correct}/{seen}")
        if epoch == 0 and args.save and not resume:  # at the epoch's end, as by_feature/checkpointing.py
            accelerator.save_state(args.save)
    total_sum = sum(p.detach().double().sum() for p in accelerator.unwrap_model(model).parameters())
    sums = accelerator.gather(total_sum.reshape(1).to(accelerator.device)).tolist()
    assert len(set(sums)) == 1, f"the processes' parameters differ: {sums}"
    first = next(iter(accelerator.unwrap_model(model).parameters()))
    reduced = accelerator.reduce(torch.tensor([accelerator.process_index + 1.0], device=accelerator.device))
    result = {"run": "resume" if resume else "full", "param_sum": sums[0], "lr": lrs, "accuracy": accuracy,
              "reduce": reduced.item(), "optimizer_steps": optimizer.optimizer.state[first]["step"].item(),
              "num_processes": accelerator.num_processes,
              "distributed_type": str(accelerator.distributed_type), "class": type(accelerator).__module__}
    if accelerator.is_main_process and args.out:
        with open(args.out, "a") as f:
            f.write(json.dumps(result) + "\n")
    return accelerator


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--out")
    p.add_argument("--save")
    p.add_argument("--resume")
    args = p.parse_args()
    accelerator = train(args)
    if args.resume:
        accelerator = train(args, resume=args.resume)
    accelerator.end_training()
    # Accelerate keeps each Accelerator's DDP models, whose reducers hold the gloo group past end_training();
    # freed only at interpreter exit, gloo's threads then abort the process now and then (SIGABRT, "terminate
    # called without an active exception": 4 of 8 resumed runs under real Accelerate, torch 2.13). Here the
    # last references go while Python is still whole (unified_dist.accelerate frees the reducers itself).
    del accelerator
    gc.collect()


if __name__ == "__main__":
    main()
