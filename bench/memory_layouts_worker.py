"""One rank of bench/memory_layouts.py: for each layout, ``ud.init(...)``, the model through
``ud.prepare``, a few AdamW steps, then the bytes this rank holds; ``ud.shutdown()`` between layouts.

    torchrun --standalone --nproc_per_node 4 bench/memory_layouts_worker.py --model llama \
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
from typing import Dict, Iterable, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
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
def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank stores of ``t``: a DTensor's local shard, any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor):
    storage = t.untyped_storage()
    return (t.device.type, storage.data_ptr(), storage.nbytes())


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` as this rank holds them: each local tensor's ``numel * element_size``;
    the same tensor twice (a tied weight's gradient) once. Views into one flat buffer (DDP's
    gradient buckets, FSDP2's reduce-scatter output) are different tensors and each counts."""
    seen, total = set(), 0
    for t in tensors:
        local = local_tensor(t)
        key = (local.device.type, local.data_ptr(), local.numel(), local.dtype)
        if local.numel() and key in seen:
            continue
        seen.add(key)
        total += local.numel() * local.element_size()
    return total


def rank_bytes(model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> Dict[str, int]:
    """This rank's bytes of parameters, gradients and optimizer state (every tensor in
    ``optimizer.state``: AdamW's exp_avg, exp_avg_sq and step)."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    state = [] if optimizer is None else [v for entry in optimizer.state.values() for v in entry.values()
                                          if isinstance(v, torch.Tensor)]
    out = {"params": tensor_bytes(params), "grads": tensor_bytes(grads), "optimizer": tensor_bytes(state)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def blocks(model: torch.nn.Module):
    """The repeated blocks FSDP2 shards one by one and activation checkpointing wraps, chosen as
    unified_dist's sharding docs say: the classes in ``_no_split_modules``, else the children of
    every ``nn.ModuleList``."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    if names:
        return [m for m in model.modules() if m is not model and type(m).__name__ in names]
    return [c for m in model.modules() if isinstance(m, torch.nn.ModuleList) for c in m]


def _plain_tensors(t: torch.Tensor) -> list:
    """The plain tensors holding ``t``'s data on this rank: a DTensor's local shard, the inner
    tensors of any other wrapper subclass (e.g. the ``AsyncCollectiveTensor`` a tensor-parallel
    row-wise layer returns, which has no storage of its own), else ``t``. No autograd node is
    recorded (it runs inside a pack hook)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(t, DTensor):
            return _plain_tensors(t.to_local())
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [p for name in names for p in _plain_tensors(getattr(t, name))]
    return [t]


class SavedBytes:
    """Bytes that a forward keeps for backward, counted with ``torch.autograd.graph.saved_tensors_hooks``:
    the storage each saved tensor keeps alive (its local shard's, for a DTensor), each storage once
    (``x`` and ``x.t()`` saved by two operations are one); parameters (their storage, sharded or
    gathered) excluded, they are counted as parameters;
    plus the inputs of each block in ``blocks``: a checkpointed block holds them (in its recompute
    closure, which no saved-tensor hook sees) to run its forward again in backward, and a
    checkpointed block's own saved tensors go to the checkpoint's hooks, not these. Without
    checkpointing, a block's input is saved by its first operation anyway (the storage is counted
    once), so adding it costs the plain run nothing."""

    def __init__(self, model: torch.nn.Module, watched_blocks=()):
        self.model = model
        self.blocks = list(watched_blocks)
        self.seen = set()
        self.bytes = 0
        self.count = 0
        self._handles = []
        self._hooks = None

    def _param_keys(self):
        return {_storage_key(t) for p in self.model.parameters() for t in _plain_tensors(p)}

    def _add(self, t: torch.Tensor, params=None) -> None:
        if not isinstance(t, torch.Tensor):
            return
        for local in _plain_tensors(t):
            if local.untyped_storage().nbytes() == 0:
                continue
            key = _storage_key(local)
            if key in self.seen or key in (params if params is not None else self._param_keys()):
                continue
            self.seen.add(key)
            self.bytes += local.untyped_storage().nbytes()
            self.count += 1

    def _pack(self, t):
        self._add(t)
        return t

    def _block_inputs(self, module, args, kwargs):
        params = self._param_keys()
        for value in [*args, *kwargs.values()]:
            for t in (value if isinstance(value, (tuple, list)) else (value,)):
                self._add(t, params)

    def __enter__(self):
        for block in self.blocks:
            self._handles.append(block.register_forward_pre_hook(self._block_inputs, with_kwargs=True))
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles = []
        return False


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
