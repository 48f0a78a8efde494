"""Tensor parallelism (unified_dist.parallel.tensor_parallel): plan resolution and its one-line errors in this
process, then one ``torchrun --nproc_per_node 2`` launch (tests/launchers/workers/tp_worker.py) that trains a
sharded copy and a plain copy of two models and compares them.

Expected values: plans are written out literally (transformers 5.23's Llama plan, copied from its
``LlamaConfig.base_model_tp_plan`` and ``LlamaForCausalLM._tp_plan``); the trained parameters,
losses and gradients are compared with a plain one-process torch copy trained on the same data.
"""
from __future__ import annotations

import copy
import json
import sys
import types

import pytest
import torch
from torch import nn

from unified_dist.errors import UnifiedDistError
from unified_dist.parallel.tensor_parallel import apply_tp_plan, resolve_plan, torch_style
from unified_dist.testing.launchers import ROOT, launch

sys.path.insert(0, str(ROOT / "tests" / "launchers" / "workers"))
import tp_worker  # noqa: E402  (the models; the training runs in the launched processes)


def tiny_llama(**overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    kw.update(overrides)
    return LlamaForCausalLM(LlamaConfig(**kw))


class MLP(nn.Module):
    def __init__(self, inner=64):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"w1": nn.Linear(32, inner), "w2": nn.Linear(inner, 32),
                                                   "norm": nn.LayerNorm(32)}) for _ in range(2))


def one_line_error(fn, *args, **kwargs) -> str:
    with pytest.raises(UnifiedDistError) as info:
        fn(*args, **kwargs)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# ------------------------------------------------------------------ resolve_plan, in this process
def test_auto_is_the_llama_plan_transformers_declares_prefixed_under_the_causal_lm():
    per_layer = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                 "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise"}
    expected = {"model.embed_tokens": "embedding_rowwise",
                **{f"model.layers.{i}.{k}": v for i in range(2) for k, v in per_layer.items()},
                "lm_head": "colwise_gather_output"}
    plan = resolve_plan(tiny_llama(), "auto", tp=2)
    assert plan == expected
    assert list(plan) == list(expected)  # in module order
    assert resolve_plan(tiny_llama(), plan, tp=2) == plan  # resolving a resolved plan changes nothing


def test_a_model_without_a_plan_or_no_plan_at_all_names_the_fix():
    from transformers import BertConfig, BertModel

    bert = BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64))
    assert one_line_error(resolve_plan, bert, "auto", tp=2).startswith(
        "tp=2 needs a plan: BertModel declares no base_model_tp_plan; pass ud.init(tp_plan={")
    assert one_line_error(resolve_plan, MLP(), None, tp=4).startswith(
        "tp=4 needs a plan: MLP declares no base_model_tp_plan; pass ud.init(tp_plan={")
    assert resolve_plan(MLP(), None, tp=1) == {}


def test_star_is_one_dotted_component_and_the_whole_name_must_match():
    plan = resolve_plan(MLP(), {"blocks.*.w1": "colwise", "blocks.1.w2": "rowwise"}, tp=2)
    assert plan == {"blocks.0.w1": "colwise", "blocks.1.w1": "colwise", "blocks.1.w2": "rowwise"}
    message = one_line_error(resolve_plan, MLP(), {"*.w1": "colwise"})
    assert "'*.w1' matches no module of MLP" in message and "blocks.0.w1" in message


def test_an_unknown_style_names_the_supported_ones():
    message = one_line_error(resolve_plan, MLP(), {"blocks.*.w1": "packed_colwise"})
    assert "'packed_colwise' is not a supported style" in message
    for style in ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input", "embedding_rowwise"):
        assert style in message


def test_a_pattern_on_a_module_its_style_cannot_shard_is_refused():
    message = one_line_error(resolve_plan, MLP(), {"blocks.*.norm": "colwise"})
    assert "'blocks.0.norm', a LayerNorm" in message and "nn.Linear or nn.Embedding" in message
    message = one_line_error(resolve_plan, MLP(), {"blocks.*.w1": "embedding_rowwise"})
    assert "a Linear" in message and "nn.Embedding" in message
    emb = nn.Module()
    emb.embed = nn.Embedding(10, 4)
    assert resolve_plan(emb, {"embed": "rowwise"}, tp=2) == {"embed": "rowwise"}  # torch shards embeddings too


def test_a_dimension_or_a_head_count_that_tp_does_not_divide_is_named():
    assert one_line_error(resolve_plan, MLP(inner=63), {"blocks.*.w1": "colwise"}, tp=2) == (
        "tp=2 cannot shard blocks.0.w1 (colwise): its out_features=63 is not divisible by 2")
    assert "its in_features=63 is not divisible by 2" in one_line_error(
        resolve_plan, MLP(inner=63), {"blocks.*.w2": "rowwise"}, tp=2)
    # 6 heads of 16: every projection's width (96, 48) divides by 2, but the 3 key/value heads do not
    llama = tiny_llama(hidden_size=96, num_attention_heads=6, num_key_value_heads=3)
    assert "num_key_value_heads=3 is not divisible by 2" in one_line_error(resolve_plan, llama, "auto", tp=2)
    assert "num_attention_heads=6 is not divisible by 4" in one_line_error(resolve_plan, llama, "auto", tp=4)


