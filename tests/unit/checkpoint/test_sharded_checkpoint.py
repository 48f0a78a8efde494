"""save_sharded / load_sharded in one process (DCP runs without a process group): round trip,
atomic replacement, the fallback after a save killed between its renames, one-line errors.
Saving under 2 ranks with FSDP2 and loading under another world size runs in the contract suite."""
from __future__ import annotations

import os

import pytest
import torch

from unified_dist.checkpoint import sharded as sc
from unified_dist.errors import CheckpointError


def _parts(seed: int, step: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 3)).sum().backward()
    optimizer.step()
    return sc.split({"model": model, "optimizer": optimizer, "step": step}, lambda m: m,
                    lambda o: o if isinstance(o, torch.optim.Optimizer) else None)


def _save(parts, directory):
    sc.save(parts, str(directory), 0, lambda x: x, lambda: None)


def _same_state(a, b):
    for (ka, va), (kb, vb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)
    sa, sb = a.optimizers["optimizer"].state_dict()["state"], b.optimizers["optimizer"].state_dict()["state"]
    assert all(torch.equal(sa[i][k], sb[i][k]) for i in sa for k in sa[i])


def test_round_trip_restores_model_optimizer_and_plain_values(tmp_path):
    saved = _parts(seed=0, step=7)
    _save(saved, tmp_path / "ck")
    fresh = _parts(seed=1)
    assert sc.load(fresh, str(tmp_path / "ck")) == {"step": 7}
    _same_state(saved, fresh)


def test_a_second_save_replaces_the_first_whole_and_leaves_no_partial_directory(tmp_path):
    _save(_parts(seed=0, step=1), tmp_path / "ck")
    os.makedirs(tmp_path / "ck.partial-deadbeef")  # a save that was killed earlier
    newer = _parts(seed=2, step=2)
    _save(newer, tmp_path / "ck")
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    fresh = _parts(seed=3)
    assert sc.load(fresh, str(tmp_path / "ck")) == {"step": 2}
    _same_state(newer, fresh)


def test_a_save_killed_between_its_renames_loads_the_previous_checkpoint(tmp_path):
    old = _parts(seed=0, step=1)
    _save(old, tmp_path / "ck")
    os.replace(tmp_path / "ck", tmp_path / "ck.previous")  # the kill fell after the first rename
    fresh = _parts(seed=4)
    assert sc.load(fresh, str(tmp_path / "ck")) == {"step": 1}
    _same_state(old, fresh)


def test_missing_or_mismatched_checkpoints_are_one_line_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no complete sharded checkpoint") as info:
        sc.load(_parts(seed=0), str(tmp_path / "nothing"))
    assert "\n" not in str(info.value)
    _save(_parts(seed=0), tmp_path / "ck")
    other = sc.split({"model": torch.nn.Linear(9, 9)}, lambda m: m, lambda o: None)
    with pytest.raises(CheckpointError, match="does not match this model") as info:
        sc.load(other, str(tmp_path / "ck"))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("obj,words", [([], "take a dict"), ({"step": 1}, "exactly one model"),
                                       ({"a": torch.nn.Linear(1, 1), "b": torch.nn.Linear(1, 1)}, "exactly one model")])
def test_the_object_must_be_a_dict_with_one_model(obj, words):
    with pytest.raises(CheckpointError, match=words):
        sc.split(obj, lambda m: m, lambda o: None)
