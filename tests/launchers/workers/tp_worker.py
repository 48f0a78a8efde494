"""Tensor parallelism checked against one process, run in each rank of ``torchrun --nproc_per_node 2``.

    torchrun --standalone --nproc_per_node 2 tests/launchers/workers/tp_worker.py OUT_DIR

For each model: (a) a tiny tied-embedding MLP with a dict plan using every supported style, (b) a tiny
``LlamaForCausalLM`` built offline with plan "auto", it seeds the model, applies the plan on a CPU
(gloo) mesh of the 2 ranks to a deep copy, runs 3 AdamW steps in float64 on fixed data in both the sharded copy
and the plain one-process copy (each rank trains its own plain copy: no communication, so it is the
single-process reference), and records:

- ``param_err``: max |full_tensor(sharded param) - plain param| after the 3 steps;
- ``loss_err``: max |sharded loss - plain loss| over the steps;
- ``grad_err``: after the first backward, max |grad - plain grad| over every parameter;
- ``sharded``: the names of the DTensor parameters (with their placements), ``plain``: the others;
- ``plain_grads``: the first-step gradients of the plain-tensor (unplanned) parameters, for the test to
  compare across ranks.

Results go to OUT_DIR/tp_rank<R>.json; the test asserts on them (expected values are the plain copy's).
"""
from __future__ import annotations

import copy
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from unified_dist.parallel.tensor_parallel import apply_tp_plan, resolve_plan

STEPS = 3
LR = 1e-3
DTYPE = torch.float64
"""Both copies train in float64: the sharded copy sums its split matmuls in another order than the plain one,
and AdamW turns a rounding difference in a gradient near 0 into a visible one (in float32 the llama case moved
a weight by 5.4e-6 of a 1e-3 step, measured on an AMD EPYC 2026-11-28; 3.7e-6 on another CPU): float64
makes that rounding 2**-29 times smaller, so the test's bounds no longer depend on the CPU's kernels
(tests/unit/parallel/test_tensor_parallel.py). Gloo and DTensor run float64 as they run float32."""
BATCH, SEQ, VOCAB = 4, 8, 128


class TiedMLP(nn.Module):
    """Embedding → w1 (colwise) → gelu → w2 (rowwise) → norm (unplanned) → w3 (rowwise_split_input) →
    head (colwise_gather_output) whose weight IS the embedding's (tied)."""

    def __init__(self, vocab=VOCAB, hidden=32, inner=64):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(nn.ModuleDict({"w1": nn.Linear(hidden, inner), "w2": nn.Linear(inner, hidden)})
                                    for _ in range(2))
        self.norm = nn.LayerNorm(hidden)
        self.w3 = nn.Linear(hidden, hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block["w2"](torch.nn.functional.gelu(block["w1"](x)))
        x = self.w3(self.norm(x))
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


MLP_PLAN = {"embed": "embedding_rowwise", "blocks.*.w1": "colwise", "blocks.*.w2": "rowwise",
            "w3": "rowwise_split_input", "head": "colwise_gather_output"}


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def llama_loss(model, ids, labels):
    return model(input_ids=ids, labels=labels).loss


def full(t):
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_case(make, plan, loss_fn, mesh):
    torch.manual_seed(0)
    plain = make().to(DTYPE)
    sharded = copy.deepcopy(plain)
    apply_tp_plan(sharded, resolve_plan(sharded, plan, tp=mesh.size()), mesh)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ), generator=g)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.1) for m in (plain, sharded)]
    out = {"loss_err": 0.0, "grad_err": 0.0, "plain_grads": {}}
    for step in range(STEPS):
        losses = []
        for model, optimizer in zip((plain, sharded), optimizers):
            optimizer.zero_grad()
            loss = loss_fn(model, ids[step], labels[step])
            loss.backward()
            losses.append(loss.item())
        out["loss_err"] = max(out["loss_err"], abs(losses[0] - losses[1]))
        if step == 0:
            for (name, p), q in zip(plain.named_parameters(), sharded.parameters()):
                out["grad_err"] = max(out["grad_err"], float((full(q.grad) - p.grad).abs().max()))
                if not isinstance(q, DTensor):
                    out["plain_grads"][name] = q.grad.flatten().tolist()
        for optimizer in optimizers:
            optimizer.step()
    out["param_err"] = max(float((full(q) - p).abs().max()) for p, q in zip(plain.parameters(), sharded.parameters()))
    out["sharded"] = {n: str(q.placements) for n, q in sharded.named_parameters() if isinstance(q, DTensor)}
    out["sharded_grads"] = sorted(n for n, q in sharded.named_parameters() if isinstance(q.grad, DTensor))
    out["plain"] = sorted(n for n, q in sharded.named_parameters() if not isinstance(q, DTensor))
    out["final_loss"] = losses[1]
    out["plain_model_dtensors"] = sum(isinstance(p, DTensor) for p in plain.parameters())
    out["tied"] = isinstance(sharded, TiedMLP) and sharded.head.weight is sharded.embed.weight
    return out


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {}
    for case, make, plan, loss_fn in (("mlp", TiedMLP, MLP_PLAN, lambda m, i, y: m(i, y)),
                                      ("llama", llama, "auto", llama_loss)):
        try:
            results[case] = run_case(make, plan, loss_fn, mesh)
        except Exception:  # recorded for the test; both ranks run the same collectives, so none hangs
            results[case] = {"error": traceback.format_exc()}
    with open(os.path.join(out_dir, f"tp_rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