def test_the_styles_are_torchs_colwise_and_rowwise_with_the_layouts_transformers_gives_them():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    linear, embedding = nn.Linear(4, 4), nn.Embedding(8, 4)
    expected = {  # (style, module): (class, input layout, output layout)
        ("colwise", linear): (ColwiseParallel, Replicate(), Shard(-1)),
        ("colwise_gather_output", linear): (ColwiseParallel, Replicate(), Replicate()),
        ("rowwise", linear): (RowwiseParallel, Shard(-1), Replicate()),
        ("rowwise_split_input", linear): (RowwiseParallel, Replicate(), Replicate()),
        ("embedding_rowwise", embedding): (RowwiseParallel, Replicate(), Replicate()),
        ("rowwise", embedding): (RowwiseParallel, Replicate(), Replicate()),
    }
    for (style, module), (cls, inp, out) in expected.items():
        got = torch_style(style, module)
        assert type(got) is cls and got.input_layouts == (inp,) and got.output_layouts == (out,), style
        assert got.use_local_output, style


def test_a_tied_weight_planned_on_one_owner_only_is_refused_before_anything_changes():
    model = tp_worker.TiedMLP()
    before = copy.deepcopy(model.state_dict())
    mesh = types.SimpleNamespace(ndim=1, size=lambda: 2)  # the error comes before any use of the mesh
    message = one_line_error(apply_tp_plan, model, {"embed": "embedding_rowwise"}, mesh)
    assert "tied parameter shared by" in message and "head.weight (not sharded)" in message
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.head.weight is model.embed.weight


# ------------------------------------------------------------------ one torchrun launch, 2 ranks
PARAM_TOL = 1e-10
"""Both copies train in float64 (tp_worker.DTYPE). The sharded copy sums its split matmuls in another order:
each sum (n <= 128 terms: vocabulary, widths, 32 tokens) moves by at most n * 2**-53 ~ 1.4e-14 of the sum of
its terms' magnitudes, so gradients (O(1e-2) or less) differ by ~1e-16 (measured 5.6e-16). AdamW divides by
sqrt(v) + eps >= eps = 1e-8, so a gradient error dg moves a step of lr = 1e-3 by at most lr * dg / eps ~ 1e-11
(and by ~lr * dg / |g| ~ 1e-16 where |g| is not tiny): over 3 steps <= ~3e-11; measured 1.4e-15 (2026-11-28).
1e-10 covers that worst case 3x, while a wrong shard or a missing reduction moves a parameter by ~lr = 1e-3
(10**7 times more). Float32 gradients differ by ~1e-10, which the same argument turns into ~lr * 1e-10 / eps
~ 1e-5: 5.4e-6 was measured on an AMD EPYC (3.7e-6 on another CPU) against the former bound 1e-5, hence
float64. (transformers computes Llama's loss in float32 from the float64 logits; the two copies' logits, equal
to ~1e-16, round to the same float32 values unless one straddles a float32 rounding boundary: a chance of
~1e-16 / 6e-8 per logit, never seen.)"""
GRAD_TOL = 1e-11
"""First-step gradients, float64: 128 * 2**-53 per sum, a few layers of O(1) values deep: ~1e-14 at most,
measured 5.6e-16; a missing reduction or a wrong shard leaves a gradient off by its own size (1e-4 .. 1e-2)."""
LOSS_TOL = 1e-11
"""Losses (~5-10), float64: sums of <= 128 terms of O(10) values, a few layers deep: ~1e-13 at most, measured
1.8e-15; a step taken differently moves the next loss by ~1e-3."""


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp")
    result = launch("torchrun", "tests/launchers/workers/tp_worker.py", [str(out)], nproc=2, timeout=120).check()
    ranks = {r: json.loads((out / f"tp_rank{r}.json").read_text()) for r in range(2)}
    for r, cases in ranks.items():
        for case, data in cases.items():
            assert "error" not in data, f"rank {r} {case}:\n{data['error']}\n{result.output[-2000:]}"
    return ranks


CASES = ("mlp", "llama")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_tp_training_matches_one_process(tp_results, case):
    for r in range(2):
        data = tp_results[r][case]
        assert data["param_err"] <= PARAM_TOL, (r, data["param_err"])
        assert data["grad_err"] <= GRAD_TOL, (r, data["grad_err"])
        assert data["loss_err"] <= LOSS_TOL, (r, data["loss_err"])
        assert data["plain_model_dtensors"] == 0


