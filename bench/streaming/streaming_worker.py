"""One launch of bench/streaming/streaming.py: the BERT example's ``main()`` (examples/bert_sentiment/train.py),
run in this process once per entry of a plan, with the training CSV files each run opens recorded.

    torchrun --standalone --nproc_per_node 2 bench/streaming/streaming_worker.py --plan PLAN.json --out DIR
    python bench/streaming/streaming_worker.py --plan PLAN.json --out DIR          # 1 process

PLAN.json is a list of ``{"name": ..., "argv": [...]}``: each entry is one whole run of the example
(``ud.init`` .. ``ud.shutdown``) with those flags, one after the other in the same processes, so the
configurations being compared share the launch, the imports and the machine's moment.

What each rank reads from the stream is counted from the files it opens: a ``sys.addaudithook`` hook
sees every ``open`` the process makes (datasets' streaming CSV reader opens local files through
fsspec and the built-in ``open``), and those of the example's training CSVs (``train-*.csv``) opened
for reading count with their size. The reader parses each file it opens to the end once per epoch, so
the sizes are the bytes it read (checked once against a wrapper counting each ``read`` of the files
a rank split by shards opened: equal to its file's size, and nothing from the other file); no
datasets or pandas internals are patched.

After each run, the same flags' training loader alone (:func:`data_pass`): built by the example's own
``data.tokenised_splits`` / ``data.make_loaders``, through ``ud.prepare``, iterated for one epoch with
no model: the seconds this rank spends getting its batches (reading, tokenising on the fly, cutting
the stream, collating), which the training loop's samples/s cannot separate from the noise of a
shared machine. Per rank and run: ``DIR/rank<R>.json`` (rewritten after every run, so finished runs
survive a later failure).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "bert_sentiment" / "train.py"

_opened: List[str] = []


def is_training_csv_read(path: object, mode: object) -> bool:
    """Whether an ``open`` audit event is a read of one of the example's training CSV files."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        return False
    name = os.path.basename(os.fsdecode(path))
    writing = isinstance(mode, str) and any(c in mode for c in "wax+")
    return name.startswith("train-") and name.endswith(".csv") and not writing


def _audit(event: str, args: tuple) -> None:
    if event == "open" and args and is_training_csv_read(args[0], args[1] if len(args) > 1 else None):
        _opened.append(os.fsdecode(args[0]))


def load_train():
    """examples/bert_sentiment/train.py as a module (it puts its own folder on sys.path)."""
    spec = importlib.util.spec_from_file_location("bert_sentiment_train", TRAIN)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def data_pass(train, argv: List[str]) -> dict:
    """One epoch of the run's prepared training loader with no model: this rank's examples and seconds."""
    from transformers import AutoTokenizer

    ud, data = train.ud, train.sentiment_data
    args = train.parse_args(argv)
    ud.init()
    try:
        ud.seed_everything(args.seed)
        tokenizer = AutoTokenizer.from_pretrained(train.modeling.resolve_model(args.model))
        with ud.main_process_first():  # the run just made the caches: this only reads them
            splits = data.tokenised_splits(args, tokenizer, os.path.abspath(args.cache_dir))
        loader = ud.prepare(data.make_loaders(args, splits, tokenizer, args.batch_size * ud.world_size())[0])
        ud.barrier()
        start, examples = time.perf_counter(), 0
        for batch in loader:
            examples += int(batch["labels"].shape[0])
        seconds = time.perf_counter() - start
        ud.barrier()
    finally:
        ud.shutdown()
    return {"examples": examples, "seconds": seconds}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--plan", required=True)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    plan = json.loads(Path(args.plan).read_text())
    rank = int(os.environ.get("RANK", "0"))
    train = load_train()
    sys.addaudithook(_audit)
    record = []
    for entry in plan:
        _opened.clear()
        code = train.main(entry["argv"])
        if code != 0:
            raise SystemExit(f"{entry['name']}: train.py exited with {code}")
        opened = [{"path": path, "bytes": os.path.getsize(path)} for path in _opened]
        record.append({"name": entry["name"], "opened": opened, "bytes": sum(o["bytes"] for o in opened),
                       "data_only": data_pass(train, entry["argv"])})
        (Path(args.out) / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
        if rank == 0:  # the checkpoints and the final model (~360 MB a run) are not measured: keep the disk
            out = Path(entry["argv"][entry["argv"].index("--output-dir") + 1])
            shutil.rmtree(out / "checkpoints", ignore_errors=True)
            shutil.rmtree(out / "final_model", ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
