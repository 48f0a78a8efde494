"""What the run reports: the start-up lines, ``metrics.jsonl`` (and the experiment trackers of
``--report-to``: TensorBoard, MLflow, W&B, trackio, through ``unified_dist.trackers``), the loss
window behind each logged line, the progress bar, and the evaluation metrics. Written by the main
process; every ``metrics.jsonl`` line names the launch.
"""
import contextlib
import glob
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional

import torch

import plots
import unified_dist as ud
from args import UserError
from modeling import DEFAULT_MODEL
from unified_dist import trackers


def quiet_libraries() -> None:
    """No progress bars or advisory warnings from transformers and datasets (ours is enough)."""
    import datasets
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()


def print_launch(args: Any, threads: int, global_batch: int) -> None:
    """Who launched us, and the global batch (never silently multiplied by the world size)."""
    world, data_parallel = ud.world_size(), ud.data_parallel_world_size()
    mesh = ud.device_mesh()  # the layout, with --sharding fsdp, --dp-replicate or --tp (or the launcher's)
    layout = "" if mesh is None else " | mesh " + " x ".join(
        f"{name} {size}" for name, size in zip(mesh.mesh_dim_names, mesh.shape))
    stage = ud.zero_stage()  # DeepSpeed's engine (--zero-stage, or the launcher's): its stage says how it shards
    sharding = f"sharding {ud.sharding_mode()}{layout}" if stage is None else f"ZeRO stage {stage}"
    ud.print(f"launcher {ud.launcher()} | backend {ud.backend_name()} | world size {world} | device {ud.device()} "
             f"| {threads} torch thread(s) per process | mixed precision {ud.mixed_precision()} | {sharding}")
    sharers = "tensor-parallel processes" if ud.pipeline_stages() == 1 else "processes: pipeline stages x tp"
    shared = f" (each batch shared by {world // data_parallel} {sharers})" if data_parallel != world else ""
    ud.print(f"global batch = {args.batch_size} per process x {data_parallel} process(es){shared} x "
             f"{args.grad_accum} grad-accum = {global_batch} examples per optimizer step")


def print_model_and_data(args: Any, model: torch.nn.Module, splits: Any) -> None:
    """The model's size and the examples each split holds."""
    ud.print(f"model {args.model or DEFAULT_MODEL}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M "
             f"parameters{' (dropout off)' if args.no_dropout else ''}")
    ud.print(f"data {splits.source}; " + "; ".join(splits.notes))
    ud.print(f"examples: train {len(splits.train)} {splits.train_labels} (of {splits.train_pool}), "
             f"validation {len(splits.validation)}, test {len(splits.test)} (labels 0=negative, 1=positive)")


def print_parameters_held(model: torch.nn.Module, whole: Optional[int] = None) -> None:
    """Every process: how many of the model's weights it holds, all of them, or with --sharding fsdp its
    shard (about 1/world size, with --dp-replicate R about R/world size; with --tp, the planned layers'
    1/T; a sharded parameter is a DTensor whose local part is this process's); with --pp its stage's.
    ``whole``: the whole model's count where ``model`` holds a part of it only (a pipeline stage)."""
    held = sum(_held(p) for p in model.parameters())
    total = whole or sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    print(f"rank {ud.rank()} holds {held} of the model's {total} parameter elements", flush=True)


def _held(p: torch.Tensor) -> int:
    """The elements of ``p`` this process holds: a DTensor's local part; under ZeRO-3, DeepSpeed's partition
    (``ds_tensor``; the parameter itself is then an empty placeholder, its full size ``ds_numel``)."""
    if hasattr(p, "ds_tensor"):
        return min(p.ds_tensor.numel(), p.ds_numel)  # the partition is padded to a size the ranks divide
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