@pytest.mark.distributed
@pytest.mark.slow
def test_planned_params_and_their_grads_are_dtensors_the_rest_stay_plain(tp_results):
    mlp, llama = tp_results[0]["mlp"], tp_results[0]["llama"]
    assert mlp["sharded"] == {
        "embed.weight": "(Shard(dim=0),)",  # the head's weight is the same parameter (tied)
        **{f"blocks.{i}.{w}": p for i in range(2) for w, p in (
            ("w1.weight", "(Shard(dim=0),)"), ("w1.bias", "(Shard(dim=0),)"),
            ("w2.weight", "(Shard(dim=1),)"), ("w2.bias", "(Replicate(),)"))},
        "w3.weight": "(Shard(dim=1),)", "w3.bias": "(Replicate(),)"}
    assert mlp["tied"] is True
    assert mlp["plain"] == ["norm.bias", "norm.weight"]
    assert mlp["sharded_grads"] == sorted(mlp["sharded"])
    layer = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj")
    expected = {"model.embed_tokens.weight", "lm_head.weight",
                *(f"model.layers.{i}.{m}.weight" for i in range(2) for m in layer)}
    assert set(llama["sharded"]) == expected and llama["sharded_grads"] == sorted(expected)
    assert llama["sharded"]["model.layers.0.self_attn.o_proj.weight"] == "(Shard(dim=1),)"
    assert llama["sharded"]["lm_head.weight"] == "(Shard(dim=0),)"
    assert llama["plain"] == sorted([f"model.layers.{i}.{n}.weight" for i in range(2)
                                     for n in ("input_layernorm", "post_attention_layernorm")]
                                    + ["model.norm.weight"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_unplanned_params_get_the_same_gradient_on_every_rank_without_an_extra_all_reduce(tp_results, case):
    grads = [tp_results[r][case]["plain_grads"] for r in range(2)]
    assert grads[0] and grads[0] == grads[1]  # bitwise; grad_err above compares them with one process


# ------------------------------------------------------------------ optimizers over a tp-only model
@pytest.fixture
def one_rank_tp_mesh(monkeypatch):
    import torch.distributed as dist

    from unified_dist.backends.ports import free_port
    from unified_dist.parallel.mesh import Layout

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield Layout(1, 1, 1).build_mesh("cpu")["tp"]
    finally:
        dist.destroy_process_group()


def _mixed_tp_model(mesh):
    torch.manual_seed(0)
    model = MLP()
    if mesh is not None:
        apply_tp_plan(model, {"blocks.*.w1": "colwise", "blocks.*.w2": "rowwise"}, mesh)
    return model


def _backward(model):
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    sum(block["w2"](block["w1"](block["norm"](x))).square().sum() for block in model.blocks).backward()


def test_a_group_mixing_dtensor_and_plain_params_steps_with_the_foreach_kernels_cuda_picks(
        one_rank_tp_mesh, monkeypatch):
    """tp without FSDP leaves the LayerNorms plain: on CUDA torch's default foreach kernels refuse
    the group at the first step ("got mixed torch.Tensor and DTensor", seen on an H200);
    point_optimizer_at leaves such a group unset-foreach as foreach=False: the update of a plain model."""
    import torch.optim.optimizer as torch_optimizer

    from unified_dist.parallel.sharding import point_optimizer_at

    plain = _mixed_tp_model(None)
    _backward(plain)
    torch.optim.AdamW(plain.parameters(), lr=0.1).step()  # before the patch: one tensor at a time
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices", lambda: ["cpu", "cuda"])
    model, raw_model = _mixed_tp_model(one_rank_tp_mesh), _mixed_tp_model(one_rank_tp_mesh)
    optimizer = point_optimizer_at(torch.optim.AdamW(model.parameters(), lr=0.1), lambda p: p)
    raw = torch.optim.AdamW(raw_model.parameters(), lr=0.1)
    assert optimizer.param_groups[0]["foreach"] is False and raw.param_groups[0]["foreach"] is None
    for m in (model, raw_model):
        _backward(m)
    optimizer.step()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert torch.allclose(p.full_tensor() if hasattr(p, "full_tensor") else p, q, atol=1e-6), name
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        raw.step()  # what a CUDA user met before: the patch does make torch pick the foreach kernels


def test_foreach_true_over_a_mixed_group_is_refused_in_one_line(one_rank_tp_mesh):
    from unified_dist.parallel.sharding import point_optimizer_at

    model = _mixed_tp_model(one_rank_tp_mesh)
    message = one_line_error(point_optimizer_at, torch.optim.SGD(model.parameters(), lr=0.1, foreach=True),
                             lambda p: p)
    assert "param group 0 has foreach=True" in message and "foreach=False" in message


def test_a_loaded_optimizer_state_keeps_the_mixed_group_off_the_foreach_kernels(one_rank_tp_mesh):
    """``load_state_dict`` puts the saved groups' ``foreach`` back (None, saved from a layout without
    DTensors): the group must stay foreach=False, or a resumed tp job crashes at its first CUDA step."""
    from unified_dist.parallel.sharding import point_optimizer_at

    saved = torch.optim.AdamW(_mixed_tp_model(None).parameters(), lr=0.1).state_dict()
    assert saved["param_groups"][0]["foreach"] is None
    optimizer = point_optimizer_at(torch.optim.AdamW(_mixed_tp_model(one_rank_tp_mesh).parameters(), lr=0.1),
                                   lambda p: p)
    optimizer.load_state_dict(saved)
    assert optimizer.param_groups[0]["foreach"] is False
