"""Issue #53: replica groups that outlive one another (``unified-dist launch --replica-groups N``, torchft).

The script is tests/launchers/workers/replica_worker.py: a plain facade loop that runs until its optimizer has
taken ``--steps`` steps. Five launches, shared by every assertion:

1. ``python worker.py --batch 8`` (one process, no replica groups): the reference for the physics;
2. 2 groups x 1 process, batch 4 each, nothing killed: every step averages both groups' 4 examples, so the
   update is the one-process batch-8 update (1e-6 of the largest weight after 60 float32 steps: another
   summation order);
3. 2 x 1, group 1 killed with SIGKILL after step 8: the survivor never restarts and keeps stepping alone (its
   steps with one group recorded), group 1 is started again, heals from group 0 over torchft's transport (no
   file is written or read anywhere), and both end with bitwise equal weights;
4. 2 x 1, group 1 hangs in step 8 for 30 s with a 5 s timeout: it leaves after the timeout (its watchdog), group
   0 goes on alone, group 1 comes back healed; equal weights at the end;
5. 2 groups x 2 processes with FSDP2 inside each group, group 0 (the first) killed after step 6: the same, on 4
   ranks.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from unified_dist.testing.launchers import BIN, ROOT, child_env, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 240
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "replica_worker.py"
STEPS = 60


def events(folder: Path, group: int, rank: int = 0) -> list:
    return [json.loads(line) for line in (folder / f"group{group}_rank{rank}.jsonl").read_text().splitlines()]


def launch(folder: Path, groups: int, nproc: int, args: list):
    cmd = [str(BIN / "unified-dist"), "launch", "--backend", "torch", "--nproc", str(nproc), "--replica-groups",
           str(groups), str(SCRIPT), "--out", str(folder), *args]
    result = run(cmd, TIMEOUT, child_env())
    result.check()
    return result


@pytest.fixture(scope="module")
def runs(module_dirs):
    tmp = module_dirs.mktemp("replica_groups")
    found = {}
    ref = tmp / "reference"
    run([str(BIN / "python"), str(SCRIPT), "--out", str(ref), "--batch", "8", "--steps", str(STEPS),
         "--step-sleep", "0"], TIMEOUT, child_env()).check()
    found["reference"] = ref
    found["whole"] = tmp / "whole"
    launch(found["whole"], 2, 1, ["--steps", str(STEPS), "--step-sleep", "0", "--save"])
    found["kill"] = tmp / "kill"
    found["kill_output"] = launch(found["kill"], 2, 1, ["--steps", str(STEPS), "--step-sleep", "0.15",
                                                        "--kill-group", "1", "--kill-at", "8"]).output
    found["hang"] = tmp / "hang"
    found["hang_output"] = launch(found["hang"], 2, 1, ["--steps", str(STEPS), "--step-sleep", "0.15", "--timeout",
                                                        "5", "--hang-group", "1", "--hang-at", "8", "--hang-s", "30"]
                                  ).output
    found["fsdp"] = tmp / "fsdp"
    found["fsdp_output"] = launch(found["fsdp"], 2, 2, ["--steps", "40", "--step-sleep", "0.15", "--sharding", "fsdp",
                                                        "--kill-group", "0", "--kill-at", "6"]).output
    return found


def end(folder: Path, group: int, rank: int = 0) -> dict:
    ends = [e for e in events(folder, group, rank) if e["event"] == "end"]
    assert len(ends) == 1, ends
    return ends[0]


def steps(folder: Path, group: int, rank: int = 0) -> list:
    """The committed steps: (count, ``ud.data_parallel_world_size()``). A step during which a peer failed is
    not committed on any group (nothing applied) and runs again: it is left out here."""
    return [(e["step"], e["dp"]) for e in events(folder, group, rank) if e["event"] == "step" and e["committed"]]


def dropped(folder: Path, group: int, rank: int = 0) -> int:
    return sum(1 for e in events(folder, group, rank) if e["event"] == "step" and not e["committed"])


def pids(folder: Path, group: int, rank: int = 0) -> list:
    return [e["pid"] for e in events(folder, group, rank) if e["event"] == "start"]


def test_two_groups_of_batch_4_make_the_one_process_batch_8_update(runs):
    whole, ref = runs["whole"], runs["reference"]
    assert end(whole, 0)["digest"] == end(whole, 1)["digest"]
    got, expected = end(whole, 0)["params"], end(ref, 0)["params"]
    scale = max(abs(v) for v in expected)
    assert max(abs(a - b) for a, b in zip(got, expected)) <= 1e-6 * scale  # float32, 60 steps, another order
    assert abs(end(whole, 0)["loss"] - end(ref, 0)["loss"]) <= 1e-5 * end(ref, 0)["loss"]
    assert steps(whole, 0) == [(s, 2) for s in range(1, STEPS + 1)]  # both groups in every step


def test_ud_save_under_replica_groups_writes_the_final_weights_for_a_whole_job_restart(runs):
    import torch

    saved = torch.load(runs["whole"] / "final.pt", weights_only=True)
    flat = torch.cat([t.reshape(-1) for t in saved["model"].values()]).tolist()
    assert flat == end(runs["whole"], 0)["params"]
    assert saved["optimizer"]["steps_taken"] == STEPS


def check_survival(folder: Path, survivor: int, lost: int, lost_after: int, total: int, ranks=(0,)) -> None:
    for rank in ranks:
        assert len(pids(folder, survivor, rank)) == 1, "the surviving group was started again"
        assert len(pids(folder, lost, rank)) == 2, "the lost group was not started again exactly once"
        kept = steps(folder, survivor, rank)
        assert [s for s, _ in kept] == list(range(1, total + 1)), "the survivor lost or repeated a step"
        full = kept[0][1]
        alone = [s for s, dp in kept if dp < full]
        assert alone and min(alone) > lost_after, "no step ran with fewer groups while one was away"
        healed = end(folder, lost, rank)["healed_at"]
        assert healed is not None and healed >= max(alone), (healed, alone)
        # after healing, the new group takes part in every step from the next one on
        back = [s for s, _ in steps(folder, lost, rank)][lost_after:]
        assert back == list(range(healed + 1, total + 1))
        # the restarted group's first step ran its forward on the survivor's weights (healed before the batch)
        first_back = [e for e in events(folder, lost, rank) if e["event"] == "step" and e["step"] == healed + 1]
        same_step = [e for e in events(folder, survivor, rank) if e["event"] == "step" and e["step"] == healed + 1]
        assert first_back[0]["used"] == same_step[0]["used"]
        assert all(dp == full for s, dp in kept if s > healed)
        digests = {end(folder, g, rank)["digest"] for g in (survivor, lost)}
        assert len(digests) == 1, "the groups ended with different weights"
    assert not [p for p in folder.iterdir() if p.suffix not in (".jsonl", ".done")], "a file was written"


def test_a_killed_group_is_healed_from_the_survivor_which_never_stopped(runs):
    check_survival(runs["kill"], survivor=0, lost=1, lost_after=8, total=STEPS)
    out = runs["kill_output"]
    assert "replica group 1 exited with" in out and "starting it again (restart 1 of 3)" in out
    assert "replica group 0: step 9 ran with 1 of 2 groups" in out
    assert "replica group 1 healed from a live peer at step" in out
    assert "GET /checkpoint/" in out  # torchft's HTTP checkpoint transport served the copy


def test_the_steps_with_fewer_samples_account_for_the_final_loss(runs):
    """The interrupted run took its steps with one group's 4 examples while group 1 was away; the rest is the
    uninterrupted run's arithmetic. Both learn (the loss falls well below its start) and end close."""
    kill, whole = end(runs["kill"], 0), end(runs["whole"], 0)
    alone = [s for s, dp in steps(runs["kill"], 0) if dp == 1]
    assert kill["short_steps"] == [[s, 1] for s in alone]
    assert kill["loss"] != whole["loss"]
    first = [e["loss"] for e in events(runs["whole"], 0) if e["event"] == "step"][0]
    assert kill["loss"] < 0.8 * first and whole["loss"] < 0.8 * first
    assert abs(kill["loss"] - whole["loss"]) <= 0.25 * whole["loss"]


def test_a_group_hung_past_the_timeout_leaves_and_comes_back_healed(runs):
    check_survival(runs["hang"], survivor=0, lost=1, lost_after=7, total=STEPS)
    assert dropped(runs["hang"], 0) == 1  # step 8 timed out waiting for group 1: dropped, then run again alone
    assert "replica group 1 rank 0: step 8 has run for more than the timeout (5 s)" in runs["hang_output"]


def test_fsdp_inside_groups_of_two_survives_the_loss_of_the_first_group(runs):
    check_survival(runs["fsdp"], survivor=1, lost=0, lost_after=6, total=40, ranks=(0, 1))
    assert {end(runs["fsdp"], g, r)["digest"] for g in (0, 1) for r in (0, 1)} == {end(runs["fsdp"], 1)["digest"]}
    # rank and world size are the replica group's own; the data-parallel size counts every group's ranks
    assert {(end(runs["fsdp"], g, r)["rank"], end(runs["fsdp"], g, r)["world"]) for g in (0, 1) for r in (0, 1)} == \
        {(0, 2), (1, 2)}
    assert steps(runs["fsdp"], 1)[0] == (1, 4)