def print_compiled(model: torch.nn.Module) -> None:
    """With --compile: which modules ``ud.prepare`` compiled in place (the whole model, or its blocks
    one by one under --sharding fsdp / --tp); nothing when none was."""
    compiled = [(name, module) for name, module in model.named_modules()  # forward = compiled forward
                if hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable")]
    if compiled:
        name, module = compiled[0]
        what = type(module).__name__ if len(compiled) == 1 else f"{len(compiled)} blocks ({name}, ...)"
        ud.print(f"torch.compile: {what} compiled in place; the first steps include compiling")


def print_plan(args: Any, plan: Any, out: str) -> None:
    """How many optimizer steps, and when the splits are evaluated."""
    ud.print(f"{plan.steps_per_epoch} optimizer steps per epoch, {plan.total_steps} in total "
             f"({plan.warmup} warm-up), lr {args.lr:g}, output {out}")
    schedule = f"every {plan.eval_every} optimizer steps, " if plan.eval_every else ""
    ud.print(f"evaluation: validation {schedule}at each epoch's end and at the end; test once, at the end")


@dataclass
class LogWindow:
    """The training since the last logged line: its losses, samples and training time.

    The logged loss is the mean over the window's optimizer steps of each step's mean micro-batch loss,
    each averaged over the processes. The losses stay on the device (float64 sums, detached): adding one
    reads nothing back, so a micro-step makes no host sync and no collective for the log (on a GPU an
    ``.item()`` waits for the queue to drain). ``row`` averages the window's sum over the processes and
    reads it, once per logged line; every process calls it (it is a collective).
    """

    step_sum: Optional[torch.Tensor] = None  # sum over the window's steps of each step's mean micro-batch loss
    steps: int = 0  # optimizer steps in the window
    micro_sum: Optional[torch.Tensor] = None  # sum of the micro-batch losses of the optimizer step under way
    micros: int = 0
    samples: int = 0
    t0: float = field(default_factory=time.time)

    def add(self, loss: torch.Tensor, samples: int) -> None:
        """One micro-batch's loss (this process's, a tensor on the device) and the samples it covered
        on every process."""
        loss = loss.detach().to(torch.float64)
        self.micro_sum = loss if self.micro_sum is None else self.micro_sum + loss
        self.micros += 1
        self.samples += samples

    def end_step(self) -> None:
        mean = self.micro_sum / self.micros  # each step weighs the same, however many micro-batches it had
        self.step_sum = mean if self.step_sum is None else self.step_sum + mean
        self.steps += 1
        self.micro_sum, self.micros = None, 0

    def row(self, lr: float) -> Dict[str, float]:
        """The line to log (mean loss, learning rate, samples/s); starts the next window. A collective."""
        loss = ud.all_reduce(self.step_sum, "mean").item() / self.steps  # the one host sync per logged line
        elapsed = max(time.time() - self.t0, 1e-9)
        row = {"loss": loss, "lr": lr, "samples_per_s": self.samples / elapsed}
        self.step_sum, self.steps, self.samples, self.t0 = None, 0, 0, time.time()
        return row

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Time spent inside does not count as training time (the window's samples/s stays honest)."""
        start = time.time()
        yield
        self.t0 += time.time() - start


def log_step(log: "MetricsLog", progress: Any, window: LogWindow, lr: float, step: int, epoch: int,
             due: bool) -> None:
    """After an optimizer step: close it in the window; if ``due`` (every --log-every steps and at the
    last), one metrics.jsonl line and the progress bar's numbers; advance the bar."""
    window.end_step()
    if due:
        row = window.row(lr)
        log.write(type="train", step=step, epoch=epoch, **row)
        progress.set_postfix(loss=f"{row['loss']:.4f}", lr=f"{lr:.2e}", samples_s=f"{row['samples_per_s']:.1f}",
                             refresh=False)
    progress.update(1)


def make_progress(no_progress: bool, total_steps: int, done: int) -> Any:
    """A tqdm bar of optimizer steps on the main process (disabled elsewhere and with --no-progress)."""
    from tqdm.auto import tqdm

    return tqdm(total=total_steps, initial=done, desc="train", unit="step", dynamic_ncols=True,
                disable=no_progress or not ud.is_main(), mininterval=1.0)


def say(progress: Any, message: str) -> None:
    """One line on the main process, above the progress bar rather than through it."""
    if progress is not None and not progress.disable:
        progress.write(message)
    else:
        ud.print(message)


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


def require_trackers(report_to: str) -> List[str]:
    """The trackers ``--report-to`` asks for besides ``metrics.jsonl`` (always written); a missing library
    is a one-line UserError naming its install (checked on every rank, so that all of them stop)."""
    chosen = [name for name in trackers.names(report_to) if name != "jsonl"]
    for name in chosen:
        try:
            trackers.KINDS[name].require()
        except trackers.TrackerNotInstalled as exc:
            raise UserError(f"--report-to {name}: {exc}, or use --report-to jsonl") from None
    return chosen


def start_trackers(chosen: List[str], out: str, resume_step: Optional[int], args: Any) -> None:
    """unified_dist's trackers for ``chosen`` (main process writes), the arguments as hyper-parameters.

    TensorBoard writes to ``OUTPUT_DIR/tensorboard``; a resumed run drops what was logged after its
    checkpoint: ``purge_step`` makes TensorBoard's readers discard the earlier events at steps
    >= resume_step + 1, the way ``metrics.jsonl`` keeps only its lines up to the checkpoint. A fresh start
    removes old event files, as it starts ``metrics.jsonl`` afresh. MLflow and W&B start a new run each
    launch (``OUTPUT_DIR/mlruns``, ``OUTPUT_DIR/wandb``).
    """
    directory = os.path.join(out, "tensorboard")
    if resume_step is None and ud.is_main():
        for old in glob.glob(os.path.join(directory, "events.out.tfevents.*")):
            os.remove(old)
    purge = None if resume_step is None else resume_step + 1
    kwargs = {"tensorboard": {"log_dir": directory, "purge_step": purge}} if "tensorboard" in chosen else {}
    trackers.start(chosen, project_dir=out, project_name="bert_sentiment", config=vars(args), init_kwargs=kwargs)


class MetricsLog:
    """``metrics.jsonl`` (and the trackers of ``--report-to``), written by the main process; every line
    names the launch."""

    TRACKER_TAGS = {"loss": "train/loss", "lr": "train/learning_rate", "samples_per_s": "train/samples_per_s",
                    "accuracy": "{split}/accuracy", "macro_f1": "{split}/macro_f1"}

    def __init__(self, path: str, resume_step: Optional[int], chosen: List[str], args: Any, start: float) -> None:
        self.path = path
        self.start = start  # when the run started (time_s counts from it)
        self.common = {"launcher": ud.launcher(), "backend": ud.backend_name(), "world_size": ud.world_size()}
        self.tracking = bool(chosen)
        if chosen:  # every rank: trackers.start checks on each, and only the main process writes
            start_trackers(chosen, os.path.dirname(os.path.abspath(path)), resume_step, args)
            launch = " | ".join(f"{key} {value}" for key, value in self.common.items())
            trackers.log({"launch": launch}, step=resume_step or 0)
        if not ud.is_main():
            return
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = []
        if resume_step is not None:  # keep the history up to the checkpoint, drop what came after it
            kept = [r for r in plots.read_metrics(path) if r.get("step", 0) <= resume_step]
        with open(path, "w") as handle:
            for row in kept:
                handle.write(json.dumps(row) + "\n")

    def write(self, **row: Any) -> None:
        """Append one line (main process only), and its numbers to the trackers."""
        if not ud.is_main():
            return
        # time_s: wall seconds since the start; cpu_s: CPU seconds this process used (every thread)
        row = {**row, **self.common, "time_s": round(time.time() - self.start, 2),
               "cpu_s": round(time.process_time(), 2)}
        with open(self.path, "a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self.tracking:
            trackers.log({tag.format(split=row.get("split")): row[key] for key, tag in self.TRACKER_TAGS.items()
                          if key in row}, step=row["step"])

    def close(self) -> None:
        if self.tracking:
            trackers.finish()
