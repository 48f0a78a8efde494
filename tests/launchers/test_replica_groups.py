"""Issue #53: replica groups that outlive one another (``unified-dist launch --replica-groups N``, torchft).

The script is tests/launchers/workers/replica_worker.py: a plain facade loop that runs until its optimizer has
taken ``--steps`` steps. Five launches, shared by every assertion:

1. ``python worker.py --batch 8`` (one process, no replica groups): the reference for the physics;
2. 2 groups x 1 process, batch 4 each, nothing killed (launches 1 and 2 also replay run 3's schedule in one
   process, below): every step averages both groups' 4 examples, so the
   update is the one-process batch-8 update (1e-12 of the largest weight after 60 float64 steps: another
   summation order; BOUND below says why);
3. 2 x 1, group 1 killed with SIGKILL after step 8: the survivor never restarts and keeps stepping alone (its
   steps with one group recorded), group 1 is started again, heals from group 0 over torchft's transport (no
   file is written or read anywhere), and both end with bitwise equal weights;
4. 2 x 1, group 1 hangs in step 8 for 30 s with a 5 s timeout: it leaves after the timeout (its watchdog), group
   0 goes on alone, group 1 comes back healed; equal weights at the end;
5. 2 groups x 2 processes with FSDP2 inside each group, group 0 (the first) killed after step 6: the same, on 4
   ranks;
6. the several-hosts recipe of docs/fault-tolerance.md on the one-node SLURM: the lighthouse started by hand, one
   ``srun`` per group with the three variables, group 1 killed after step 8 and started again by hand with
   ``REPLICA_GROUP_RESTARTS=1``: the same as 3.
"""
from __future__ import annotations

import concurrent.futures
import json
import subprocess
import time
from pathlib import Path

import pytest

from unified_dist.testing.launchers import BIN, ROOT, child_env, command, kill_session, run
from unified_dist.testing.replica_runs import events, group_env, launch_command, lighthouse_by_hand

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 240
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "replica_worker.py"
STEPS = 60
PACE = ["--step-sleep", "0.1", "--alone-sleep", "0.5", "--await-restart", "180"]
"""Steps of 0.1 s, and 0.5 s while a group is away; and while it is away, the survivor waits after each step until
the lost group's new process has started (up to 180 s): it is still running when its peer comes back, however
long a loaded machine takes to restart a group (28 s was seen under load, against 26 s of paced steps)."""
BOUND = 1e-12
"""How far, relative to the largest weight (or the loss), two float64 runs that sum the same numbers in another
order may end apart after 60 steps. Derived, not tuned: the same runs in float32 ended 2.06e-6 apart on the slowest
CPU seen (issue #58), 17 float32 epsilons (1.19e-7): that is this loop's amplification of one rounding over 60
steps. In float64 (epsilon 2.2e-16) the same amplification gives ~4e-15; 1e-12 leaves a margin of 250 for another
CPU's kernels. A real mistake is another update: one step on 4 examples instead of 8 moves the weights by ~1e-3,
and test_the_steps_with_fewer_samples_account_for_the_final_loss asserts the interrupted run is 1000 x further."""


def launch(folder: Path, groups: int, nproc: int, args: list):
    cmd = launch_command([SCRIPT, "--out", folder, *args], groups, nproc, flags=["--backend", "torch"])
    result = run(cmd, TIMEOUT, child_env())
    result.check()
    return result


