"""The reduced form of bench/exit/exit_stress.py: short jobs that end without ud.shutdown() exit cleanly,
and the facade's exit handler tore down what it started.

The full benchmark (30 launches per launcher) measures the exit-crash rate; here one launch per
launcher (plus every other launch of the suite, none of which is retried) guards against it coming
back (it was about 1 launch in 6-30 of heavier jobs before the facade destroyed its process group at
exit, issue 12 item 9). A crash that comes now and then cannot fail a test reliably (this small
worker did not crash without the fix either), so each rank also reports, from an atexit handler that
runs after the facade's, whether its process group, DDP reducer or Horovod is still alive: all three
must be gone under every launcher, after having been alive while it trained.
"""
import importlib.util
import json
import sys

import pytest

from unified_dist.testing.launchers import ROOT, child_env, run, unavailable

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.fresh_python]  # a process's own exit
LAUNCHERS = ["torchrun", "accelerate"] + (["horovodrun"] if importlib.util.find_spec("horovod") else [])


def test_short_jobs_exit_cleanly_under_every_launcher(tmp_path):
    if "horovodrun" not in LAUNCHERS:
        unavailable("horovod is not installed (make setup)")  # skips, or fails under CI=true
    out = tmp_path / "exit_stress.json"
    result = run([sys.executable, str(ROOT / "bench" / "exit" / "exit_stress.py"), "--launches", "1",
                  "--launchers", ",".join(LAUNCHERS), "--timeout", "90", "--out", str(out)],
                 timeout=600, env=child_env())
    report = json.loads(out.read_text())
    assert set(report["launchers"]) == set(LAUNCHERS)
    missed = {launcher: counts["first_teardown_missed"].splitlines()[0]
              for launcher, counts in report["launchers"].items() if counts["teardowns_missed"]}
    assert not missed, missed
    for launcher, counts in report["launchers"].items():
        assert counts["launches"] == 1, (launcher, counts)
        assert counts["exit_crashes"] == 0 and counts["failures"] == 0, (launcher, counts, result.output[-3000:])
        reports = counts["first_exit_reports"]
        assert [rep and rep["rank"] for rep in reports] == [0, 1], (launcher, reports)
        for rep in reports:
            # while it trained: a DDP wrapper over a torch group (torch, Accelerate), or Horovod running
            trained_on = ({"process_group": False, "ddp_reducer": False, "horovod": True} if launcher == "horovodrun"
                          else {"process_group": True, "ddp_reducer": True, "horovod": False})
            assert rep["running"] == trained_on, (launcher, rep)
            assert rep["at_exit"] == {"process_group": False, "ddp_reducer": False, "horovod": False}, (launcher, rep)
    assert result.returncode == 0, result.output[-3000:]
    assert report["commit"] and report["command"] and len(report["load_before"]) == 3
