"""Sharded (and full) checkpoints move between device-mesh layouts, AdamW state included, and the
training they carry goes on as one uninterrupted run (issue #26, item 6).

One run of 14 AdamW steps, 2 per leg, each leg in another layout, each resuming the previous leg's
``ud.save_sharded`` with ``ud.load_sharded``:

    this process (1, no sharding) -> torchrun x 4: HSDP 2x2 -> FSDP 4 -> FSDP x TP 2x2 -> TP 4
    (one launch, ud.shutdown()/ud.init() between) -> torchrun x 2: FSDP 2 -> this process again

Every leg also loads every checkpoint already written (both ``ud.save_sharded``'s and ``ud.save``'s)
into a fresh model and optimizer of its layout and compares it, bitwise, with the witness the saving
leg gathered with torch's ``full_tensor()``; at the end of the x4 launch each of its layouts loads
those written after it trained. See tests/launchers/workers/reshard_worker.py.
"""
from __future__ import annotations

import json
import sys

import pytest
import torch

import unified_dist as ud
from unified_dist.testing.launchers import ROOT, launch

sys.path.insert(0, str(ROOT / "tests" / "launchers" / "workers"))
import reshard_worker as worker  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

WORKER = "tests/launchers/workers/reshard_worker.py"
X4 = ("hsdp", "fsdp4", "fsdp_tp", "tp4")
X2 = ("fsdp2",)
CHAIN = ("plain", *X4, *X2, "plain")
TOL = 1e-6
"""Weights and AdamW moments after the same steps as one plain process. AdamW (lr 1e-2) moves each
weight by up to about lr per step whatever the gradient's scale, so a lost or misplaced optimizer
state (a restart of Adam's bias correction, another shard's moments) or a wrong weight shard moves
weights by ~1e-3 or more at the next step; float32 rounding of the split sums (other reduction orders
under FSDP/HSDP/TP) moved them by at most 4.5e-8 in 14 steps (measured; the moments by 4.5e-8 and
9.3e-10). 1e-6 is 20 times the measured rounding and a ten-thousandth of one step."""


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("reshard"))
    first, last, verified = {}, {}, set()
    ud.shutdown()
    worker.leg("plain", out, first, verified, index=0)
    x4 = launch("torchrun", WORKER, ["--out", out, "--chain", ",".join(X4)], nproc=4, timeout=420).check()
    x2 = launch("torchrun", WORKER, ["--out", out, "--chain", ",".join(X2)], nproc=2, timeout=240).check()
    worker.leg("plain", out, last, verified, index=len(X4) + len(X2) + 1)
    ranks = {"this process, first leg": first, "this process, last leg": last}
    for chain, n in ((X4, 4), (X2, 2)):
        for r in range(n):
            path = f"{out}/reshard_{'_'.join(chain)}_rank{r}.json"
            ranks[f"{','.join(chain)} rank {r}"] = json.loads(open(path).read())
    return out, ranks, x4.output + x2.output


def _failures(ranks, fragment):
    return [f"{who}: {check}: {value}" for who, results in ranks.items() for check, value in results.items()
            if fragment in check and value != "ok"]


def test_each_leg_ran_in_its_layout_and_resumed_the_previous_legs_checkpoint(run):
    """World size, data-parallel size, the mesh's shape and block 0's w1 placements are those of the layout
    (HSDP: Replicate, Shard; FSDP x TP: _StridedShard, Shard; TP and FSDP: Shard), and every leg but
    the first loaded the previous leg's sharded checkpoint without an error."""
    _, ranks, output = run
    for fragment in ("/identity", "/parameters_are_laid_out_on_the_mesh", "/resumes_from"):
        assert not _failures(ranks, fragment), "\n".join(_failures(ranks, fragment))[:4000] + output[-2000:]
    for check in ("parameters_are_laid_out_on_the_mesh", "resumes_from_the_previous_legs_sharded_checkpoint"):
        legs = {c.split("/")[0] for results in ranks.values() for c in results if c.endswith(f"/{check}")}
        assert legs == set(CHAIN), (check, legs)
    assert "resumes_from_the_previous_legs_sharded_checkpoint" not in " ".join(ranks["this process, first leg"])


@pytest.mark.parametrize("index", range(len(CHAIN)), ids=[f"{i:02d}_{name}" for i, name in enumerate(CHAIN)])
def test_each_leg_resumes_the_previous_layouts_sharded_checkpoint_and_goes_on_as_one_process(run, index):
    """The state leg ``index`` saved (weights, AdamW step, exp_avg, exp_avg_sq; gathered by torch)
    equals one plain process's after the same number of steps on the same global batches."""
    out, _, _ = run
    found = worker.checkpoints(out)
    assert [(i, layout) for i, layout, _ in found] == list(enumerate(CHAIN)), found
    witness = torch.load(f"{found[index][2]}_witness.pt", weights_only=True)
    steps = 2 * (index + 1)
    assert witness["step"] == steps, f"leg {index} ended at step {witness['step']}, not {steps}: it did not resume"
    ref = worker.reference(steps)
    assert sorted(witness["model"]) == sorted(ref["model"])
    for name, want in ref["model"].items():
        err = (witness["model"][name] - want).abs().max().item()
        assert err <= TOL, f"weight {name}: max error {err:.2e}"
        state = witness["optim"][name]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"], sorted(state)
        assert state["step"].item() == steps, (name, state["step"])
        for moment in ("exp_avg", "exp_avg_sq"):
            err = (state[moment] - ref["optim"][name][moment]).abs().max().item()
            assert err <= TOL, f"{moment} of {name}: max error {err:.2e}"


def _loaded(ranks, kind):
    """{target layout: the checkpoints (NN_layout) every one of its ranks loaded of this kind}."""
    into = {}
    for results in ranks.values():
        for check in results:
            target, what, name = check.split("/") if check.count("/") == 2 else (None, None, None)
            if what == "equals_witness" and name.endswith(f"_{kind}"):
                into.setdefault(target, set()).add(name[:-len(kind) - 1])
    return into


@pytest.mark.parametrize("kind", ["sharded", "full"])
def test_every_checkpoint_loads_bitwise_into_every_layout(run, kind):
    """``ud.load_sharded`` (``sharded``) and ``ud.load`` of ``ud.save``'s file (``full``): every checkpoint
    written so far, loaded into a fresh model and optimizer of each layout, holds exactly the saving
    leg's weights and AdamW state (step, exp_avg, exp_avg_sq) and its step count, each moment laid out
    as its parameter (a DTensor on the same mesh and placements, or a plain tensor)."""
    _, ranks, output = run
    failures = [f for fragment in ("/loads/", "/optimizer_state_is_laid_out_like_its_parameter/", "/equals_witness/")
                for f in _failures(ranks, fragment) if f"_{kind}:" in f]
    assert not failures, "\n".join(failures)[:4000] + output[-2000:]
    names = [f"{i:02d}_{layout}" for i, layout in enumerate(CHAIN)]
    first_x2 = 1 + len(X4)
    want = {**{layout: set(names[:first_x2]) for layout in X4},  # the x4 launch: all but what came after it
            "fsdp2": set(names[:first_x2 + 1]), "plain": set(names)}
    assert _loaded(ranks, kind) == want, _loaded(ranks, kind)
