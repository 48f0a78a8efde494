"""Pipeline parallelism's pure parts (issue 61): where ranks sit in a layout with ``pp``, how a model is cut
into stages, and the one-line refusals (unified_dist/parallel/pipeline.py). The training physics runs under
torchrun in tests/launchers/test_pipeline_under_launchers.py."""
from __future__ import annotations

import pytest
import torch

import unified_dist as ud
from unified_dist.backends import backend_class
from unified_dist.errors import LaunchError, PipelineError, UnifiedDistError
from unified_dist.parallel import pipeline
from unified_dist.parallel.mesh import Layout
from unified_dist.session import config_from


class Stack(torch.nn.Module):
    def __init__(self, layers: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(3, 4)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(4)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


class Pair(torch.nn.Module):  # no stack of layers anywhere
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)


class Encoder(torch.nn.Module):  # a stack nested as transformers' encoders nest theirs: body.encoder.layer
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, mask):
        for layer in self.layer:
            x = layer(x) * mask if isinstance(layer, torch.nn.Linear) else layer(x, mask)  # a unit given two
        return x


class Body(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embeddings, self.encoder, self.pooler = torch.nn.Linear(3, 4), Encoder(), torch.nn.Linear(4, 4)


class Nested(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = Body(), torch.nn.Linear(4, 2)

    def forward(self, x, mask):
        return self.head(self.body.pooler(self.body.encoder(self.body.embeddings(x), mask)))


# ---------------------------------------------------------------------- the layout
def test_stages_are_the_outermost_dimension_and_every_stage_sees_the_same_data():
    """pp 2 x dp_shard 2 x tp 2 on 8 ranks: stage r // 4, data-parallel rank r // 2 % 2, tp rank r % 2."""
    layout = Layout.plan(8, tp=2, pp=2)
    assert (layout.pp, layout.replicate, layout.shard, layout.tp, layout.world) == (2, 1, 2, 2, 8)
    assert [layout.pp_rank(r) for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.data_parallel_rank(r) for r in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert [layout.tp_rank(r) for r in range(8)] == [0, 1] * 4
    assert layout.data_parallel == 2


def test_a_layout_without_pp_keeps_its_ranks():
    layout = Layout.plan(4, dp_replicate=2)
    assert [layout.data_parallel_rank(r) for r in range(4)] == [0, 1, 2, 3]
    assert [layout.pp_rank(r) for r in range(4)] == [0] * 4


def test_stages_that_do_not_divide_the_world_are_refused_in_one_line():
    with pytest.raises(LaunchError, match=r"pp=2 x dp_replicate=1 x tp=2 does not divide the world of 6") as caught:
        Layout.plan(6, tp=2, pp=2)
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------------- the split
def test_the_default_split_cuts_the_largest_module_list_evenly():
    model = Stack(layers=5)
    assert pipeline.default_split(model, 2) == ["layers.3"]  # 3 + 2: the first stage takes the extra layer
    assert pipeline.stage_units(model, 2) == [["embed", "layers.0", "layers.1", "layers.2"],
                                              ["layers.3", "layers.4", "norm", "head"]]
    assert pipeline.default_split(Stack(layers=6), 3) == ["layers.2", "layers.4"]


def test_split_points_by_name():
    assert pipeline.stage_units(Stack(), 2, ["head"]) == [["embed", "layers.0", "layers.1", "layers.2", "layers.3",
                                                          "norm"], ["head"]]


def test_a_sequential_root_is_the_stack_itself():
    model = torch.nn.Sequential(*(torch.nn.Linear(2, 2) for _ in range(4)))
    assert pipeline.stage_units(model, 2) == [["0", "1"], ["2", "3"]]


def test_a_stage_keeps_its_units_by_their_full_names_and_the_others_become_identity():
    model = Stack()
    all_names = set(model.state_dict())
    dropped = pipeline.keep_stage(model, 1, pipeline.stage_units(model, 2))
    kept = set(model.state_dict())
    assert kept == {n for n in all_names if n.startswith(("layers.2.", "layers.3.", "norm.", "head."))}
    assert isinstance(model.embed, torch.nn.Identity) and isinstance(model.layers[0], torch.nn.Identity)
    assert len(model.layers) == 4
    assert len(dropped) == 6  # embed, layers.0, layers.1: weight and bias each
    x = torch.randn(5, 4)  # stage 1 takes the hidden states the first stage sends
    assert model(x).shape == (5, 2)


def test_a_stack_nested_deeper_is_found_and_the_modules_on_the_way_are_opened():
    """transformers' shape (bert.encoder.layer): the modules between the root and the stack are opened into
    their children, so that the stack's layers are units and the default split cuts them evenly."""
    model = Nested()
    assert [name for name, _ in pipeline.units(model)] == [
        "body.embeddings", "body.encoder.layer.0", "body.encoder.layer.1", "body.encoder.layer.2",
        "body.encoder.layer.3", "body.pooler", "head"]
    assert pipeline.default_split(model, 2) == ["body.encoder.layer.2"]
    assert pipeline.stage_units(model, 2, ["body.pooler"])[1] == ["body.pooler", "head"]


class Between(Stack):
    """Stack whose forward does one more thing with the activation, where ``how`` says."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "before_the_first_unit":
            x = x * 2
        x = self.embed(x)
        for n, layer in enumerate(self.layers):
            x = torch.tanh(layer(x)) if self.how == "between_units" else layer(x)
            if self.how == "reordered" and n == 0:
                x = self.head(self.norm(x))
        out = self.head(self.norm(x))
        return out.squeeze(-1) if self.how == "after_the_last_unit" else out


@pytest.mark.parametrize("how,stage,says", [
    ("between_units", 0, "gave unit layers.1 something other than what unit layers.0 returned"),
    ("between_units", 1, "gave unit layers.1 something other than what unit layers.0 returned"),
    ("before_the_first_unit", 1, "gave its first unit, embed, something other than the activation the stage received"),
    ("after_the_last_unit", 0, "returned something other than what its last unit, head, returned"),
    ("reordered", 0, "called unit layers.1 after head"),
])
def test_a_forward_that_does_more_than_apply_its_units_in_turn_is_refused(how, stage, says):
    """docs/pipeline.md: every stage runs the model's own forward, other stages' units standing in as identities;
    an operation of the forward's own on the activation would run on every stage. The first forward after
    ``UnitChain`` is refused in one line, on any stage that sees it; a forward that applies its units in turn runs
    (the example's, which skips its embeddings on a later stage: tests/examples/test_bert_sentiment.py -k pipeline)."""
    model = Between(how)
    pipeline.keep_stage(model, stage, pipeline.stage_units(model, 2))
    pipeline.UnitChain(model, stage)
    x = torch.randn(2, 3) if stage == 0 else torch.randn(2, 4)
    with pytest.raises(PipelineError, match=f"^pp: Between.forward {says}: under pp every stage runs the model's "
                                            "forward, so that would run on every stage") as refused:
        model(x)
    assert "\n" not in str(refused.value)
    model(x)  # once: the chain's hooks are gone
    plain = Between("plain")
    pipeline.keep_stage(plain, stage, pipeline.stage_units(plain, 2))
    pipeline.UnitChain(plain, stage)
    plain(x)


def test_a_unit_another_stage_runs_passes_its_first_argument_through_whatever_else_it_is_given():
    """The loop of a nested stack calls each layer with more than the hidden states (an attention mask):
    on the stage that does not own a layer, the layer's call returns the hidden states unchanged."""
    model, whole = Nested(), Nested()
    whole.load_state_dict(model.state_dict())
    pipeline.keep_stage(model, 1, pipeline.stage_units(model, 2))
    assert isinstance(model.body.encoder.layer[0], torch.nn.Identity) and isinstance(model.body.embeddings,
                                                                                       torch.nn.Identity)
    x, mask = torch.randn(5, 3), torch.tensor([[1.0], [1.0], [0.0], [1.0], [1.0]])
    with torch.no_grad():
        hidden = whole.body.embeddings(x)
        for layer in whole.body.encoder.layer[:2]:
            hidden = layer(hidden) * mask
        assert torch.equal(model(hidden, mask), whole(x, mask))  # stage 1 from what stage 0 sends


def test_a_module_on_the_way_to_the_stack_holding_a_parameter_is_refused():
    model = Nested()
    model.body.scale = torch.nn.Parameter(torch.ones(()))
    with pytest.raises(PipelineError, match="its body holds scale directly") as caught:
        pipeline.stage_units(model, 2)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("build,split,words", [
    (lambda: torch.nn.Transformer(d_model=4, nhead=1, num_encoder_layers=1, num_decoder_layers=1,
                                  dim_feedforward=4), None, "its stack has 1 layers, fewer than the stages"),
    (lambda: Pair(), None, "has no nn.ModuleList of layers"),
    (lambda: torch.nn.Linear(2, 2), None, "its root holds weight, bias directly"),
    (lambda: Stack(layers=1), None, "its stack has 1 layers, fewer than the stages"),
    (lambda: Stack(), ["layers.9"], "not units of Stack; its units are embed, layers.0"),
    (lambda: Stack(), ["embed"], "in the model's order, after its first unit"),
    (lambda: Stack(), ["layers.1", "head"], "names 2 split points; pp=2 stages need 1"),
])
def test_a_model_or_split_the_pipeline_cannot_cut_is_refused_in_one_line(build, split, words):
    model = build()
    with pytest.raises(PipelineError) as caught:
        pipeline.stage_units(model, 2, split)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_parameters_on_the_root_are_refused():
    model = Stack()
    model.scale = torch.nn.Parameter(torch.ones(()))
    with pytest.raises(PipelineError, match="its root holds scale directly"):
        pipeline.stage_units(model, 2)


def test_a_parameter_shared_by_two_stages_is_refused():
    model = Stack()
    model.head.weight = torch.nn.Parameter(torch.randn(2, 4))
    model.layers[0].weight = model.layers[3].weight  # tied across the cut
    with pytest.raises(PipelineError, match="shared between stages 0 and 1"):
        pipeline.keep_stage(model, 0, pipeline.stage_units(model, 2))


# ---------------------------------------------------------------------- the settings
@pytest.mark.parametrize("given,words", [
    (dict(pp=2, pp_schedule="interleaved1f1b"), "have hung on gloo"),
    (dict(pp=2, pp_schedule="zbvzerobubble"), "have hung on gloo"),
    (dict(pp=4, pp_microbatches=2), "pp_microbatches=2 is fewer than the pp=4 stages"),
    (dict(pp=2, gradient_accumulation_steps=2), "raise pp_microbatches"),
    (dict(pp=2, sharding="fsdp", dp_replicate="nodes"), "give dp_replicate as a number"),
])
def test_settings_the_pipeline_cannot_run_are_refused_in_one_line(given, words):
    with pytest.raises(PipelineError) as caught:
        config_from(given, {}, cuda=False)
    assert words in str(caught.value) and "\n" not in str(caught.value)


def test_compile_with_a_pipeline_is_refused():
    """(Checked on the pure function: config_from with compile=True imports dynamo, 10 s.)"""
    assert "not supported yet" in pipeline.settings_problem(2, "1f1b", None, 1, 1, "inductor")


def test_the_settings_read_from_the_environment():
    config = config_from({}, {"UNIFIED_DIST_PP": "2", "UNIFIED_DIST_PP_SCHEDULE": "GPipe",
                              "UNIFIED_DIST_PP_MICROBATCHES": "4"}, cuda=False)
    assert (config.sharding.pp, config.sharding.pp_schedule, config.sharding.microbatches) == (2, "gpipe", 4)
    assert config_from({"pp": 3}, {}, cuda=False).sharding.microbatches == 3  # default: one per stage
    assert config_from({"pp": 2, "pp_split": "layers.2"}, {}, cuda=False).sharding.pp_split == ("layers.2",)


def test_launch_hands_pp_to_the_script():
    from unified_dist.cli import launch

    command = launch.build(launch.Plan(backend="torch", script="t.py", settings={"pp": 2, "pp_schedule": "gpipe",
                                                                                 "pp_microbatches": 4}), environ={})
    assert {k: v for k, v in command.env.items() if k.startswith("UNIFIED_DIST_PP")} == {
        "UNIFIED_DIST_PP": "2", "UNIFIED_DIST_PP_SCHEDULE": "gpipe", "UNIFIED_DIST_PP_MICROBATCHES": "4"}


# ---------------------------------------------------------------------- the backends
@pytest.mark.parametrize("name,runs", [("torch", True), ("accelerate", False), ("horovod", False),
                                       ("deepspeed", False), ("single", False)])
def test_only_the_torch_backend_runs_a_pipeline(name, runs):
    assert backend_class(name).supports_pipeline is runs


def _init_with_pp_is_refused_in_one_line(monkeypatch, match):
    """``ud.init(pp=2)`` in this plain process (no launcher's variables) raises a one-line PipelineError."""
    for variable in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(variable, raising=False)
    try:
        with pytest.raises(PipelineError, match=match) as caught:
            ud.init(pp=2)
        assert "\n" not in str(caught.value)
    finally:
        ud.shutdown()


def test_a_pipeline_without_the_torch_backend_is_refused_at_init(monkeypatch):
    _init_with_pp_is_refused_in_one_line(monkeypatch, "runs on the torch backend only")


def test_pipeline_step_of_a_model_not_cut_into_stages_is_refused():
    try:
        model = ud.prepare(torch.nn.Linear(2, 2))
        with pytest.raises(PipelineError, match="needs a model that ud.prepare cut into pipeline stages"):
            ud.pipeline_step(model, torch.randn(4, 2), torch.randn(4, 2), torch.nn.functional.mse_loss)
    finally:
        ud.shutdown()


def test_the_pipeline_error_is_a_unified_dist_error():
    assert issubclass(PipelineError, UnifiedDistError) and issubclass(PipelineError, ValueError)


def test_data_parallel_stages_without_fsdp_are_refused_in_one_line():
    """pp 2 on 4 ranks leaves 2 data-parallel ranks per stage, whose gradients only FSDP2 averages here."""
    from unified_dist.backends.fsdp import FsdpModels
    from unified_dist.parallel.sharding import Sharding

    with pytest.raises(LaunchError, match="pp=2 on 4 ranks leaves 2 data-parallel ranks.*add sharding='fsdp'"):
        FsdpModels(Sharding(pp=2), "no", world_size=4)


def test_a_pipeline_with_replica_groups_is_refused_at_init(monkeypatch):
    """A replica group of one plain process runs the torch backend (torchft needs it); pp is refused before it
    starts, so no lighthouse is asked."""
    from unified_dist.backends import replica_groups

    monkeypatch.setenv(replica_groups.LIGHTHOUSE_VAR, "http://localhost:1")
    monkeypatch.setenv(replica_groups.GROUP_VAR, "0")
    monkeypatch.setenv(replica_groups.GROUPS_VAR, "2")
    _init_with_pp_is_refused_in_one_line(monkeypatch, "runs the torch backend with replica groups")


def test_the_per_rank_checkpoint_formats_are_refused_under_pp():
    """ud.save_sharded/load_sharded of a pipelined model: one line naming ud.save/ud.load; ud.save and ud.load
    themselves go on (they gather the stages: tests/launchers/test_pipeline_under_launchers.py)."""
    from types import SimpleNamespace

    from unified_dist.backends.base import Config
    from unified_dist.backends.torch_ddp import TorchBackend
    from unified_dist.parallel.sharding import Sharding

    backend = SimpleNamespace(config=Config(sharding=Sharding(pp=2)))
    for action in ("save_sharded", "load_sharded"):
        problem = TorchBackend.checkpoint_problem(backend, action)
        assert "not supported yet" in problem and "use ud.save and ud.load" in problem and "\n" not in problem
    assert TorchBackend.checkpoint_problem(backend, "save") is None
    assert TorchBackend.checkpoint_problem(backend, "load") is None
