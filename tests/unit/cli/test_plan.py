"""``unified-dist plan``: one simulated rank's bytes, collectives and errors.

The expected values come from first principles, never from the plan's code: parameter counts times
4 bytes (float32), divided as FSDP2 divides dim 0 (``torch.chunk``: ``ceil(d / S)`` rows per rank, the
last ranks fewer or none), as tensor parallelism splits a column-wise Linear's rows and a row-wise
Linear's columns; AdamW keeps two tensors of the parameter's local shape plus a float32 step per
parameter. The errors are the literal one-line messages of the real ``ud.init`` / ``ud.prepare``.
"""
from __future__ import annotations

import json
import math

import pytest

H, F, L, OUT, B = 6, 10, 3, 5, 4
"""The tiny net: L blocks of Linear(H, F) -> relu -> Linear(F, H) (residual), then Linear(H, OUT); batch B."""

NET = f"""
import torch
import unified_dist as ud

class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = torch.nn.Linear({H}, {F}), torch.nn.Linear({F}, {H})

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(x)))

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block() for _ in range({L})])
        self.head = torch.nn.Linear({H}, {OUT})

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)

ud.init(tp_plan={{"blocks.*.w1": "colwise", "blocks.*.w2": "rowwise"}})
model = Net()
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
model, optimizer = ud.prepare(model, optimizer)
loss = model(torch.randn({B}, {H})).sum()
ud.backward(loss)
print("loss", loss.item())
optimizer.step()
raise SystemExit("the plan must stop the script after its first optimizer step")
"""

LLAMA = """
import torch
import unified_dist as ud
from transformers import LlamaConfig, LlamaForCausalLM

ud.init(tp_plan="auto")
model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=12, intermediate_size=16, num_hidden_layers=2,
                                     num_attention_heads=6, num_key_value_heads=6))
optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
model, optimizer = ud.prepare(model, optimizer)
"""

# (weight shape, bias shape, TP split: 0 rows, 1 columns, None not split) of every Linear
LINEARS = [((F, H), (F,), 0), ((H, F), (H,), 1)] * L + [((OUT, H), (OUT,), None)]


def rows(d: int, parts: int, index: int) -> int:
    """The rows of a dim of size ``d`` that shard ``index`` of ``parts`` holds (torch.chunk)."""
    chunk = math.ceil(d / parts)
    return max(0, min(chunk, d - index * chunk))


def local_numels(shard: int, shards: int, tp_rank: int = 0, tp: int = 1) -> list:
    """Each parameter's local number of elements: TP's split first, then FSDP2's dim-0 shard."""
    out = []
    for weight, bias, split in LINEARS:
        for shape, is_bias in ((list(weight), False), (list(bias), True)):
            if tp > 1 and split is not None and not (is_bias and split == 1):  # a row-wise bias is replicated
                dim = 0 if is_bias else split
                shape[dim] //= tp
            shape[0] = rows(shape[0], shards, shard)
            out.append(math.prod(shape))
    return out


def expected_bytes(numels: list) -> dict:
    params = 4 * sum(numels)
    held = {"params": params, "grads": params, "optimizer": 2 * params + 4 * len(numels)}
    held["total"] = sum(held.values())
    return held


def padded_bytes(shards: int, blocks: bool) -> int:
    """Bytes FSDP2 all-gathers for the blocks (``blocks``) or the root's own Linear: every shard padded
    to ``ceil(d / S)`` rows."""
    chosen = LINEARS[:-1] if blocks else LINEARS[-1:]
    return 4 * sum(shards * math.ceil(s[0] / shards) * math.prod(s[1:]) for w, b, _ in chosen for s in (w, b))


@pytest.fixture
def plan(cli_in_process, tmp_path):
    def run(script: str, *flags: str, world=(1, 4), rank: int = 0):
        (tmp_path / "train.py").write_text(script)
        done = cli_in_process("plan", "--nnodes", str(world[0]), "--nproc", str(world[1]), "--rank", str(rank),
                              "--json", *flags, "train.py", cwd=tmp_path)
        assert done.stdout, done.stderr
        return done.returncode, json.loads(done.stdout), done.stderr
    return run


LAYOUTS = {  # name -> (flags, rank, its shard index, shards, its TP rank, tp)
    "ddp": ((), 0, 0, 1, 0, 1),
    "fsdp": (("--sharding", "fsdp", "--activation-checkpointing", "--compare-checkpointing"), 3, 3, 4, 0, 1),
    "hsdp": (("--sharding", "fsdp", "--dp-replicate", "2"), 1, 1, 2, 0, 1),
    "fsdp_tp": (("--sharding", "fsdp", "--tp", "2"), 1, 0, 2, 1, 2),
}


