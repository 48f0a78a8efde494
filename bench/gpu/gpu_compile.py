"""Where ``compile=`` time goes on one GPU: eager vs ``torch.compile`` without the facade, and eager vs
``ud.init(compile="inductor")`` through ``ud.prepare``, on the same model, batch and SGD steps.

    python bench/gpu/gpu_compile.py --out bench/gpu/results/gpu_compile.json

Each variant: a fresh model (same seed), ``--warmup`` steps (the compile), then ``--steps`` timed steps
(forward, backward, SGD step, zero_grad) between two ``torch.cuda.synchronize()``; dynamo's counters
(graphs, graph breaks, recompiles) are read per variant. Needs a CUDA GPU and transformers.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench" / "shared"))
import provenance  # noqa: E402
import unified_dist as ud  # noqa: E402

SIZES = {"bert_2x256": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, intermediate_size=1024),
         "bert_6x768": dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, intermediate_size=3072)}


def model_of(size: str):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **SIZES[size])
    return BertForSequenceClassification(config)


def batch_of(n: int, length: int, device) -> dict:
    g = torch.Generator().manual_seed(2)
    return {"input_ids": torch.randint(0, 1000, (n, length), generator=g).to(device),
            "labels": torch.randint(0, 2, (n,), generator=g).to(device)}


def timed(model, opt, batch, backward, steps: int, warmup: int) -> tuple:
    import torch._dynamo.utils as dynamo_utils

    dynamo_utils.counters.clear()

    def step():
        backward(model(**batch).loss)
        opt.step()
        opt.zero_grad()
    start = time.perf_counter()
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - start) / steps
    c = dynamo_utils.counters
    return {"step_ms": 1e3 * per_step, "warmup_s": warm, "graphs": c["stats"].get("unique_graphs", 0),
            "graph_breaks": sum(c["graph_break"].values()), "recompiles": c["recompiles"].get("recompiles", 0)
            if "recompiles" in c else 0}


def variant(name: str, size: str, batch_size: int, length: int, steps: int, warmup: int) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    device = torch.device("cuda")
    if name.startswith("ud_"):
        ud.init("torch", **({"compile": "inductor"} if name == "ud_compile" else {}))
        try:
            model = model_of(size)
            model, opt = ud.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3))
            return timed(model, opt, batch_of(batch_size, length, ud.device()), ud.backward, steps, warmup)
        finally:
            ud.shutdown()
    model = model_of(size).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if name == "torch_compile":
        model = torch.compile(model)
    return timed(model, opt, batch_of(batch_size, length, device), torch.Tensor.backward, steps, warmup)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu/gpu_compile.py needs a CUDA GPU")
    record = {**provenance.start(), "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "batch": [args.batch, args.length], "steps": args.steps, "warmup": args.warmup, "results": {}}
    for size in args.sizes.split(","):
        rows = record["results"][size] = {}
        for name in ("eager", "torch_compile", "ud_eager", "ud_compile"):
            rows[name] = variant(name, size, args.batch, args.length, args.steps, args.warmup)
            print(size, name, json.dumps(rows[name]), flush=True)
        rows["speedup_torch"] = rows["eager"]["step_ms"] / rows["torch_compile"]["step_ms"]
        rows["speedup_ud"] = rows["ud_eager"]["step_ms"] / rows["ud_compile"]["step_ms"]
        print(size, "speedup torch.compile", round(rows["speedup_torch"], 3),
              "ud compile", round(rows["speedup_ud"], 3))
    provenance.finish(record)
    record.pop("cpu_ticks_before", None)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
