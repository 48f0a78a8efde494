"""The reduced form of bench/exit_stress.py: short jobs that end without ud.shutdown() exit cleanly.

The full benchmark (30 launches per launcher) measures the exit-crash rate; here one launch per
launcher (plus every other launch of the suite, none of which is retried) guards against it coming back
(it was about 1 launch in 6-30 before the
facade destroyed its process group at exit, issue 12 item 9).
"""
import importlib.util
import json
import sys

import pytest

from unified_dist.testing.launchers import ROOT, child_env, run, unavailable

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
LAUNCHERS = ["torchrun", "accelerate"] + (["horovodrun"] if importlib.util.find_spec("horovod") else [])


def test_short_jobs_exit_cleanly_under_every_launcher(tmp_path):
    if "horovodrun" not in LAUNCHERS:
        unavailable("horovod is not installed (make setup)")  # skips, or fails under CI=true
    out = tmp_path / "exit_stress.json"
    result = run([sys.executable, str(ROOT / "bench" / "exit_stress.py"), "--launches", "1",
                  "--launchers", ",".join(LAUNCHERS), "--timeout", "90", "--out", str(out)],
                 timeout=600, env=child_env())
    report = json.loads(out.read_text())
    assert set(report["launchers"]) == set(LAUNCHERS)
    for launcher, counts in report["launchers"].items():
        assert counts["launches"] == 1, (launcher, counts)
        assert counts["exit_crashes"] == 0 and counts["failures"] == 0, (launcher, counts, result.output[-3000:])
    assert result.returncode == 0, result.output[-3000:]
    assert report["commit"] and report["command"] and len(report["load_before"]) == 3
