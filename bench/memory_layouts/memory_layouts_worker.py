"""One rank of bench/memory_layouts/memory_layouts.py: for each layout, ``ud.init(...)``, the model through
``ud.prepare``, a few AdamW steps, then the bytes this rank holds; ``ud.shutdown()`` between layouts.

    torchrun --standalone --nproc_per_node 4 bench/memory_layouts/memory_layouts_worker.py --model llama \
        --layouts ddp,fsdp,hsdp,fsdp_tp,fsdp_ac --steps 3 --out DIR

Per layout and rank (DIR/rank<R>.json): the bytes of this rank's parameters, gradients (after the
last backward, before ``zero_grad``) and AdamW state (after the last step), each tensor counted as
what the rank stores: a ``DTensor`` by its local shard (``to_local()``), anything else whole, each
storage once (:func:`rank_bytes`); the bytes saved for backward by the first step's forward
(:class:`SavedBytes`); the wall time of each step. The functions here are also what
tests/bench/test_bench_memory_layouts.py checks in-process.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "bert_sentiment"

LAYOUTS = {  # name -> (ud.init keywords, processes it runs on)
    "ddp": (dict(), None),
    "fsdp": (dict(sharding="fsdp"), None),
    "hsdp": (dict(sharding="fsdp", dp_replicate=2), 4),
    "fsdp_tp": (dict(sharding="fsdp", tp=2), 4),
    "tp": (dict(tp=2), 2),  # pure TP 2: the facade refuses tp < world without sharding="fsdp"
    "fsdp_ac": (dict(sharding="fsdp", activation_checkpointing=True), None),
}

LLAMA_CONFIG = dict(vocab_size=8000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                    num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=256,
                    tie_word_embeddings=False)
"""A ~97 M-parameter Llama (12 layers of 7.08 M, two 6.1 M vocabulary matrices), random weights."""

BATCH = {"bert": (16, 64), "llama": (2, 64)}  # (sequences, tokens) per data-parallel rank and step


# ------------------------------------------------------------------------------------------ counting
# The counting itself is unified_dist.parallel.accounting's (``unified-dist plan`` counts the same way).
from unified_dist.parallel.accounting import SavedBytes, local_tensor, rank_bytes, tensor_bytes  # noqa: E402,F401


def blocks(model: torch.nn.Module):
    """The repeated blocks FSDP2 shards one by one and activation checkpointing wraps, chosen as
    unified_dist's sharding docs say: the classes in ``_no_split_modules``, else the children of
    every ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        return [m for m in model.modules() if m is not model and type(m).__name__ in names]
    return [c for m in model.modules() if isinstance(m, torch.nn.ModuleList) for c in m]


# ------------------------------------------------------------------------------------------ models
def build(name: str):
    """``(model, optimizer, tp plan, batch maker)``; the same weights on every rank (fixed seed)."""
    torch.manual_seed(0)
    if name == "bert":
        sys.path.insert(0, str(EXAMPLE))
        from modeling import BERT_TP_PLAN, load_model_and_tokenizer, optimizer_groups, resolve_model

        model, _ = load_model_and_tokenizer(resolve_model(None), no_dropout=False)  # the example's default model
        optimizer = torch.optim.AdamW(optimizer_groups(model, 0.01), lr=1e-4)
        vocab, plan = model.config.vocab_size, BERT_TP_PLAN

        def batch(seed):
            g = torch.Generator().manual_seed(seed)
            n, s = BATCH["bert"]
            return {"input_ids": torch.randint(1000, vocab, (n, s), generator=g),
                    "attention_mask": torch.ones(n, s, dtype=torch.long),
                    "labels": torch.randint(0, 2, (n,), generator=g)}
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        model = LlamaForCausalLM(LlamaConfig(**LLAMA_CONFIG))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
        plan = "auto"

        def batch(seed):
            g = torch.Generator().manual_seed(seed)
            n, s = BATCH["llama"]
            ids = torch.randint(0, LLAMA_CONFIG["vocab_size"], (n, s), generator=g)
            return {"input_ids": ids, "labels": ids}
    model.train()
    return model, optimizer, plan, batch


def run_layout(name: str, model_name: str, steps: int) -> dict:
    import unified_dist as ud

    keywords, _ = LAYOUTS[name]
    model, optimizer, plan, batch = build(model_name)
    ud.init(**keywords, **({"tp_plan": plan} if keywords.get("tp", 1) > 1 else {}))
    try:
        model, optimizer = ud.prepare(model, optimizer)
        inner = ud.unwrap(model)
        inputs = batch(1000 + ud.data_parallel_rank())  # tensor-parallel peers get the same batch
        times, grads, saved = [], None, None
        for step in range(steps + 1):  # step 0: warm-up, with the saved-tensor count
            ud.barrier()
            start = time.perf_counter()
            if step == 0:
                with SavedBytes(inner, blocks(inner)) as counter:
                    loss = model(**inputs).loss
                saved = {"bytes": counter.bytes, "tensors": counter.count}
            else:
                loss = model(**inputs).loss
            ud.backward(loss)
            if step == steps:
                grads = tensor_bytes([p.grad for p in inner.parameters() if p.grad is not None])
            optimizer.step()
            if step < steps:
                optimizer.zero_grad()
            times.append(time.perf_counter() - start)
            del loss
        counted = rank_bytes(inner, optimizer)
        assert counted["grads"] == grads, (counted["grads"], grads)  # the step kept the gradients
        local_param_numel = sum(local_tensor(p).numel() for p in inner.parameters())
        return {"rank": ud.rank(), "world": ud.world_size(), "dp_world": ud.data_parallel_world_size(),
                "mesh": None if ud.device_mesh() is None else list(ud.device_mesh().shape),
                "bytes": counted, "local_param_numel": local_param_numel, "saved_for_backward": saved,
                "step_s": times[1:], "warmup_s": times[0]}
    finally:
        ud.shutdown()
        del model, optimizer
        gc.collect()


def main() -> None:
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("MEMORY_DUMP_AFTER", "1500")), exit=True)
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("bert", "llama"), required=True)
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report = {name: run_layout(name, args.model, args.steps) for name in args.layouts.split(",")}
    rank = int(os.environ.get("RANK", "0"))
    Path(args.out, f"rank{rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
