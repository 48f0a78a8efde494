"""Sharded (and full) checkpoints move between device-mesh layouts, AdamW state included, and the
training they carry goes on as one uninterrupted run (issue #26, item 6).

One run of 14 AdamW steps, 2 per leg, each leg in another layout, each resuming the previous leg's
``ud.save_sharded`` with ``ud.load_sharded``:

    this process (1, no sharding) -> torchrun x 2: FSDP 2 -> torchrun x 4: HSDP 2x2 -> FSDP 4 -> FSDP x TP 2x2
    -> TP 4 (one launch, ud.shutdown()/ud.init() between) -> this process again

Every leg also loads every checkpoint already written (both ``ud.save_sharded``'s and ``ud.save``'s)
into a fresh model and optimizer of its layout and compares it, bitwise, with the witness the saving
leg gathered with torch's ``full_tensor()``; at the end of the x4 launch each of its layouts loads
those written after it trained. See tests/launchers/workers/reshard_worker.py.

The pipeline legs (issue 61, item 5) run a second chain of 10 AdamW steps, 2 per leg, in float64, through
``ud.save``/``ud.load`` of model and optimizer (the per-rank formats are refused under pp), in the same
launches after their float32 legs (a fresh ``ud.init``; no launch of their own):

    this process (1) -> torchrun x 2: pp 2 -> torchrun x 4: pp 2 x FSDP 2 -> TP 4 -> this process (1)

(which is why the x 2 launch runs before the x 4 one).
"""
from __future__ import annotations

import json
import os
import sys
import time

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
CHAIN = ("plain", *X2, *X4, "plain")
PP_X2 = ("pp2",)
PP_X4 = ("pp2_fsdp2", "tp4")
PP_CHAIN = ("plain", *PP_X2, *PP_X4, "plain")
PP_TOL = 1e-9
"""The pipeline chain's weights and AdamW moments after 2..10 steps against one plain process, both float64.
Each leg sums a gradient in another order than one process (per microbatch, then the schedule's division by the
microbatches, FSDP's average over 2 ranks, TP's split sums): each sum of n <= 16 O(1) terms moves by at most
n * 2**-53 ~ 2e-15 of them, and a checkpoint copies values exactly. AdamW divides by sqrt(v) + eps >= eps = 1e-8,
so a gradient error dg moves a step of lr = 1e-2 by at most lr * dg / eps ~ 1e-10 in the worst case (a gradient
near 0), far less (lr * dg / |g| ~ 1e-17) where |g| is not tiny; 10 steps stay below 1e-9 (measured 5.6e-17). A
lost or misplaced optimizer state (Adam's bias correction restarting, another parameter's moments) moves weights
by ~lr = 1e-2 at the next step, and a leg that did not resume ends 2 steps short (its step count says so)."""
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
    first, last, verified, pp = {}, {}, set(), {"this process": {}}
    os.makedirs(f"{out}/pp")
    ud.shutdown()
    worker.leg("plain", out, first, verified, index=0)
    started = time.perf_counter()
    worker.pp_leg("plain", f"{out}/pp", pp["this process"])
    in_process = time.perf_counter() - started
    x2 = launch("torchrun", WORKER, ["--out", out, "--chain", ",".join(X2), "--pp-chain", ",".join(PP_X2)],
                nproc=2, timeout=240).check()
    x4 = launch("torchrun", WORKER, ["--out", out, "--chain", ",".join(X4), "--pp-chain", ",".join(PP_X4)],
                nproc=4, timeout=420).check()
    worker.leg("plain", out, last, verified, index=len(X4) + len(X2) + 1)
    started = time.perf_counter()
    worker.pp_leg("plain", f"{out}/pp", pp["this process"])
    in_process += time.perf_counter() - started
    print(f"pipeline legs in this process: {in_process:.1f} s;",  # and in the launches (their own lines)
          *(line for line in (x2.output + x4.output).splitlines() if line.startswith("pipeline legs ")))
    ranks = {"this process, first leg": first, "this process, last leg": last}
    for chain, pp_chain, n in ((X2, PP_X2, 2), (X4, PP_X4, 4)):
        for r in range(n):
            path = f"{out}/reshard_{'_'.join(chain)}_rank{r}.json"
            ranks[f"{','.join(chain)} rank {r}"] = json.loads(open(path).read())
            path = f"{out}/pp/reshard_{'_'.join(pp_chain)}_rank{r}.json"
            pp[f"{','.join(pp_chain)} rank {r}"] = json.loads(open(path).read())
    return out, ranks, x2.output + x4.output, pp