@pytest.mark.parametrize("name", LAYOUTS)
def test_plan_at_world_4_holds_what_each_rank_holds(plan, name):
    flags, rank, shard, shards, tp_rank, tp = LAYOUTS[name]
    code, report, err = plan(NET, *flags, rank=rank)
    assert code == 0 and report["error"] is None, (report, err)
    assert "loss 0" in err  # the script ran (its output on stderr), and stopped after the step
    assert report["bytes"] == expected_bytes(local_numels(shard, shards, tp_rank, tp))
    kinds = {(row["kind"], row["group"]): row for row in report["collectives"]}
    if name == "ddp":
        assert report["ddp"] and kinds[("all_reduce", "world (DDP buckets)")]["bytes"] == report["bytes"]["grads"]
    if name == "fsdp":  # forward gathers the root and every block, backward all again (each is resharded after
        # forward); one reduce-scatter each
        gather, scatter = kinds[("all_gather", "dp_shard=world")], kinds[("reduce_scatter", "dp_shard=world")]
        assert (gather["calls"], scatter["calls"]) == (2 * (L + 1), L + 1)
        assert gather["bytes"] == 2 * (padded_bytes(4, True) + padded_bytes(4, False))
        assert scatter["bytes"] == padded_bytes(4, True) + padded_bytes(4, False)
        # checkpointed blocks keep only their inputs; the head keeps its input (the last block's output)
        assert report["saved_for_backward"]["bytes"] == (L + 1) * B * H * 4
        # without: each block's input (for w1), its (B, F) relu output (for relu and w2), and the head's input
        assert report["saved_for_backward_other"]["bytes"] == (L * (B * H + B * F) + B * H) * 4
    if name == "hsdp":  # gradients are reduce-scattered inside a replica, then all-reduced across replicas
        assert kinds[("all_reduce", "dp_replicate")]["calls"] == L + 1
    if name == "fsdp_tp":  # each row-wise Linear all-reduces its (B, H) output over the TP ranks in forward, each
        # column-wise one its input's (B, H) gradient in backward, except the first block's (its input needs none)
        assert {kind for kind, _ in kinds} == {"all_gather", "reduce_scatter", "all_reduce"}  # not prepare's scatter
        tp_reduce = kinds[("all_reduce", "tp")]
        assert (tp_reduce["calls"], tp_reduce["bytes"]) == (2 * L - 1, (2 * L - 1) * B * H * 4)


ERRORS = {
    "replicate": (NET, ("--sharding", "fsdp", "--dp-replicate", "3"), "LaunchError",
                  "dp_replicate=3 x tp=1 does not divide the world of 512 ranks; choose sizes whose product divides "
                  "512 (dp_shard is the rest: world / (dp_replicate x tp))"),
    "heads": (LLAMA, ("--sharding", "fsdp", "--tp", "4"), "UnifiedDistError",
              "tp=4 cannot split the heads of model.layers.0.self_attn: num_attention_heads=6 is not divisible by 4"),
}


@pytest.mark.parametrize("name", ERRORS)
def test_plan_at_512_ranks_gives_the_real_errors(plan, name):
    script, flags, kind, message = ERRORS[name]
    code, report, _ = plan(script, *flags, world=(64, 8), rank=511)
    assert code == 1
    assert report["error"] == {"type": kind, "message": message}


def test_plan_refuses_what_it_cannot_simulate(cli_in_process, tmp_path):
    (tmp_path / "train.py").write_text("")
    done = cli_in_process("plan", "--backend", "horovod", "train.py", cwd=tmp_path)
    assert done.returncode == 2 and "plan simulates the torch backend" in done.stderr
    done = cli_in_process("plan", "--nproc", "4", "--rank", "4", "train.py", cwd=tmp_path)
    assert done.returncode == 2 and "--rank must be in 0..3" in done.stderr


def test_plan_says_when_the_simulation_not_the_job_fails(plan):
    """An operation whose output shape depends on values (``nonzero``) cannot run on fake tensors: that is
    the plan's limit, reported as such, never as the job's error."""
    script = NET.replace("loss = model(", "torch.nonzero(torch.randn(3) > 0)\nloss = model(")
    code, report, _ = plan(script)
    assert code == 1 and report["error"]["type"] == "PlanError"
    assert report["error"]["message"].startswith("the script cannot be simulated: DynamicOutputShapeException")
