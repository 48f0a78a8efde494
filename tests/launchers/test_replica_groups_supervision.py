"""Issue #58, the launcher's side: ``unified-dist launch --replica-groups`` supervises everything it starts.

The script is tests/launchers/workers/replica_stop_worker.py: the loop of docs/preemption.md (``ud.should_stop()``
after each step, then ``ud.save_checkpoint`` and ``ud.requeue()``) under replica groups. Three launches, 2 groups of
1 process each, shared by every assertion:

1. the lighthouse is killed with SIGKILL once both groups have committed 3 steps; once both have committed 3
   more steps with both groups in them, the launcher gets SIGTERM (a preemption). Before #58 the groups failed
   to reach the dead lighthouse and the launch ended with exit 1; SIGTERM killed every group with nothing saved
   and exit 143;
2. a short job whose group 1 is killed after step 4: the survivor finishes alone while the restarted group is
   slow to come up (it waits for the survivor's end, which makes the slow restart certain), so the replacement
   finds no live group to heal from. Before #58 the launch exited 1 although the job's work was done;
3. group 1's ``ud.init`` refuses a setting and the script exits 2, as the examples do on a usage error. Before #58
   the launcher started it again 3 times.
"""
from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Optional

import pytest

from unified_dist.cli.replica_child import READY
from unified_dist.cli.replicas import STOP_GRACE_S
from unified_dist.testing.launchers import ROOT
from unified_dist.testing.replica_runs import Launch, events, launch_command

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
SCRIPT = ROOT / "tests" / "launchers" / "workers" / "replica_stop_worker.py"
START_S = 300
"""How long two groups may take to commit their first steps on a loaded 2-core machine (torchrun, torch's import)."""


def committed(out: Path, group: int) -> list:
    """The steps ``group`` committed so far (``ud.data_parallel_world_size()`` with each), in order."""
    if not (out / f"group{group}_rank0.jsonl").exists():
        return []
    return [(e["step"], e["dp"]) for e in events(out, group) if e["event"] == "step" and e["committed"]]


def starts(out: Path, group: int) -> list:
    return [e for e in events(out, group) if e["event"] == "start"]


def start(folder: Path, *args: str, run_dir: Optional[Path] = None) -> Launch:
    """``unified-dist launch --replica-groups 2`` of the worker (no ``--backend``: it implies torch) in the
    background, writing to ``folder/out``, its output in ``folder/launch.log``; ``run_dir``: the launcher's
    ``--replica-log-dir`` (else a new folder its first line names)."""
    given = ["--replica-log-dir", str(run_dir)] if run_dir else []
    return Launch(launch_command([SCRIPT, "--out", folder / "out", *args], flags=given), folder / "launch.log",
                  out=folder / "out")


@pytest.fixture(scope="module")
def preempted(module_dirs):
    """Launch 1 of the module doc."""
    launch = start(module_dirs.mktemp("replica_lighthouse_then_sigterm"), "--steps", "100000", "--step-sleep", "0.1")
    out = launch.out
    with launch:
        launch.wait_for(lambda: all(len(committed(out, g)) >= 3 for g in (0, 1)), START_S, "3 steps on each group")
        pid = launch.lighthouse_pid
        before = {g: len(committed(out, g)) for g in (0, 1)}
        os.kill(pid, signal.SIGKILL)
        launch.wait_for(lambda: all(sum(dp == 2 for _, dp in committed(out, g)[before[g]:]) >= 3 for g in (0, 1)),
                        120, "3 steps of both groups after the lighthouse's death")
        sent = time.monotonic()
        launch.process.send_signal(signal.SIGTERM)
        code = launch.wait(STOP_GRACE_S + 60)
        return {"launch": launch, "code": code, "stop_s": time.monotonic() - sent, "lighthouse_pid": pid,
                "before": before}


def test_a_killed_lighthouse_comes_back_on_its_address_and_the_groups_train_on(preempted):
    launch = preempted["launch"]
    port = re.search(r"\+ torchft lighthouse at http://localhost:(\d+) ", launch.output).group(1)
    assert (f"the torchft lighthouse (pid {preempted['lighthouse_pid']}) exited with 137; starting it again at "
            f"http://localhost:{port}") in launch.output
    assert f"the torchft lighthouse is back at http://localhost:{port}" in launch.output
    # its output is kept beside the run (a new folder in the temporary directory): both starts listened on one port
    assert launch.run_dir.parent == Path(tempfile.gettempdir())
    assert (launch.run_dir / "lighthouse.log").read_text().count(f"{READY}{port}") == 2
    for g in (0, 1):
        assert len(starts(launch.out, g)) == 1, "a group was started again: the lighthouse's death reached it"
        steps = committed(launch.out, g)
        assert [s for s, _ in steps] == list(range(1, len(steps) + 1)), "a step was lost or repeated"
        assert sum(dp == 2 for _, dp in steps[preempted["before"][g]:]) >= 3  # both groups, through the new one