def _failures(ranks, fragment):
    return [f"{who}: {check}: {value}" for who, results in ranks.items() for check, value in results.items()
            if fragment in check and value != "ok"]


def test_each_leg_ran_in_its_layout_and_resumed_the_previous_legs_checkpoint(run):
    """World size, data-parallel size, the mesh's shape and block 0's w1 placements are those of the layout
    (HSDP: Replicate, Shard; FSDP x TP: _StridedShard, Shard; TP and FSDP: Shard), and every leg but
    the first loaded the previous leg's sharded checkpoint without an error."""
    _, ranks, output, _ = run
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
    out, _, _, _ = run
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
    _, ranks, output, _ = run
    failures = [f for fragment in ("/loads/", "/optimizer_state_is_laid_out_like_its_parameter/", "/equals_witness/")
                for f in _failures(ranks, fragment) if f"_{kind}:" in f]
    assert not failures, "\n".join(failures)[:4000] + output[-2000:]
    names = [f"{i:02d}_{layout}" for i, layout in enumerate(CHAIN)]
    after_x4 = 1 + len(X2) + len(X4)
    want = {"fsdp2": set(names[:1 + len(X2)]),  # the x2 launch: the first leg's and its own
            **{layout: set(names[:after_x4]) for layout in X4},  # the x4 launch: all but what came after it
            "plain": set(names)}
    assert _loaded(ranks, kind) == want, _loaded(ranks, kind)


def test_the_pipeline_legs_each_resume_the_previous_leg_and_end_on_the_uninterrupted_weights(run):
    """1 -> pp 2 -> pp 2 x FSDP 2 -> TP 4 -> 1, in float64: every leg ran in its layout (its pipeline stages and
    data-parallel ranks) and ``ud.load``-ed the previous leg's ``ud.save`` of model and AdamW state without an
    error; the file each leg wrote (the whole model's weights by name, its optimizer state numbered as one
    process's over ``MeshNet().parameters()``) holds, after 2, 4, .. 10 steps, the weights, AdamW step and
    moments of one plain process (plain torch) after as many steps on the same global batches, within PP_TOL:
    the chain ends on the uninterrupted run's weights."""
    out, _, output, pp = run
    failures = [f"{who}: {check}: {value}" for who, results in pp.items() for check, value in results.items()
                if value != "ok"]
    assert not failures, "\n".join(failures)[:4000] + output[-2000:]
    checks = {check for results in pp.values() for check in results}
    assert checks == {f"pp/{layout}/{check}" for layout in PP_CHAIN  # the first leg alone resumes nothing
                      for check in ("identity", "resumes_from_the_previous_legs_checkpoint")}, sorted(checks)
    assert [(i, layout) for i, layout, _ in worker.pp_checkpoints(f"{out}/pp")] == list(enumerate(PP_CHAIN))
    names = [name for name, _ in worker.MeshNet().named_parameters()]  # AdamW(model.parameters())'s numbering
    worst = 0.0
    for index, layout, path in worker.pp_checkpoints(f"{out}/pp"):
        saved = torch.load(path, weights_only=True)
        steps = 2 * (index + 1)
        assert saved["step"] == steps, f"leg {index} ({layout}) ended at step {saved['step']}, not {steps}"
        ref = worker.reference(steps, torch.float64)
        assert sorted(saved["model"]) == sorted(names), (layout, sorted(saved["model"]))
        assert [group["params"] for group in saved["optimizer"]["param_groups"]] == [list(range(len(names)))]
        for number, name in enumerate(names):
            assert saved["model"][name].dtype == torch.float64, (layout, name, saved["model"][name].dtype)
            worst = max(worst, (saved["model"][name] - ref["model"][name]).abs().max().item())
            state = saved["optimizer"]["state"][number]
            assert state["step"].item() == steps, (layout, name, state["step"])
            for moment in ("exp_avg", "exp_avg_sq"):
                worst = max(worst, (state[moment] - ref["optim"][name][moment]).abs().max().item())
        assert worst <= PP_TOL, f"leg {index} ({layout}): max error {worst:.2e}"
    print(f"pipeline legs: max |state - one process| {worst:.2e}")
