"""unified_dist/testing/preloaded.py: each run behaves as ``python SCRIPT ARGS`` would, alone.

One launch of the preloaded process runs every case below (one import of torch for all of them); each case's
expectation is what a fresh ``python`` does, written here, not read from the module."""
from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from unified_dist.testing.launchers import ROOT, child_env, run

pytestmark = [pytest.mark.distributed]  # the preloaded process and its forks

CASES = {
    # name: (script, args, extra variables, timeout)
    "no_import": ("x = torch.ones(1)\n", [], {}, 30),  # globals are the script's own: NameError, status 1
    "exit_3": ("import sys\nprint('before')\nsys.exit(3)\n", [], {}, 30),
    "exit_text": ("raise SystemExit('bad input')\n", [], {}, 30),
    "argv_env_cwd": (textwrap.dedent("""
        import json, os, sys
        import torch
        print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "mine": os.environ.get("MINE"),
                          "leaked": "PRELOADED_ONLY" in os.environ, "path0": sys.path[0], "name": __name__,
                          "file": __file__, "sum": float(torch.ones(3).sum())}))
        """), ["--flag", "v"], {"MINE": "1"}, 30),
    "atexit": ("import atexit\natexit.register(lambda: print('at exit ran'))\n", [], {}, 30),
    "sleeps": ("import time\ntime.sleep(60)\n", [], {}, 2),
    "after_sleep": ("print('next ran')\n", [], {}, 30),
}


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    base = tmp_path_factory.mktemp("preloaded")
    env = {**child_env(), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    plan = []
    for name, (code, args, extra, timeout) in CASES.items():
        folder = base / name
        folder.mkdir()
        (folder / "script.py").write_text(code)
        plan.append({"name": name, "script": "script.py", "args": args, "cwd": str(folder), "env": {**env, **extra},
                     "output": str(folder / "out.txt"), "timeout": timeout})
    (base / "plan.json").write_text(json.dumps(plan))
    launched = run([sys.executable, "-m", "unified_dist.testing.preloaded", str(base / "plan.json"),
                    str(base / "results.json")], 120, {**env, "PRELOADED_ONLY": "1"}, cwd=base)
    assert (base / "results.json").exists(), (launched.returncode, launched.timed_out, launched.output[-3000:])
    results = json.loads((base / "results.json").read_text())
    return launched, results, {name: (base / name / "out.txt").read_text() for name in CASES}


def test_each_run_exits_as_python_would(ran):
    launched, results, out = ran
    launched.check()
    assert results["no_import"]["returncode"] == 1 and "NameError: name 'torch' is not defined" in out["no_import"]
    assert results["exit_3"]["returncode"] == 3 and out["exit_3"] == "before\n"
    assert results["exit_text"]["returncode"] == 1 and out["exit_text"] == "bad input\n"
    assert results["atexit"]["returncode"] == 0 and out["atexit"] == "at exit ran\n"


def test_each_run_has_its_own_argv_environment_folder_and_main(ran):
    _, results, out = ran
    assert results["argv_env_cwd"]["returncode"] == 0, out["argv_env_cwd"]
    seen = json.loads(out["argv_env_cwd"])
    folder = os.path.realpath(seen["cwd"])
    assert seen["argv"] == ["script.py", "--flag", "v"] and folder.endswith("argv_env_cwd")
    assert seen["mine"] == "1" and seen["leaked"] is False  # exactly the run's variables, not the launcher's
    assert os.path.realpath(seen["path0"]) == folder and seen["name"] == "__main__" and seen["sum"] == 3.0
    assert seen["file"] == os.path.join(seen["cwd"], "script.py")  # python makes a script's __file__ absolute


def test_a_run_past_its_timeout_is_killed_and_the_next_one_runs(ran):
    _, results, out = ran
    assert results["sleeps"]["timed_out"] and results["sleeps"]["returncode"] == -9
    assert 2 <= results["sleeps"]["wall_s"] < 10
    assert results["after_sleep"]["returncode"] == 0 and out["after_sleep"] == "next ran\n"


def test_a_run_whose_thread_count_variable_differs_is_refused_in_one_line(tmp_path):
    from unified_dist.testing.preloaded import check_plan

    with pytest.raises(SystemExit, match=r"^preloaded: run 'a' sets OMP_NUM_THREADS='4' but torch was imported "
                                         r"with OMP_NUM_THREADS='1': start this process with the runs' environment$"):
        check_plan([{"name": "a", "env": {"OMP_NUM_THREADS": "4"}}], environ={"OMP_NUM_THREADS": "1"})