def test_sigterm_to_the_launcher_reaches_every_group_which_saves_and_the_launch_exits_75(preempted):
    launch = preempted["launch"]
    assert preempted["code"] == 75, launch.output[-4000:]
    assert preempted["stop_s"] < STOP_GRACE_S, preempted["stop_s"]  # within the grace: nothing was killed
    assert "SIGTERM: passing it to replica groups 0, 1, which have 30 s to stop at an agreed step and save" in \
        launch.output
    assert "every replica group stopped and ended with 75 (saved for a requeue: run the job again to resume)" in \
        launch.output
    import torch

    stops = {}
    for g in (0, 1):
        stop = [e for e in events(launch.out, g) if e["event"] == "stop"]
        assert len(stop) == 1, f"group {g} did not stop once at an agreed step"
        stops[g] = stop[0]["step"]
        assert committed(launch.out, g)[-1][0] == stops[g]  # it stopped at the step it saved
        saved = torch.load(stop[0]["checkpoint"], weights_only=True)
        assert saved["optimizer"]["steps_taken"] == stops[g]
        record = json.loads((launch.run_dir / "status" / f"group{g}" / "start0" / "rank0.json").read_text())
        assert record == {"code": 75, "usage": False}
    # each group agrees its stop inside itself; a group whose peer left one step earlier takes that step alone
    assert abs(stops[0] - stops[1]) <= 1, stops


@pytest.fixture(scope="module")
def late_restart(module_dirs):
    """Launch 2 of the module doc."""
    with start(module_dirs.mktemp("replica_late_restart"), "--steps", "14", "--step-sleep", "0.1",
               "--kill-group", "1", "--kill-at", "4", "--restart-waits-for", "group0_rank0.ended") as launch:
        return {"launch": launch, "code": launch.wait(START_S + 120)}


def test_a_restart_that_comes_after_the_survivor_finished_ends_the_job_well(late_restart):
    launch = late_restart["launch"]
    assert late_restart["code"] == 0, launch.output[-4000:]
    lines = [line for line in launch.output.splitlines() if "ended well" in line]
    assert len(lines) == 1 and re.fullmatch(
        r"unified-dist launch: replica group 1 exited with \d+ after replica group 0 ended well: group 0's final "
        r"state stands, and the late restart had nothing left to do", lines[0]), lines
    assert [s for s, _ in committed(launch.out, 0)] == list(range(1, 15))  # the survivor did the whole job
    assert [e["restarts"] for e in starts(launch.out, 1)] == [0, 1]
    assert committed(launch.out, 1)[-1][0] == 4  # the replacement committed nothing


@pytest.fixture(scope="module")
def usage_error(module_dirs):
    """Launch 3 of the module doc."""
    folder = module_dirs.mktemp("replica_usage_error")
    with start(folder, "--steps", "100000", "--usage-error-group", "1", run_dir=folder / "run") as launch:
        return {"launch": launch, "code": launch.wait(START_S), "folder": folder}


def test_a_usage_error_is_not_restarted_and_stops_the_job_with_its_status(usage_error):
    launch = usage_error["launch"]
    assert usage_error["code"] == 2, launch.output[-4000:]
    assert "unified-dist launch: replica group 1 stopped on a usage error (exit status 2); it would fail the same " \
           "way again, so it is not started again" in launch.output
    assert "starting it again" not in launch.output
    assert len(starts(launch.out, 1)) == 1
    assert [e["event"] for e in events(launch.out, 1)] == ["start", "usage-error"]
    # --replica-log-dir holds the run's folder: the lighthouse's log, and the record that told the launcher
    assert launch.run_dir == usage_error["folder"] / "run" and (launch.run_dir / "lighthouse.log").exists()
    assert json.loads((launch.run_dir / "status" / "group1" / "start0" / "rank0.json").read_text()) == \
        {"code": 2, "usage": False}
