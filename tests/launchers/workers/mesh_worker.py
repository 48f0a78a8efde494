"""Layouts on a device mesh (HSDP, FSDP x TP, TP, FSDP + activation checkpointing + CPU offload),
checked inside every rank of a real 4-process launch.

    <launcher, 4 processes> tests/launchers/workers/mesh_worker.py \
        --layouts hsdp,fsdp_tp,tp,fsdp_ac_offload,llama --out DIR
    accelerate launch ... --use_parallelism_config ... tests/launchers/workers/mesh_worker.py \
        --layouts launcher --out DIR

Each layout is one ``ud.init(...)`` .. ``ud.shutdown()`` in the same processes (``launcher``: no
keyword, the launch's flags or variables choose; ``--expect R,S,T`` says what they should give).
Every check of a layout runs on every rank in the same order and asserts only afterwards, so a
failing rank does not hang the others. Results: DIR/mesh_rank<R>.json as {layout: {check: "ok" |
"FAIL: ..."}}. Expected values come from plain single-process torch and arithmetic, never from the
facade.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import traceback

import torch
import torch.optim.optimizer as torch_optimizer

import unified_dist as ud
from unified_dist import facade

sys.path.insert(0, os.path.dirname(__file__))
from contract_worker import _ReduceScatters, close, full  # noqa: E402

# The optimizers take torch's foreach kernels here, as they do by default on CUDA (on a CPU they step
# one tensor at a time): tp without FSDP leaves DTensor and plain parameters in one group, which
# those kernels refuse, so ud.prepare must hand the optimizer a group that still steps.
torch_optimizer._get_foreach_kernels_supported_devices = lambda: ["cpu", "cuda"]

LAYOUTS = {  # name -> (init keywords, (dp_replicate, dp_shard, tp) on 4 ranks)
    "hsdp": (dict(sharding="fsdp", dp_replicate=2), (2, 2, 1)),
    "fsdp_tp": (dict(sharding="fsdp", tp=2), (1, 2, 2)),
    "tp": (dict(tp=4), (1, 1, 4)),
    "fsdp_ac_offload": (dict(sharding="fsdp", activation_checkpointing=True, cpu_offload=True), (1, 4, 1)),
    "hsdp_keep": (dict(sharding="fsdp", dp_replicate=2, reshard_after_forward=False), (2, 2, 1)),
    # two hosts x 2 processes: one replica per machine, sharded among its own 2 ranks
    "hsdp_nodes": (dict(sharding="fsdp", dp_replicate="nodes"), (2, 2, 1)),
}
PLAN = {"blocks.*.w1": "colwise", "blocks.*.w2": "rowwise"}
PER_RANK = 2  # samples per data-parallel rank and micro-batch
STEPS = 2  # gradient_accumulation_steps
MAX_NORM = 0.3
"""Below every step's gradient norm in the reference (checked), so every step's clipping scales."""
LR = 0.02
DTYPE = torch.float64
"""Every layout trains and is compared in float64, so the bounds below follow from the arithmetic, not from one CPU's
kernels: the mesh sums each gradient in another order than one process, each sum of n <= 16 terms (widths,
micro-batch rows, ranks) moving by at most n * 2**-53 ~ 2e-15 of its terms' magnitudes (O(1) here). AdamW
divides by sqrt(v) + eps >= eps = 1e-8, so a gradient error dg moves a step of lr by at most lr * dg / eps; with
dg ~ 1e-16 that is ~1e-10 at lr 0.02 (and ~lr * dg / |g| ~ 1e-17 where |g| is not tiny). In float32 the same
argument gives lr * 1e-9 / eps ~ 1e-3 at worst, and the tiny Llama moved by 3.0e-6 against its former bound
1e-5 (the tp layout's clipping norms by 1.9e-6 against 1e-5), measured on an AMD EPYC 2026-11-28."""
PARAM_TOL = 1e-9
"""Parameters after 3 clipped AdamW steps (lr 0.02): <= ~3 steps x 1e-10 at worst (above), measured <= 3.5e-16
(2026-11-28); a gradient averaged over the wrong ranks or a step on the local shard's norm moves a weight by ~lr
(2e7 times more)."""
NORM_TOL = 1e-11
"""The clipping norms (0.6 .. 14): a float64 sum of squares of ~700 gradients and a square root, ~700 * 2**-53 ~
8e-14 relative, ~1.1e-12 at most; measured <= 1.8e-15. Clipping by one mesh's norm only gives another norm by
O(0.1)."""


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = torch.nn.Linear(8, 16)
        self.w2 = torch.nn.Linear(16, 8)

    def forward(self, x):
        return x + self.w2(torch.tanh(self.w1(x)))


class MeshNet(torch.nn.Module):
    """Two MLP blocks (tensor-parallel by PLAN: w1 split by output, w2 by input) between plain layers."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(777)
        self.inp = torch.nn.Linear(6, 8)
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(8, 1)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def data(n):
    g = torch.Generator().manual_seed(99)
    x = torch.randn(n, 6, generator=g, dtype=DTYPE)
    y = torch.randn(n, 1, generator=g, dtype=DTYPE)
    return x, y, torch.arange(n)


def windows(n, global_batch):
    """The reference's optimizer steps: consecutive global batches, STEPS per step; the last step
    holds what is left (one process sees exactly these samples in this order)."""
    batches = [list(range(i, min(i + global_batch, n))) for i in range(0, n, global_batch)]
    return [sum(batches[i:i + STEPS], []) for i in range(0, len(batches), STEPS)]


def reference(x, y, steps_of):
    """One plain process: each step's mean squared error over its samples, clipped to MAX_NORM, AdamW."""
    model = MeshNet().to(DTYPE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    norms = []
    for idx in steps_of:
        torch.nn.functional.mse_loss(model(x[idx]), y[idx]).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
    return model, torch.stack(norms)


def run_layout(name, keywords, expect):
    results = {}
    R, S, T = expect
    ud.init(gradient_accumulation_steps=STEPS, **keywords, **({"tp_plan": PLAN} if T > 1 else {}))
    rank, world = ud.rank(), ud.world_size()
    dp, dp_rank = R * S, rank // T  # the mesh's row-major layout: tp innermost

    def attempt(check, fn):
        try:
            fn()
            results[check] = "ok"
        except Exception as exc:  # noqa: BLE001 - reported per check
            results[check] = f"FAIL: {type(exc).__name__}: {exc}\n{traceback.format_exc()[-1500:]}"

    hosts = ud.all_gather_object(socket.gethostname())  # collectives first, on every rank; asserts after
    seeded = ud.seed_everything(3, per_rank=True)
    draws = ud.all_gather_object(torch.rand(1).item())

    def identity():
        assert world == R * S * T == 4, (world, expect)
        assert (ud.data_parallel_world_size(), ud.data_parallel_rank()) == (dp, dp_rank), \
            (ud.data_parallel_world_size(), ud.data_parallel_rank(), dp, dp_rank)
        mesh = ud.device_mesh()
        assert mesh is not None and tuple(mesh.mesh_dim_names) == ("dp_replicate", "dp_shard", "tp"), mesh
        assert tuple(mesh.shape) == (R, S, T), mesh.shape
        assert mesh.device_type == "cpu", mesh.device_type
        if keywords.get("dp_replicate") == "nodes":  # a replica is one machine's ranks
            replicas = [sorted({hosts[r] for r in range(world) if r // (S * T) == i}) for i in range(R)]
            assert all(len(h) == 1 for h in replicas) and len({h[0] for h in replicas}) == R, replicas
        # per_rank seeds by data-parallel rank: TP peers (same batch) draw the same dropout, others differ
        assert seeded == 3 + dp_rank, (seeded, dp_rank)
        assert all(draws[r] == draws[(r // T) * T] for r in range(world)), draws
        assert len({draws[d * T] for d in range(dp)}) == dp, draws
    attempt("identity_knows_the_mesh", identity)

    n = 5 * PER_RANK * dp - 1  # 2 full steps, then one ragged micro-batch split unevenly over the dp ranks
    x, y, ids = data(n)
    model = MeshNet().to(DTYPE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, ids), batch_size=PER_RANK)
    model, opt, loader = ud.prepare(model, opt, loader)
    seen, norms, quiet_calls = [], [], []
    with _ReduceScatters() as scatters, _AllReduces() as reduces:
        for xb, yb, ib in loader:
            before = scatters.calls + reduces.calls
            with ud.accumulate(model):
                ud.backward(torch.nn.functional.mse_loss(model(xb), yb))
                quiet = not ud.sync_gradients()
                if quiet:
                    quiet_calls.append(scatters.calls + reduces.calls - before)
                norm = ud.clip_grad_norm_(model.parameters(), MAX_NORM)
                if norm is not None:
                    norms.append(norm.detach().cpu())
                opt.step()
                opt.zero_grad()
            seen.append(ib.tolist())
    everyone = ud.all_gather_object(seen)
    ref, ref_norms = reference(x, y, windows(n, PER_RANK * dp))

    def loaders():
        for r in range(world):  # tensor-parallel peers got the same batches
            assert everyone[r] == everyone[(r // T) * T], (r, everyone[r], everyone[(r // T) * T])
        steps = len(everyone[0])
        order = [i for s in range(steps) for d in range(dp) for i in everyone[d * T][s]]
        assert order == list(range(n)), order  # each sample once, in one process's order
    attempt("tensor_parallel_peers_get_the_same_batches_and_each_sample_comes_once", loaders)

    def training():
        assert min(ref_norms) > MAX_NORM, ref_norms
        assert len(norms) == len(ref_norms), (len(norms), len(ref_norms))
        close(torch.stack(norms), ref_norms, atol=NORM_TOL)
        for (pname, p), q in zip(ud.unwrap(model).named_parameters(), ref.parameters()):
            got = full(p.detach()).cpu()
            err = (got - q.detach()).abs().max().item()
            assert err <= PARAM_TOL, f"{pname}: max error {err:.2e}"
    attempt("adamw_with_accumulation_ragged_batch_and_clipping_equals_one_process", training)

    def quiet():
        assert quiet_calls and set(quiet_calls) == {0}, quiet_calls
    attempt("accumulating_micro_steps_send_no_gradient", quiet)

    sharding = facade.current_backend().config.sharding

    def placements():
        inner = ud.unwrap(model)
        w1 = inner.blocks[0].w1.weight
        kinds = [type(pl).__name__ for pl in w1.placements]
        want = {"hsdp": ["Replicate", "Shard"], "hsdp_keep": ["Replicate", "Shard"],
                "fsdp_tp": ["_StridedShard", "Shard"], "tp": ["Shard"],
                "fsdp_ac_offload": ["Shard"]}.get(name)
        if want is not None:
            assert kinds == want, (kinds, want)
        if sharding.enabled:  # FSDP2's own record of the policy each block was sharded with
            policy = inner.blocks[0]._get_fsdp_state()._fsdp_param_group.offload_policy
            assert type(policy).__name__ == ("CPUOffloadPolicy" if sharding.cpu_offload else "OffloadPolicy"), policy
            if sharding.cpu_offload:
                assert policy.pin_memory is False, policy  # no accelerator here: pinning would fail
    attempt("parameters_are_laid_out_on_the_mesh", placements)

    def recomputes():
        """A block's first layer runs once per forward, and once more in backward when its
        activations were not kept (activation checkpointing)."""
        calls = []
        hook = ud.unwrap(model).blocks[0].w1.register_forward_hook(lambda *args: calls.append(1))
        try:
            for micro in range(STEPS):  # one whole window, so no accumulation is left behind
                with ud.accumulate(model):
                    ud.backward(model(x[:PER_RANK]).sum() * 0)
                    if micro == 0:
                        per_step = len(calls)
                    opt.zero_grad()
        finally:
            hook.remove()
        assert per_step == (2 if sharding.activation_checkpointing else 1), (per_step, sharding)
    attempt("activation_checkpointing_recomputes_blocks_in_backward", recomputes)

    eval_n = 13
    ex, _, eids = data(eval_n)
    eval_loader = ud.prepare(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ex, eids), batch_size=2))
    gathered = []
    with torch.no_grad():
        for xb, ib in eval_loader:
            gathered.append(ud.gather_for_metrics(ib))
            ud.gather_for_metrics(model(xb))  # the model's forward runs on every rank (TP needs all)

    def metrics():
        got = torch.cat(gathered).tolist()
        assert got == list(range(eval_n)), got
    attempt("gather_for_metrics_returns_each_example_once_in_order", metrics)

    path = os.path.join(OUT, f"{name}_full.pt")
    ud.save({"model": model}, path)
    ud.barrier()

    def full_checkpoint():
        state = torch.load(path, weights_only=True)["model"]
        for key, value in ref.state_dict().items():
            err = (state[key] - value).abs().max().item()
            assert err <= PARAM_TOL, f"{key}: {err:.2e}"
    attempt("save_gathers_the_full_state_from_the_mesh", full_checkpoint)
    results["config"] = {"sharding": sharding.mode, "cpu_offload": sharding.cpu_offload,
                         "activation_checkpointing": sharding.activation_checkpointing,
                         "reshard_after_forward": sharding.reshard_after_forward}
    ud.shutdown()
    return results


LLAMA_VOCAB, LLAMA_LR, LLAMA_STEPS = 96, 1e-3, 3
LLAMA_TOL = 1e-10
"""Float64 (DTYPE): sums of <= 128 terms (widths, vocabulary, 64 tokens) round by 128 * 2**-53 ~ 1.4e-14 of their
magnitudes, so gradients (<= 1e-2) differ by ~1e-16, and 3 AdamW steps at lr 1e-3 by <= 3 * lr * 1e-16 / eps ~
3e-11 at worst; measured 1.4e-15 for this model under plain TP (tests/unit/parallel/test_tensor_parallel.py).
transformers computes the loss in float32 from the logits; both runs round the same float64 logits, which agree
to ~1e-16, to float32. A wrong gradient (a rank's batch lost, no reduction over dp) moves weights by ~lr."""


def tiny_llama():
    """A 2-layer LlamaForCausalLM built from its config (no download): a real model with its own TP plan."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(5)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=LLAMA_VOCAB, max_position_embeddings=32,
                         tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(config)


def run_llama(expect):
    """FSDP x TP 2x2 with tp_plan="auto" through ud.prepare on a tiny Llama: AdamW steps on one batch
    of token ids per data-parallel rank equal one plain process on the concatenated batches, in float64.
    Tolerance LLAMA_TOL: AdamW moves each weight by ~lr = 1e-3 per step whatever the gradient's size, so a
    wrong gradient shows as ~lr; rounding of the split sums as at most ~lr * dg / eps (DTYPE's note)."""
    results = {}
    R, S, T = expect
    ud.init(sharding="fsdp", tp=T, dp_replicate=R, tp_plan="auto")
    dp, dp_rank = R * S, ud.rank() // T
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, LLAMA_VOCAB, (LLAMA_STEPS, 2 * dp, 16), generator=g)
    model = tiny_llama().to(DTYPE)
    opt = torch.optim.AdamW(model.parameters(), lr=LLAMA_LR, weight_decay=0.1)
    model, opt = ud.prepare(model, opt)
    for step in range(LLAMA_STEPS):
        mine = ids[step, 2 * dp_rank:2 * dp_rank + 2]  # this data-parallel rank's slice; TP peers share it
        loss = model(input_ids=mine, labels=mine).loss
        ud.backward(loss)
        opt.step()
        opt.zero_grad()
    plain = tiny_llama().to(DTYPE)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=LLAMA_LR, weight_decay=0.1)
    for step in range(LLAMA_STEPS):
        plain(input_ids=ids[step], labels=ids[step]).loss.backward()
        plain_opt.step()
        plain_opt.zero_grad()
    inner = ud.unwrap(model)
    try:
        q = inner.model.layers[0].self_attn.q_proj.weight
        assert [type(pl).__name__ for pl in q.placements] == ["_StridedShard", "Shard"], q.placements
        worst = max(((full(p.detach()).cpu() - r.detach()).abs().max().item(), name)
                    for (name, p), r in zip(inner.named_parameters(), plain.parameters()))
        assert worst[0] <= LLAMA_TOL, worst
        results["tp_plan_auto_on_a_tiny_llama_equals_one_process"] = "ok"
    except Exception as exc:  # noqa: BLE001
        results["tp_plan_auto_on_a_tiny_llama_equals_one_process"] = f"FAIL: {type(exc).__name__}: {exc}"
    ud.shutdown()
    return results


class _AllReduces(_ReduceScatters):
    """The count of torch.distributed all-reduce calls (HSDP all-reduces across replicas)."""

    NAMES = ("all_reduce",)


def main():
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ.get("MESH_DUMP_AFTER", "600")), exit=True)
    global OUT
    parser = argparse.ArgumentParser()
    parser.add_argument("--layouts", required=True)
    parser.add_argument("--expect", default=None, help="R,S,T the launcher's layout should give")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    OUT = args.out
    report = {}
    for name in args.layouts.split(","):
        if name == "launcher":
            keywords, expect = {}, tuple(int(v) for v in args.expect.split(","))
        elif name == "llama":
            report[name] = run_llama((1, 2, 2))
            continue
        else:
            keywords, expect = LAYOUTS[name]
        report[name] = run_layout(name, keywords, expect)
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", os.environ.get("OMPI_COMM_WORLD_RANK", "0"))))
    with open(os.path.join(args.out, f"mesh_rank{rank}.json"), "w") as f:
        json.dump(report, f, indent=1)


OUT = "."

if __name__ == "__main__":
    main()