@pytest.fixture(scope="module")
def runs(module_dirs):
    """The five launches and the replay, in two chains at once: the replay needs launch 3's schedule, and nothing
    else needs another launch. Most of a launch's time is waits (the paced steps, a group's restart, the hang, the
    quorums), so each chain's waits are the other's CPU time: under load 5-7 on 2 cores the fixture took 180-220 s
    one launch after another. Each launch keeps its own folder, its own output and its own lighthouse (the launcher
    lets the OS pick its port); no assertion reads timings, and the paced launches already allow for a loaded
    machine (PACE)."""
    tmp = module_dirs.mktemp("replica_groups")
    found = {}

    def reference_hang_and_fsdp():
        ref = tmp / "reference"
        run([str(BIN / "python"), str(SCRIPT), "--out", str(ref), "--batch", "8", "--steps", str(STEPS),
             "--step-sleep", "0"], TIMEOUT, child_env()).check()
        found["reference"] = ref
        found["hang"] = tmp / "hang"
        found["hang_output"] = launch(found["hang"], 2, 1, ["--steps", str(STEPS), *PACE, "--timeout", "5",
                                                            "--hang-group", "1", "--hang-at", "8", "--hang-s", "30"]
                                      ).output
        found["fsdp"] = tmp / "fsdp"
        found["fsdp_output"] = launch(found["fsdp"], 2, 2, ["--steps", "40", *PACE, "--sharding", "fsdp",
                                                            "--kill-group", "0", "--kill-at", "6"]).output

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        other_chain = pool.submit(reference_hang_and_fsdp)
        try:
            found["whole"] = tmp / "whole"
            launch(found["whole"], 2, 1, ["--steps", str(STEPS), "--step-sleep", "0", "--save"])
            found["kill"] = tmp / "kill"
            found["kill_output"] = launch(found["kill"], 2, 1, ["--steps", str(STEPS), *PACE,
                                                                "--kill-group", "1", "--kill-at", "8"]).output
            schedule = [[e["committed"], [0, 1] if e["dp"] == 2 else [0]] for e in events(found["kill"], 0)
                        if e["event"] == "step"]
            (tmp / "schedule.json").write_text(json.dumps(schedule))
            found["replay"] = tmp / "replay"
            run([str(BIN / "python"), str(SCRIPT), "--out", str(found["replay"]), "--batch", "8", "--replay",
                 str(tmp / "schedule.json")], TIMEOUT, child_env()).check()
        finally:
            other_chain.result()  # its launches end by their own timeouts; its failure is reported too
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
    assert max(abs(a - b) for a, b in zip(got, expected)) <= BOUND * scale  # float64, 60 steps, another order
    assert abs(end(whole, 0)["loss"] - end(ref, 0)["loss"]) <= BOUND * end(ref, 0)["loss"]
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
        # after healing, the new group (its second process) takes part in every step from the next one on
        second = pids(folder, lost, rank)[1]
        back = [e["step"] for e in events(folder, lost, rank) if e["event"] == "step" and e["committed"]
                and e["pid"] == second]
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
    """The interrupted run ends with another loss than the uninterrupted one, and the steps it took while group 1
    was away account for all of it: one process replaying its schedule (each global batch of 8, of which only
    group 0's 4 examples while group 1 was away, and none for a step that did not commit) ends on the same
    weights (BOUND of the largest after 60 float64 steps, against at least 1000 times that between the
    interrupted and the uninterrupted runs) and the same loss."""
    kill, whole = end(runs["kill"], 0), end(runs["whole"], 0)
    alone = [s for s, dp in steps(runs["kill"], 0) if dp == 1]
    assert kill["short_steps"] == [[s, 1] for s in alone]
    assert kill["loss"] != whole["loss"]
    replay = end(runs["replay"], 0)
    scale = max(abs(v) for v in kill["params"])
    explained = max(abs(a - b) for a, b in zip(replay["params"], kill["params"]))
    interrupted = max(abs(a - b) for a, b in zip(whole["params"], kill["params"]))
    assert explained <= BOUND * scale  # float64 over 60 steps, summed in another order
    assert interrupted >= 1000 * BOUND * scale  # what the interruption changed, the replay accounts for
    assert abs(replay["loss"] - kill["loss"]) <= BOUND * kill["loss"]


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


@pytest.fixture(scope="module")
def srun_groups(module_dirs, slurm_cluster):
    """Launch 6 of the module doc: the groups started by hand, as on several hosts."""
    folder = module_dirs.mktemp("replica_srun")
    started = []
    with lighthouse_by_hand() as address:

        def group(index: int, restarts: int = 0) -> subprocess.Popen:
            log = open(folder.parent / f"srun_group{index}_{restarts}.log", "w")
            args = ["--out", str(folder), "--steps", str(STEPS), *PACE, "--kill-group", "1", "--kill-at", "8"]
            started.append(subprocess.Popen(command("srun", str(SCRIPT), args, nproc=1),
                                            env=group_env(address, index, 2, restarts, slurm_cluster), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True))
            return started[-1]

        try:
            survivor, lost = group(0), group(1)
            first = lost.wait(timeout=TIMEOUT)  # killed after its step 8
            time.sleep(5)  # as a requeue would: the survivor goes on alone meanwhile (past the 2 s heartbeat timeout)
            again = group(1, restarts=1)
            codes = (first, survivor.wait(timeout=TIMEOUT), again.wait(timeout=TIMEOUT))
            output = "".join(p.read_text() for p in sorted(folder.parent.glob("srun_group*.log")))
            return {"folder": folder, "codes": codes, "output": output}
        finally:
            for process in started:
                kill_session(process.pid)


def test_groups_started_by_hand_under_srun_survive_a_kill_as_the_docs_say(srun_groups):
    first, survivor, again = srun_groups["codes"]
    assert first != 0 and (survivor, again) == (0, 0), srun_groups["output"][-3000:]
    check_survival(srun_groups["folder"], survivor=0, lost=1, lost_after=8, total=STEPS)
    assert "replica group 1 healed from a live peer at step" in srun_groups["output"]
