"""The numbering of a pipeline's gathered optimizer state (unified_dist/parallel/pipeline_optimizer.py), against
what torch itself numbers for one optimizer over the whole model (expected values from torch, not the code)."""
from __future__ import annotations

import torch

from unified_dist.parallel.pipeline_optimizer import _numbered


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))


def test_two_stages_two_groups_are_numbered_as_one_optimizer_over_the_whole_model():
    model = _model()
    named = dict(model.named_parameters())
    weights = [n for n in named if n.endswith("weight")]
    biases = [n for n in named if n.endswith("bias")]
    whole = torch.optim.SGD([{"params": [named[n] for n in weights], "lr": 0.1},
                             {"params": [named[n] for n in biases], "lr": 0.2, "weight_decay": 0.0}], momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    whole.step()
    expected = whole.state_dict()  # torch's own numbering: group 0's weights, then group 1's biases
    name_of = {id(p): n for n, p in named.items()}
    by_name = {name_of[id(p)]: whole.state[p] for p in model.parameters()}
    stage_names = [["0.weight", "0.bias", "1.weight", "1.bias"], ["2.weight", "2.bias"]]  # model order per stage
    parts = []
    for names in stage_names:
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [n for n in names if n in (weights if i == 0 else biases)]}
                  for i, g in enumerate(expected["param_groups"])]
        parts.append({"order": names, "state": {n: by_name[n] for n in names}, "groups": groups})
    got = _numbered(parts, [False, False])
    assert got["param_groups"] == expected["param_groups"]
    assert sorted(got["state"]) == sorted(expected["state"])
    for index, entry in expected["state"].items():
        assert torch.equal(got["state"][index]["momentum_buffer"], entry["momentum_buffer"])
